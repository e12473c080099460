"""A draft model for the edit-task model (`spec_edit_task.py`), distilled with `astrai train`'s distill objective.

The student is the edit model's shape at half the width and half the depth (>= 4x fewer parameters), trained on
the same SFT shards with KL(teacher || student) to the edit model's logits (`astrai.train.distill`); it shares the
edit model's tokenizer. `bench_spec.py --workloads edit-draft` serves the pair with
`speculative={"model": <draft>, "num_speculative_tokens": k}`.

`acceptance(model_dir, draft_dir, n)` measures what a draft is for: the share of its guesses the target accepts
on held-out prompts (greedy), through the engine.

Usage: python benchmarks/spec_edit_draft.py [--steps N] [--retrain] [--edit-dir runs/spec_edit]
Prints the acceptance of the distilled draft and of an untrained draft of the same shape; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from rich.console import Console

STEPS = 4000


def draft_model_config(teacher_cfg):
    """Half the edit model's width and depth (heads of 32 dims, MLP 3x, tied embeddings, same context)."""
    from spec_edit_task import edit_model_config

    return edit_model_config(hidden=max(32, teacher_cfg.hidden_size // 2),
                             layers=max(1, teacher_cfg.num_hidden_layers // 2),
                             seq_len=teacher_cfg.max_position_embeddings)  # fmt: skip


def build_edit_draft(edit_dir: Path = Path("runs/spec_edit"), *, steps: int = STEPS, retrain: bool = False,
                     console: Console | None = None, compile: bool = True) -> Path:  # fmt: skip
    """Distill the draft (unless edit_dir/draft exists and `retrain` is off) and return its model folder.

    Needs the edit model (`spec_edit_task.build_edit_model`, which also leaves edit_dir/data: tokenizer, shards).
    """
    from astrai.io.model import load
    from astrai.train.config import TrainConfig
    from astrai.train.distill import DistillConfig
    from astrai.train.loop import train
    from astrai.train.optim import OptimConfig
    from astrai.train.schedule import ScheduleConfig

    console = console or Console()
    edit_dir = Path(edit_dir)
    draft_dir = edit_dir / "draft"
    if (draft_dir / "config.json").is_file() and not retrain:
        console.print(f"reusing the distilled draft in {draft_dir} (pass --retrain to distill again)")
        return draft_dir
    teacher_dir, data = edit_dir / "model", edit_dir / "data"
    if not (teacher_dir / "config.json").is_file():
        raise FileNotFoundError(f"no edit model in {teacher_dir}: run benchmarks/spec_edit_task.py first")
    teacher = load(teacher_dir)
    student_cfg = draft_model_config(teacher.config)
    run_dir = edit_dir / "draft_train"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = TrainConfig(
        data=data / "shards", out_dir=run_dir, model="spec-edit-draft", tokenizer=data / "tokenizer",
        seq_len=teacher.config.max_position_embeddings, batch_size=8, steps=steps,
        optim=OptimConfig(name="muon", lr=3e-3, weight_decay=0.1),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=min(50, steps // 5), total_steps=steps),
        distill=DistillConfig(teacher=teacher_dir, temperature=1.0, alpha=1.0), compile=compile, save_every=0,
        keep_last=1,
    )  # fmt: skip
    console.print(f"distilling a {student_cfg.hidden_size}-wide {student_cfg.num_hidden_layers}-layer draft from "
                  f"{teacher_dir} for {steps} steps")  # fmt: skip
    start = time.perf_counter()
    result = train(cfg, student_cfg)
    if result.model_dir is None:
        raise RuntimeError(f"distillation stopped at step {result.steps}")
    if draft_dir.exists():
        shutil.rmtree(draft_dir)
    shutil.copytree(result.model_dir, draft_dir)
    (edit_dir / "draft_build.json").write_text(json.dumps({"steps": steps, "train_s": round(
        time.perf_counter() - start, 1), "hidden_size": student_cfg.hidden_size,
        "layers": student_cfg.num_hidden_layers}, indent=2) + "\n")  # fmt: skip
    return draft_dir


def acceptance(model_dir: Path | str, draft_dir: Path | str, n: int = 16, k: int = 4) -> dict:
    """The target's acceptance of the draft's guesses on `n` held-out edit prompts (greedy, one engine)."""
    from spec_edit_task import edit_prompts

    import astrai
    from astrai.inference.engine import Engine, EngineConfig
    from astrai.inference.params import SamplingParams

    model = astrai.load(model_dir)
    spec = {"model": str(draft_dir), "num_speculative_tokens": k}
    with Engine(model, EngineConfig(compile=False, kv_budget_tokens=65536, max_running=n, background=False,
                                    speculative=spec)) as engine:  # fmt: skip
        engine.generate(edit_prompts(n, seed=0), SamplingParams(max_tokens=260, temperature=0.0))
        stats = engine.stats()
    rounds, accepted = max(1, stats.spec_drafts), stats.spec_accepted_tokens
    return {"acceptance": accepted / max(1, stats.spec_draft_tokens), "tokens_per_round": (accepted + rounds) / rounds}


def untrained_draft(model_dir: Path | str, folder: Path) -> Path:
    """A random-init draft of the same shape and tokenizer as the distilled one (the negative control)."""
    import astrai
    from astrai.io.model import Model, save

    teacher = astrai.load(model_dir)
    cfg = draft_model_config(teacher.config)
    return save(Model(config=cfg, params=astrai.init_params(cfg), tokenizer=teacher.tokenizer,
                      eos_token_ids=teacher.eos_token_ids), folder)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    import astrai

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edit-dir", type=Path, default=Path("runs/spec_edit"))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--n", type=int, default=16, help="held-out prompts for the acceptance")
    args = parser.parse_args(argv)
    console = Console()
    draft_dir = build_edit_draft(args.edit_dir, steps=args.steps, retrain=args.retrain, console=console)
    model_dir = args.edit_dir / "model"
    sizes = {name: astrai.load(d).num_parameters for name, d in (("target", model_dir), ("draft", draft_dir))}
    with tempfile.TemporaryDirectory() as tmp:
        control = acceptance(model_dir, untrained_draft(model_dir, Path(tmp) / "untrained"), args.n)
    report = {"params": sizes, "ratio": sizes["target"] / sizes["draft"],
              "distilled": acceptance(model_dir, draft_dir, args.n), "untrained": control}  # fmt: skip
    console.print(f"draft {sizes['draft']:,} parameters ({report['ratio']:.1f}x smaller than {sizes['target']:,}); "
                  f"acceptance distilled {report['distilled']['acceptance']:.2f}, untrained "
                  f"{report['untrained']['acceptance']:.2f}")  # fmt: skip
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

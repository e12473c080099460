"""`astrai quickstart` end to end: task → tokenizer → `astrai preprocess` → `astrai train` → eval → samples.

Everything goes through the same public pieces a user would call (the data pipeline, the train loop, the
engine), so the quickstart doubles as a smoke test of the whole stack. Files land in `out_dir`:
`data/` (tokenizer, train.jsonl, shards), `train/` (the training run: config, metrics, loss.png, checkpoints)
and `model/` (the final HF-format folder, loadable by `astrai.load` and servable by `astrai serve`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

import attrs
from rich.console import Console
from rich.table import Table

from astrai.data.config import config_from_dict
from astrai.data.preprocess import preprocess
from astrai.io.model import Model, load
from astrai.models.config import ModelConfig
from astrai.quickstart.evaluate import EvalResult, evaluate
from astrai.quickstart.task import Problem, split_problems, write_jsonl
from astrai.quickstart.vocab import save_tokenizer
from astrai.train.config import TrainConfig
from astrai.train.loop import train
from astrai.train.optim import OptimConfig
from astrai.train.schedule import ScheduleConfig


@attrs.frozen(kw_only=True)
class QuickstartSettings:
    """How big and how long the quickstart run is (the CLI exposes every field)."""

    out_dir: Path = Path("runs/quickstart")
    """Where data, the training run and the final model go."""
    retrain: bool = False
    """Train again even if out_dir/model exists."""
    model: str = "chat-small"
    """Named model config (configs/models.py, resolved by the CLI) or a model folder to fine-tune."""
    steps: int = 800
    """Optimiser steps."""
    batch_size: int = 16
    """Packed rows per step."""
    seq_len: int = 256
    """Tokens per packed row."""
    optim: Literal["muon", "adamw"] = "muon"
    """muon: Muon on the blocks' matrices + AdamW on the rest (`astrai.train.muon`); adamw: AdamW on every leaf.
    Muon leaves the loss plateau (the answer digits guessed) in ~200 steps on every seed and core count tried,
    AdamW anywhere between ~200 and ~550, so with AdamW 800 steps are not always enough (docs/benchmarks.md)."""
    lr: float = 3e-3
    """Peak learning rate (cosine schedule with warmup); with muon, AdamW's and Muon's (RMS-matched) both."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    eval_size: int | None = None
    """Held-out problems to score (default: all of them)."""
    samples: int = 5
    """Sample chats to show."""
    compile: bool = True
    """torch.compile the train step."""
    seed: int = 0
    """Seed for the task split, the initial weights and the data order."""


def _prepare_data(s: QuickstartSettings, train_problems: list[Problem], console: Console) -> tuple[Path, Path]:
    """Tokenizer folder and SFT shard folder for `train_problems`."""
    data = s.out_dir / "data"
    tokenizer_dir = save_tokenizer(data / "tokenizer")
    jsonl = write_jsonl(train_problems, data / "train.jsonl")
    cfg = config_from_dict({
        "kind": "sft", "inputs": [str(jsonl)], "tokenizer": str(tokenizer_dir), "output": str(data / "shards"),
        "sections": [{"field": "messages", "action": "$role", "template": True}],
        "preprocessing": {"max_seq_len": s.seq_len, "max_packed_len": s.seq_len, "packing_strategy": "bfd"},
    })  # fmt: skip
    report = preprocess(cfg, overwrite=True, progress=True)
    console.print(f"data: {report.kept:,} chats packed into {report.rows:,} rows of <= {s.seq_len} tokens")
    return tokenizer_dir, data / "shards"


def _train(s: QuickstartSettings, model_cfg: ModelConfig | None, tokenizer_dir: Path, shards: Path) -> Path:
    run_dir = s.out_dir / "train"
    shutil.rmtree(run_dir, ignore_errors=True)  # a quickstart retrain starts over
    cfg = TrainConfig(
        data=shards, out_dir=run_dir, model=s.model, tokenizer=tokenizer_dir, seq_len=s.seq_len,
        batch_size=s.batch_size, steps=s.steps, optim=OptimConfig(name=s.optim, lr=s.lr, weight_decay=0.1),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=min(s.warmup_steps, s.steps // 5), total_steps=s.steps),
        compile=s.compile, seed=s.seed, save_every=0, keep_last=1,
    )  # fmt: skip
    result = train(cfg, model_cfg)
    if result.model_dir is None:
        raise RuntimeError(f"training stopped at step {result.steps}; rerun `astrai quickstart --retrain`")
    return result.model_dir


def _samples_table(result: EvalResult, n: int) -> Table:
    table = Table(title="sample chats (held-out problems)")
    for column in ("user", "model", "expected", ""):
        table.add_column(column)
    for sample in result.samples[:n]:
        mark = "[green]✓[/]" if sample.correct else "[red]✗[/]"
        table.add_row(sample.problem.question, sample.prediction, sample.problem.answer, mark)
    return table


def run_quickstart(
    s: QuickstartSettings, console: Console | None = None, *, model_cfg: ModelConfig | None = None
) -> EvalResult:
    """Train (unless a saved model exists and `retrain` is off), evaluate on held-out problems, report.

    Args:
        s: the settings; `s.model` names the model in the run's config.
        console: where to report (default: a new rich console).
        model_cfg: the shape to train from scratch (the CLI resolves `s.model` to it, e.g.
            `configs.models.chat_small()`); None: `s.model` is a model folder to fine-tune.
    """
    console = console or Console()
    train_problems, test_problems = split_problems("add2", seed=s.seed)
    model_dir = s.out_dir / "model"
    if (model_dir / "config.json").is_file() and not s.retrain:
        console.print(f"reusing the trained model in {model_dir} (pass --retrain to train again)")
    else:
        console.print(
            f"quickstart: teach a small chat model 2-digit addition ({len(train_problems):,} training problems, "
            f"{len(test_problems):,} held out), on {s.model} for {s.steps} steps"
        )
        tokenizer_dir, shards = _prepare_data(s, train_problems, console)
        trained = _train(s, model_cfg, tokenizer_dir, shards)
        if model_dir.exists():
            shutil.rmtree(model_dir)
        shutil.copytree(trained, model_dir)
    model: Model = load(model_dir)
    problems = test_problems if s.eval_size is None else test_problems[: s.eval_size]
    result = evaluate(model, problems)
    console.print(_samples_table(result, s.samples))
    console.print(f"accuracy: {100 * result.accuracy:.1f}% ({result.correct}/{result.n} held-out problems)")
    console.print(f"model saved in {model_dir}\nserve it: astrai serve --model {model_dir}")
    return result

"""RL rollouts and the GRPO step: astrai's `Engine` vs transformers `generate` on the same weights, and where a GRPO
step's time goes.

Rollouts: P prompts of L random token ids, G samples each of exactly C tokens (`ignore_eos`, temperature 1, no
top-k/top-p), with the sampled tokens' log-probs, which a GRPO trainer needs. astrai: one `Engine(background=False)`
request per prompt with n = G (the G sequences share the prompt's KV) and `logprobs=True`, the way
`astrai.train.rollout` calls it. transformers: `generate(do_sample=True, num_return_sequences=G,
min_new_tokens=max_new_tokens=C, output_logits=True)` on the P prompts as one batch (equal lengths: no padding),
then log_softmax + gather of the sampled tokens (timed with it), on its eager path (`eager`) and, with
`--baseline static-compile`, on a static cache with transformers' own `torch.compile` of the decode forward, warmed
at its shape. Each system runs once untimed (warm-up, compiles; its seconds are recorded as `first_s`), then
`--repeats` rounds alternate the systems; medians with min..max of generated tokens/s (P * G * C tokens).

GRPO step: `astrai.train.loop.train` with `TrainConfig.grpo` on the same model shape (vocabulary from the
quickstart's character tokenizer), addition prompts, G samples of up to C tokens, beta > 0 (so the reference forward
is measured); the per-step split `rollout_s` (generation), `reference_s` (reference forward), `reward_s` and
`train_s` (forward + backward + optimizer) read from the run's metrics, averaged over the steps after the first.

Presets: `cpu` (the scaled-down Qwen3 of bench_throughput, ~54M params): the compiled engine (decode step and
sampler, as a GRPO run with `TrainConfig.compile` gets them) against transformers eager and static-cache + compile
(quiet box, 2026-12-05: astrai 2.55x the stronger of the two, eager there); `smoke` (tiny; seconds),
eager. `--compile` also compiles the GRPO train step of the step-split section (minutes of inductor on 2 cores);
`--grpo-compile/--no-grpo-compile` sets that section alone.
Prints rich tables and the JSON report as the last stdout line (also written to --out).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import console, emit, table
from bench_throughput import build, machine, model_config

from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "cpu_bench_rl.json"
PRESETS = {
    "cpu": dict(config="qwen3-cpu", prompts=4, group=8, prompt_len=32, completion=64, repeats=3, compile=True,
                steps=3, baseline=["eager", "static-compile"]),
    "smoke": dict(config="tiny", prompts=2, group=4, prompt_len=8, completion=8, repeats=1, compile=False, steps=2,
                  baseline="eager"),
}  # fmt: skip


def random_prompts(p: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab, (p, length), generator=gen).tolist()


def astrai_rollout(engine: Engine, prompts: list[list[int]], g: int, c: int, seed: int) -> float:
    """Seconds for G samples of C tokens per prompt, log-probs included (fresh seeds: no cache effect on sampling)."""
    engine.update_params()  # as after an optimizer step: no prefix reuse across repeats
    params = [SamplingParams(max_tokens=c, temperature=1.0, n=g, seed=seed + i, logprobs=True, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == c and len(o.logprobs) == c for d in done for o in d.outputs)
    return elapsed


def hf_rollout(hf, prompts: list[list[int]], g: int, c: int, seed: int, static: bool = False) -> float:
    """Seconds for transformers' sampled generate of the same shape, plus the sampled tokens' log-probs; `static`:
    a static cache and transformers' compiled decode forward (`generate`'s own `torch.compile`)."""
    ids = torch.tensor(prompts, device=hf.device)
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                          top_p=1.0, num_return_sequences=g, max_new_tokens=c, min_new_tokens=c, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, disable_compile=not static,
                          **({"cache_implementation": "static"} if static else {}))  # fmt: skip
        logits = torch.stack(out.logits, dim=1).float()  # [P * G, C, V]
        new = out.sequences[:, ids.shape[1] :]
        logps = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None])[..., 0]
    elapsed = time.perf_counter() - start
    assert logps.shape == (len(prompts) * g, c)
    return elapsed


def spread(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def rollout_section(args) -> dict:
    cfg = model_config(args.config)
    hf, model = build(cfg, torch.float32, "cpu")
    prompts = random_prompts(args.prompts, args.prompt_len, cfg.vocab_size)
    rows = args.prompts * args.group
    engine = Engine(model, EngineConfig(compile=args.compile, background=False, max_running=rows,
                                        kv_budget_tokens=rows * (args.prompt_len + args.completion + 32),
                                        max_model_len=args.prompt_len + args.completion + 16))  # fmt: skip
    systems = {"astrai": lambda seed: astrai_rollout(engine, prompts, args.group, args.completion, seed)}
    for path in args.baseline:
        name = "transformers" if path == "eager" else f"transformers_{path.replace('-', '_')}"
        systems[name] = functools.partial(hf_rollout, hf, prompts, args.group, args.completion,
                                          static=path == "static-compile")  # fmt: skip
    first = {name: run(0) for name, run in systems.items()}  # warm-up: compiles, caches
    console.print(f"first calls (s): {first}", style="dim")
    times = {name: [] for name in systems}
    for r in range(args.repeats):  # rounds alternate the systems, so load drifts touch both alike
        for name, run in systems.items():
            times[name].append(run(100 + r))
        console.print(f"round {r}: " + ", ".join(f"{n} {t[-1]:.1f}s" for n, t in times.items()), style="dim")
    tokens = rows * args.completion
    out = {name: dict(wall_s=spread(t), tok_s=spread([tokens / s for s in t]), first_s=first[name])
           for name, t in times.items()}  # fmt: skip
    hf_names = [n for n in out if n.startswith("transformers")]
    best = max(hf_names, key=lambda n: out[n]["tok_s"]["median"])
    # per-round ratios against the strongest transformers path (rounds are paired: the same load)
    ratios = [a / b for a, b in zip(times[best], times["astrai"], strict=True)]
    out["strongest_baseline"] = best
    out["astrai_x"] = out["astrai"]["tok_s"]["median"] / out[best]["tok_s"]["median"]
    out["astrai_x_rounds"] = spread(ratios)
    out["generated_tokens"] = tokens
    return out


def grpo_section(args) -> dict:
    from astrai.configs.models import NAMED
    from astrai.quickstart.task import make_problems
    from astrai.quickstart.vocab import save_tokenizer
    from astrai.train import loop
    from astrai.train.config import GRPOConfig, TrainConfig
    from astrai.train.metrics import read_metrics
    from astrai.train.optim import AdamWConfig

    cfg = model_config(args.config) if args.config != "tiny" else NAMED["tiny"]()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = save_tokenizer(root / "tokenizer")
        with open(root / "prompts.jsonl", "w", encoding="utf-8") as f:
            for p in make_problems("add2", 64, seed=0):
                f.write(json.dumps({"prompt": p.question, "answer": p.answer}) + "\n")
        grpo = GRPOConfig(num_generations=args.group, max_completion_tokens=args.completion, beta=0.04,
                          rewards=("exact_match", r"regex:(?s).*\d.*"))  # fmt: skip
        train = TrainConfig(data=root / "prompts.jsonl", tokenizer=tokenizer, out_dir=root / "run", model=args.config,
                            seq_len=args.completion + 64, batch_size=args.prompts, steps=args.steps,
                            optim=AdamWConfig(lr=1e-5), compile=args.grpo_compile, grpo=grpo)  # fmt: skip
        loop.train(train, cfg)
        rows = read_metrics(root / "run" / "metrics.jsonl", "train")
    timed = rows[1:] or rows
    split = {k: statistics.mean(r[k] for r in timed) for k in ("rollout_s", "reference_s", "reward_s", "train_s")}
    total = sum(split.values())
    return dict(steps=len(rows), timed_steps=len(timed), seconds=split, share={k: v / total for k, v in split.items()},
                completion_mean_length=statistics.mean(r["completions/mean_length"] for r in timed),
                rollout_tok_s=statistics.mean(args.prompts * args.group * r["completions/mean_length"] / r["rollout_s"]
                                              for r in timed))  # fmt: skip


def show(r: dict) -> None:
    ro = r["rollout"]
    if ro is not None:
        show_rollouts(r, ro)
    g = r["grpo_step"]
    if g is None:
        return
    split = [dict(part=k.removesuffix("_s"), seconds=v, share=g["share"][k]) for k, v in g["seconds"].items()]
    console.print(table(f"GRPO step time split (mean of {g['timed_steps']} steps after the first; completions "
                        f"{g['completion_mean_length']:.1f} tokens, rollout {g['rollout_tok_s']:.1f} tok/s)", split,
                        [("part", ""), ("seconds", ".3f"), ("share", ".1%")]))  # fmt: skip


def show_rollouts(r: dict, ro: dict) -> None:
    names = [n for n in ro if n == "astrai" or n.startswith("transformers")]
    rows = [dict(system=name, tok_s=f"{ro[name]['tok_s']['median']:.1f} ({ro[name]['tok_s']['min']:.1f}.."
                 f"{ro[name]['tok_s']['max']:.1f})", wall_s=ro[name]["wall_s"]["median"], first_s=ro[name]["first_s"])
            for name in names]  # fmt: skip
    x = ro["astrai_x_rounds"]
    title = (f"rollouts: {r['prompts']} prompts x G {r['group']} x {r['completion']} tokens (prompt {r['prompt_len']}),"
             f" {r['config']} fp32, logprobs; astrai {ro['astrai_x']:.2f}x {ro['strongest_baseline']} (rounds "
             f"{x['min']:.2f}..{x['max']:.2f})")  # fmt: skip
    console.print(table(title, rows, [("system", ""), ("tok_s", ""), ("wall_s", ".3f"), ("first_s", ".1f")]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--smoke", action="store_true", help="= --preset smoke (seconds)")
    for name in ("prompts", "group", "prompt_len", "completion", "repeats", "steps"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int)
    parser.add_argument("--config", help="a name from configs/models.py or qwen3-cpu")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, help="compiled engine decode + sampler")
    parser.add_argument(
        "--grpo-compile",
        action=argparse.BooleanOptionalAction,
        help="compile the step-split run (train step and rollouts); default: --compile",
    )
    parser.add_argument(
        "--baseline", nargs="+", choices=["eager", "static-compile"], help="transformers path(s) beside astrai"
    )
    parser.add_argument("--skip-grpo", action="store_true", help="rollouts only")
    parser.add_argument("--skip-rollouts", action="store_true", help="the GRPO step split only")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if isinstance(args.baseline, str):
        args.baseline = [args.baseline]
    if args.grpo_compile is None:
        args.grpo_compile = args.compile
    if args.threads:
        torch.set_num_threads(args.threads)
    report = dict(benchmark="bench_rl", preset=args.preset, config=args.config, prompts=args.prompts,
                  group=args.group, prompt_len=args.prompt_len, completion=args.completion, repeats=args.repeats,
                  compile=args.compile, grpo_compile=args.grpo_compile, baseline=args.baseline,
                  date=time.strftime("%Y-%m-%d"),
                  command="python benchmarks/bench_rl.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  machine=machine("cpu", torch.float32, small=True))  # fmt: skip
    report["rollout"] = None if args.skip_rollouts else rollout_section(args)
    emit(report, args.out)  # the rollouts are kept if the step split fails or is cut short
    report["grpo_step"] = None if args.skip_grpo else grpo_section(args)
    report["machine_after"] = machine("cpu", torch.float32, small=True)  # the load may have changed: both ends
    show(report)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

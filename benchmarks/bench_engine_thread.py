"""A CPU `Engine` stepping on its own thread against stepping on the caller's: libgomp's pools and their spin.

libgomp gives each thread that starts a parallel region a pool of workers and, while the workers of all pools
outnumber the CPUs, cuts every waiting thread's spin to 100 rounds, so a step's ~150 parallel regions each wake a
sleeping worker through the kernel. A background engine (what `astrai serve` runs) has a pool beside the pool of
the thread that loaded the model, which is one too many on a 2-core box. `astrai.openmp.release_idle_threads`
lets the caller's idle workers exit; the engine calls it (docs/inference.md, "CPU: a background engine thread
beside other threads' OpenMP pools"). Arms, each in a fresh process (a pool, once built, lives with its thread):

- `foreground`: `EngineConfig(background=False)`, steps on the caller's thread (one pool);
- `background`: `background=True` as shipped (the caller's idle workers released);
- `background-kept`: `background=True` with the release turned off (the caller's pool kept: the old behaviour);
- `foreground-beside-pool`: a foreground engine while another idle thread holds a pool (it ran one parallel op).

Rounds alternate the arms; each arm's process warms the engine with one call, then times `--calls` calls of
`--requests` prompts of `--prompt` random tokens and `--new` new tokens (greedy, eos ignored). Prints a rich
table (output tok/s, median with min-max over the rounds' medians) and the JSON report as the last stdout line.
`--smoke`: the tiny config, one round, a few tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import console, emit, table

ARMS = ("foreground", "background", "background-kept", "foreground-beside-pool")
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "cpu_bench_engine_thread.json"


def worker(args: argparse.Namespace) -> dict:
    """One arm in this process: build the engine, warm it, time the calls; returns the arm's tok/s per call."""
    import threading

    import torch

    import astrai
    import astrai.inference.engine as engine_module
    from astrai.configs.models import NAMED
    from astrai.inference.engine import Engine, EngineConfig
    from astrai.inference.params import SamplingParams
    from astrai.io.model import Model
    from astrai.models.decoder import init_params

    torch.set_num_threads(args.threads)
    cfg = NAMED[args.config]()
    model = Model(config=cfg, params=astrai.tree.cast(init_params(cfg, seed=0), getattr(torch, args.dtype)))
    if args.arm == "background-kept":
        engine_module.release_idle_threads = lambda: False
    if args.arm == "foreground-beside-pool":
        held = threading.Event()

        def idle_pool() -> None:
            torch.ones(1 << 22).sum()  # one parallel region: this thread now holds a pool of its own
            held.set()
            threading.Event().wait()

        threading.Thread(target=idle_pool, daemon=True).start()
        held.wait(60)
    generator = torch.Generator().manual_seed(0)
    prompts = lambda: [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=generator).tolist()  # noqa: E731
                       for _ in range(args.requests)]  # fmt: skip
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    background = args.arm.startswith("background")
    config = EngineConfig(compile=True, max_running=args.requests, background=background,
                          max_step_tokens=max(2048, args.requests * args.prompt))  # fmt: skip
    rates = []
    with Engine(model, config) as engine:
        engine.generate(prompts(), params)  # compiles, first-call costs
        for _ in range(args.calls):
            start = time.perf_counter()
            engine.generate(prompts(), params)
            rates.append(args.requests * args.new / (time.perf_counter() - start))
    return {"arm": args.arm, "tok_s": rates}


def run(args: argparse.Namespace) -> dict:
    samples: dict[str, list[float]] = {arm: [] for arm in args.arms}
    for round_ in range(args.rounds):
        order = list(args.arms) if round_ % 2 == 0 else list(reversed(args.arms))
        for arm in order:
            command = [sys.executable, __file__, "--worker", arm, *args.passthrough]
            proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"{arm} failed: {proc.stderr[-2000:]}")
            rates = json.loads(proc.stdout.strip().splitlines()[-1])["tok_s"]
            samples[arm].append(statistics.median(rates))
            console.print(f"round {round_}: {arm} {samples[arm][-1]:.1f} tok/s", highlight=False)
    rows = [{"arm": arm, "tok_s": statistics.median(v), "tok_s_min": min(v), "tok_s_max": max(v), "rounds": len(v)}
            for arm, v in samples.items()]  # fmt: skip
    base = next((r["tok_s"] for r in rows if r["arm"] == "foreground"), None)
    for row in rows:
        row["of_foreground"] = row["tok_s"] / base if base else None
    kept = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "passthrough"}
    return {"benchmark": "bench_engine_thread", "args": kept, "threads": args.threads, "rows": rows,
            "samples": samples}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--smoke", action="store_true", help="tiny config, one round, a few tokens")
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.requests, args.prompt, args.new, args.calls, args.rounds = "tiny", 2, 8, 4, 1, 1
    if args.worker:
        args.arm = args.worker
        print(json.dumps(worker(args)), flush=True)
        return 0
    args.passthrough = [f"--config={args.config}", f"--dtype={args.dtype}", f"--requests={args.requests}",
                        f"--prompt={args.prompt}", f"--new={args.new}", f"--calls={args.calls}",
                        f"--threads={args.threads}"]  # fmt: skip
    result = run(args)
    title = (f"{args.config} {args.dtype}, {args.requests} requests of {args.prompt} + {args.new} tokens, "
             f"{args.threads} threads: output tok/s, median of {args.rounds} rounds")  # fmt: skip
    console.print(table(title, result["rows"], [("arm", ""), ("tok_s", ".1f"), ("tok_s_min", ".1f"),
                                                ("tok_s_max", ".1f"), ("of_foreground", ".2f")]))  # fmt: skip
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

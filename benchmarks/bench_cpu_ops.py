"""The CPU ops' kernels in C++ (`cpu_kernels/ops.cpp`) against their Python kernels: µs per call, ms per step.

`astrai::cpu_decode_attention` and `astrai::cpu_matvec` are called from compiled decode steps ~30-150 times a
token. Which kernel the dispatcher runs is fixed once `ops.cpp` is loaded into a process, so each arm runs in its
own worker process: `cpp` (the default build) and `python` (the same process with `ops.cpp` not loaded, as on a
machine without a C++ compiler). Workers alternate, `--rounds` of each; every worker measures
- µs per op call through `torch.ops` (SmolLM2-135M's shapes: 9 query heads over 3 KV heads of 64, contexts of 16
  and 512 tokens; the q/k/v group's products, 576 -> 576 + 192 + 192, at 1 and 4 rows), median of 7 batches;
- with the engine (unless `--no-engine`): ms per decode step of a compiled `Engine` at each of `--rows`
  concurrent requests (512-token prompts, 40 tokens each, greedy), the median step of 5 timed rounds.
Reports each figure's median over the workers with min-max, and python / cpp. Prints a rich table and the JSON
report (last stdout line, also `--out`). `--smoke`: a tiny config, one round, no engine (seconds).
Usage: python benchmarks/bench_cpu_ops.py [--rounds 3] [--rows 1 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import console, emit
from rich.table import Table

ARMS = ("cpp", "python")


def _per_call_us(fn, *, calls: int, batches: int = 7) -> float:
    fn()
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def _engine_ms(name: str, dtype: torch.dtype, rows: int) -> float:
    from astrai.configs.models import NAMED
    from astrai.inference.engine import Engine, EngineConfig
    from astrai.inference.params import SamplingParams
    from astrai.io.model import Model
    from astrai.models.decoder import init_params
    from astrai.tree import cast

    cfg = NAMED[name]()
    model = Model(config=cfg, params=cast(init_params(cfg, seed=0), dtype), tokenizer=None, eos_token_ids=())
    prompts = [[(13 * i + 7 * j) % (cfg.vocab_size - 3) + 3 for j in range(512)] for i in range(rows)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    medians = []
    with Engine(model, EngineConfig(background=False, max_running=8, prefix_cache=False)) as engine:
        for round_ in range(6):  # the first round compiles
            handles, stamps = [engine.submit(p, params) for p in prompts], []
            while engine.step():
                stamps.append(time.perf_counter())
            assert all(len(h.result().outputs[0].token_ids) == 40 for h in handles)
            if round_:
                medians.append(1e3 * statistics.median(b - a for a, b in itertools.pairwise(stamps[rows:])))
    return statistics.median(medians)


def worker(args) -> dict:
    """One arm's figures, in this process."""
    from astrai.cpu_kernels import library

    if args.worker == "python":  # as on a machine without a C++ compiler: the Python kernels serve
        library._load_ops = lambda kernels: "not loaded (the python arm)"
    from astrai.cpu_kernels import decode_attention, matvec

    loaded = library.load()
    dtype = getattr(torch, args.dtype)
    if loaded.reason is not None or matvec.unavailable_reason(dtype) is not None:
        return dict(arm=args.worker, skipped=loaded.reason or matvec.unavailable_reason(dtype))
    heads, kv_heads, dim, page = (4, 2, 16, 16) if args.smoke else (9, 3, 64, 16)
    hidden, kv = (64, 32) if args.smoke else (576, 192)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(64 * page, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(64 * page, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(1, heads, dim, generator=gen).to(dtype)
    table = torch.arange(1, 64, dtype=torch.int32)[None]
    weights = [torch.randn(n, hidden, generator=gen).to(dtype) for n in (hidden, kv, kv)]
    attention, products = torch.ops.astrai.cpu_decode_attention.default, torch.ops.astrai.cpu_matvec.default
    assert decode_attention.supports(q, k, v)
    calls = 50 if args.smoke else 1000
    figures = {}
    for context in (16, 512):
        lens = torch.tensor([context], dtype=torch.int32)
        figures[f"attention, {context} tokens (µs/call)"] = _per_call_us(
            lambda lens=lens: attention(q, k, v, table, lens, page, dim**-0.5, 0), calls=calls
        )
    for rows in (1, 4):
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        figures[f"matvec q/k/v, {rows} rows (µs/call)"] = _per_call_us(lambda x=x: products(x, weights), calls=calls)
    if not args.no_engine and not args.smoke:
        for rows in args.rows:
            figures[f"engine step, {rows} rows (ms)"] = _engine_ms("smollm2-135m", dtype, rows)
    return dict(arm=args.worker, ops_reason=loaded.ops_reason, figures=figures)


def run(args) -> dict:
    command = [sys.executable, __file__, "--dtype", args.dtype, "--rows", *map(str, args.rows)]
    command += ["--smoke"] * args.smoke + ["--no-engine"] * args.no_engine
    reports: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for round_ in range(1 if args.smoke else args.rounds):
        for arm in ARMS:
            console.print(f"[dim]round {round_ + 1}: {arm} worker...[/]")
            proc = subprocess.run([*command, "--worker", arm], capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(f"the {arm} worker failed: {proc.stderr[-2000:]}")
            reports[arm].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    skipped = [r["skipped"] for rs in reports.values() for r in rs if "skipped" in r]
    cpp_reason = next((r["ops_reason"] for r in reports["cpp"] if "figures" in r), None)
    results = []
    if not skipped and cpp_reason is None:
        for name in reports["cpp"][0]["figures"]:
            values = {arm: [r["figures"][name] for r in reports[arm]] for arm in ARMS}
            medians = {arm: statistics.median(v) for arm, v in values.items()}
            results.append(dict(figure=name, **{f"{arm}_median": medians[arm] for arm in ARMS},
                                **{f"{arm}_runs": values[arm] for arm in ARMS},
                                python_over_cpp=medians["python"] / medians["cpp"]))  # fmt: skip
    return dict(
        benchmark="bench_cpu_ops",
        machine=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        dtype=args.dtype,
        rounds=1 if args.smoke else args.rounds,
        skipped=skipped[0] if skipped else None,
        ops_reason=cpp_reason,
        results=results,
    )


def print_table(report: dict) -> None:
    if not report["results"]:
        console.print(f"[yellow]not measured: {report['skipped'] or report['ops_reason']}[/]")
        return
    table = Table(title=f"CPU op kernels, C++ vs Python ({report['dtype']}, {report['threads']} threads, "
                  f"{report['rounds']} workers per arm; median, min-max)")  # fmt: skip
    for col in ("figure", "C++ (ops.cpp)", "Python", "Python / C++"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        cells = [f"{r[f'{a}_median']:.2f} ({min(r[f'{a}_runs']):.2f}-{max(r[f'{a}_runs']):.2f})" for a in ARMS]
        table.add_row(r["figure"], *cells, f"{r['python_over_cpp']:.2f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="worker processes per arm, alternating")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="concurrent requests of the engine step")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--no-engine", action="store_true", help="per-call figures only (seconds per worker)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one round, no engine")
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_cpu_ops.json"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    report = run(args)
    print_table(report)
    emit(report, args.out)


if __name__ == "__main__":
    main()

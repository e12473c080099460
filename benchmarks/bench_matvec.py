"""CPU few-row products (decode's matrix-vector work): the AVX-512 kernel vs inductor's loop vs `F.linear`.

One pass multiplies every projection weight of a model (random weights of a named config, SmolLM2-135M by
default: 30 layers of q/k/v/o/gate/up/down plus the tied LM head) by an activation of R rows, for the row
counts batch-1..8 decode sees. Providers, per R, in the same process and interleaved round by round:
- `F.linear`: eager (MKL sgemm in fp32, oneDNN in bf16);
- `inductor`: the compiled multiply + row-sum loop `astrai.ops.linear` used before the kernel (and still uses
  without AVX-512), one compiled graph per weight shape;
- `kernel`: `astrai.cpu_kernels.matvec`, one call per weight;
- `kernel_groups`: the engine's calls, q/k/v and gate/up in one call each.
GB/s = the weights' bytes / the median time of `--repeats` passes (min-max in the JSON), beside the machine's
read bandwidth (best of 10 sums of 1 GiB, as bench_forward measures its roofline).

`--one-graph` asks what bounds one-row decode: all projections in one compiled graph (as a decode step holds them),
through inductor's loop (what one row runs) and through the kernel op per group, beside a single kernel call over
the weights of the common input width concatenated (all but down_proj: one stream, no per-matrix start) and a sum
of 1 GiB (the read bandwidth), all four interleaved round by round (median GB/s, min-max). The gap between the
single call and the graphs is the price of meeting the weights as ~120 separate matrices per token.

`--step-rows R ...` adds what users get: the median decode step of a compiled `Engine` (`profile_step`'s
workload: R requests decoding, 40 timed steps after warm-up) with the kernel on and off
(`ASTRAI_CPU_KERNELS=1/0`). The switch is read once per process, so each measurement is a fresh process; on and
off alternate for `--rounds` rounds. About a minute per process (build and compile).

Usage: python benchmarks/bench_matvec.py [--config smollm2-135m] [--dtypes bfloat16 float32] [--rows 1 2 4 8]
[--step-rows 1 4 --rounds 2] [--one-graph]. `--smoke` in seconds. Prints a rich table, then the JSON report as
the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import console, emit, table
from bench_forward import memory_bandwidth_gbs

from astrai.configs.models import NAMED
from astrai.cpu_kernels import matvec as cpu_matvec
from astrai.models.decoder import init_params, projection_groups

RESULTS = Path(__file__).parent / "results" / "bench_matvec.json"
PROVIDERS = ("f_linear", "inductor", "kernel", "kernel_groups")


def _row_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # the loop astrai.ops.linear compiles for few rows without the kernel (fp32 accumulation)
    return (x[:, None, :].float() * weight.float()).sum(-1).to(x.dtype)


def _passes(groups: list[tuple[torch.Tensor, ...]], inputs: dict[int, torch.Tensor]) -> dict:
    weights = [w for g in groups for w in g]
    compiled = torch.compile(_row_sum, dynamic=False)
    return {
        "f_linear": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
        "inductor": lambda: [compiled(inputs[w.shape[1]], w) for w in weights],
        "kernel": lambda: [cpu_matvec.matvec(inputs[w.shape[1]], [w]) for w in weights],
        "kernel_groups": lambda: [cpu_matvec.matvec(inputs[g[0].shape[1]], g) for g in groups],
    }


def _interleaved(passes: dict, repeats: int) -> dict[str, list[float]]:
    import time

    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(repeats):  # round by round, so a noisy minute hits every provider alike
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def run(args) -> dict:
    cfg = NAMED[args.config]()
    with torch.device("cpu"):
        params = init_params(cfg)
    bandwidth = memory_bandwidth_gbs()
    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        if not cpu_matvec.supports(dtype):
            console.print(f"[yellow]{dtype_name}: no kernel here ({cpu_matvec.unavailable_reason(dtype)})")
            continue
        groups = [tuple(w.to(dtype) for w in g) for g in projection_groups(params)]
        nbytes = sum(w.nbytes for g in groups for w in g)
        for rows in args.rows:
            inputs = {n: torch.randn(rows, n).to(dtype) for n in {g[0].shape[1] for g in groups}}
            torch._dynamo.reset()  # a graph per weight shape: stay under the recompile limit at every (dtype, rows)
            passes = _passes(groups, inputs)
            with torch.inference_mode():
                for fn in passes.values():
                    fn()  # warm-up: compiles the inductor graphs, builds oneDNN primitives
                times = _interleaved(passes, args.repeats)
            row = {"dtype": dtype_name, "rows": rows}
            for name, ts in times.items():
                ts = sorted(ts)
                median = ts[len(ts) // 2]
                row |= {f"{name}_ms": median * 1e3, f"{name}_min_ms": ts[0] * 1e3, f"{name}_max_ms": ts[-1] * 1e3,
                        f"{name}_gbs": nbytes / median / 1e9}  # fmt: skip
            row["kernel_vs_inductor"] = row["inductor_ms"] / row["kernel_groups_ms"]
            row["fraction_of_bandwidth"] = row["kernel_groups_gbs"] / bandwidth
            results.append(row)
            console.print(f"[dim]{dtype_name} {rows} rows: kernel {row['kernel_groups_gbs']:.1f} GB/s, "
                          f"inductor {row['inductor_gbs']:.1f}, F.linear {row['f_linear_gbs']:.1f}")  # fmt: skip
    return dict(benchmark="bench_matvec", config=args.config, threads=torch.get_num_threads(),
                machine=platform.processor() or platform.machine(), torch=torch.__version__,
                read_bandwidth_gbs=bandwidth, repeats=args.repeats, results=results)  # fmt: skip


def _projections(x: dict[int, torch.Tensor], groups: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    # every projection of a decode step in one graph, through `astrai.ops.linear` (one row: inductor's loop);
    # a few columns of each output are kept, so nothing is dead code and the output stays small
    from astrai.ops.linear import linears

    return torch.cat([y[:, :8].float() for g in groups for y in linears(x[g[0].shape[1]], g, [None] * len(g))], 1)


def _projections_kernel(x: dict[int, torch.Tensor], groups: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    outs = [torch.ops.astrai.cpu_matvec(x[g[0].shape[1]], list(g)).split([w.shape[0] for w in g], 1) for g in groups]
    return torch.cat([y[:, :8] for parts in outs for y in parts], 1)


def run_one_graph(args) -> list[dict]:
    """`--one-graph`: GB/s of one row's products in one compiled graph vs one call over most of those bytes."""
    cfg = NAMED[args.config]()
    with torch.device("cpu"):
        params = init_params(cfg)
    probe = torch.ones((64 if args.smoke else 1024) << 18)  # 1 GiB of fp32 (64 MiB in the smoke)
    dtypes = [getattr(torch, name) for name in args.dtypes]
    return [_one_graph_row(params, dtype, probe, args.repeats) for dtype in dtypes if cpu_matvec.supports(dtype)]


def _one_graph_row(params, dtype: torch.dtype, probe: torch.Tensor, repeats: int) -> dict:
    import statistics

    from astrai.inference.step import SERVED_STEP_OPTIONS

    groups = [tuple(w.to(dtype) for w in g) for g in projection_groups(params)]
    nbytes = sum(w.nbytes for g in groups for w in g)
    x = {n: torch.randn(1, n).to(dtype) for n in {g[0].shape[1] for g in groups}}
    widest = max(x, key=lambda n: sum(w.nbytes for g in groups for w in g if w.shape[1] == n))
    one = torch.cat([w for g in groups for w in g if w.shape[1] == widest])  # one stream of most of the bytes
    torch._dynamo.reset()
    loop = torch.compile(_projections, dynamic=False, options=dict(SERVED_STEP_OPTIONS))
    kernel = torch.compile(_projections_kernel, dynamic=False, options=dict(SERVED_STEP_OPTIONS))
    arms = {
        "probe": (lambda: probe.sum(), probe.nbytes),
        "one_call": (lambda: cpu_matvec.matvec(x[widest], [one]), one.nbytes),
        "graph_loop": (lambda: loop(x, groups), nbytes),
        "graph_kernel": (lambda: kernel(x, groups), nbytes),
    }
    with torch.inference_mode():
        torch.testing.assert_close(loop(x, groups), kernel(x, groups), rtol=2e-2, atol=2e-2)  # the same products
        times = _interleaved({name: fn for name, (fn, _) in arms.items()}, repeats)
    rates = {name: [arms[name][1] / t / 1e9 for t in ts] for name, ts in times.items()}
    row = {"dtype": str(dtype).removeprefix("torch."), "weight_mb": nbytes / 1e6, "matrices": len(groups)}
    for name, values in rates.items():
        row |= {f"{name}_gbs": statistics.median(values), f"{name}_min_gbs": min(values),
                f"{name}_max_gbs": max(values)}  # fmt: skip
    for name in ("one_call", "graph_loop", "graph_kernel"):
        row[f"{name}_of_probe"] = row[f"{name}_gbs"] / row["probe_gbs"]
    return row


def step_worker(dtype_name: str, rows: int, config: str) -> dict:
    """One process's measurement: the median compiled decode step of `rows` requests, ms (p10, p90)."""
    import time

    from profile_step import Workload, build

    from astrai.inference.engine import Engine, EngineConfig

    model = build(config, getattr(torch, dtype_name), "cpu")
    cfg = EngineConfig(background=False, max_running=rows + 4, max_step_tokens=256, prefix_cache=False)
    with Engine(model, cfg) as engine:
        workload = Workload(engine, rows, "cpu")
        for _ in range(5):
            workload.decode()
        times = []
        for _ in range(40):
            start = time.perf_counter()
            workload.decode()
            times.append(time.perf_counter() - start)
    times.sort()
    return {"ms": times[20] * 1e3, "p10_ms": times[4] * 1e3, "p90_ms": times[36] * 1e3}


def run_steps(args) -> list[dict]:
    """Kernel on/off through the engine, alternating fresh processes (the switch is read once per process)."""
    import os
    import subprocess

    out = []
    for dtype_name in args.dtypes:
        for rows in args.step_rows:
            runs: dict[str, list[float]] = {"1": [], "0": []}
            for _ in range(args.rounds):
                for switch in ("1", "0"):
                    proc = subprocess.run(
                        [sys.executable, __file__, "--step-worker", dtype_name, str(rows), "--config", args.config],
                        env={**os.environ, "ASTRAI_CPU_KERNELS": switch}, capture_output=True, text=True,
                        timeout=900, check=True,
                    )  # fmt: skip
                    runs[switch].append(json.loads(proc.stdout.strip().splitlines()[-1])["ms"])
            on, off = sorted(runs["1"]), sorted(runs["0"])
            row = {"dtype": dtype_name, "rows": rows, "on_ms": on[len(on) // 2], "off_ms": off[len(off) // 2],
                   "on_runs_ms": runs["1"], "off_runs_ms": runs["0"]}  # fmt: skip
            row["speedup"] = row["off_ms"] / row["on_ms"]
            out.append(row)
            console.print(f"[dim]{dtype_name} {rows} rows: step {row['on_ms']:.1f} ms on, {row['off_ms']:.1f} off")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny config, fp32, 3 rows (seconds)")
    parser.add_argument("--step-rows", type=int, nargs="*", default=[], help="engine decode steps, on vs off")
    parser.add_argument("--rounds", type=int, default=2, help="on/off process pairs per --step-rows entry")
    parser.add_argument("--one-graph", action="store_true", help="one row: all products in one graph vs one call")
    parser.add_argument("--step-worker", nargs=2, metavar=("DTYPE", "ROWS"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    if args.step_worker:
        print(json.dumps(step_worker(args.step_worker[0], int(args.step_worker[1]), args.config)))
        return 0
    if args.smoke:
        args.config, args.dtypes, args.rows, args.repeats = "tiny", ["float32"], [3], 2  # each graph compiles
    report = run(args)
    if args.one_graph or args.smoke:
        report["one_graph"] = run_one_graph(args)
        console.print(table(f"one row, every projection of {report['config']}: GB/s, median of {args.repeats} "
                            "interleaved rounds (fraction of the 1 GiB sum beside)", report["one_graph"],
                            [("dtype", ""), ("probe_gbs", ".1f"), ("one_call_gbs", ".1f"), ("one_call_of_probe", ".0%"),
                             ("graph_loop_gbs", ".1f"), ("graph_loop_of_probe", ".0%"), ("graph_kernel_gbs", ".1f"),
                             ("graph_kernel_of_probe", ".0%")]))  # fmt: skip
    if args.step_rows:
        report["steps"] = run_steps(args)
        console.print(table(f"compiled decode step of {report['config']} through the Engine, ms, kernel on vs off "
                            f"(median of {args.rounds} processes each)", report["steps"],
                            [("dtype", ""), ("rows", ""), ("on_ms", ".1f"), ("off_ms", ".1f"),
                             ("speedup", ".2f")]))  # fmt: skip
    cols = [("dtype", ""), ("rows", "")] + [(f"{n}_gbs", ".1f") for n in PROVIDERS] + [
        ("kernel_vs_inductor", ".2f"), ("fraction_of_bandwidth", ".0%")]  # fmt: skip
    console.print(table(f"all projections of {report['config']}, {report['threads']} threads: GB/s of weights "
                        f"read, median of {report['repeats']} interleaved passes; read bandwidth "
                        f"{report['read_bandwidth_gbs']:.1f} GB/s", report["results"], cols))  # fmt: skip
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

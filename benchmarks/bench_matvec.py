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

`--step-rows R ...` adds what users get: the median decode step of a compiled `Engine` (`profile_step`'s
workload: R requests decoding, 40 timed steps after warm-up) with the kernel on and off
(`ASTRAI_CPU_KERNELS=1/0`). The switch is read once per process, so each measurement is a fresh process; on and
off alternate for `--rounds` rounds. About a minute per process (build and compile).

Usage: python benchmarks/bench_matvec.py [--config smollm2-135m] [--dtypes bfloat16 float32] [--rows 1 2 4 8]
[--step-rows 1 4 --rounds 2]. `--smoke` in seconds. Prints a rich table, then the JSON report as the last stdout line.
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

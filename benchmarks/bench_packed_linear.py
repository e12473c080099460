"""CPU projections: MKL's GEMM (`F.linear`) vs oneDNN with pre-packed weights, single and grouped.

One pass multiplies every projection weight of a model (random weights of a named config, SmolLM2-135M by
default: 30 layers of q/k/v/o/gate/up/down plus the tied LM head) by an activation of R rows, for the row
counts decode and prefill see. Columns, per R: `F.linear` (MKL sgemm in fp32; in bf16 torch already calls
oneDNN, unpacked), each weight through its own oneDNN pack (`astrai.ops.packed_linear.pack_weights`), and the
engine's layout: q/k/v and gate/up packed as one matrix each (`pack_group`). Median ms per pass over
`--repeats` passes (min-max), the GFLOP/s that makes, and the speed-up of the engine's layout over `F.linear`.
Few-row decode inside compiled graphs takes neither (a multiply + row-sum loop, `astrai.ops.linear`); the
rows shown here are what batched decode and prefill run.

`--int8`: the same weights quantized (`astrai.ops.quant.quantize_int8`), each projection through `ops.linear`
eagerly as prefill runs it (the `cpu_matvec` op: the matvec kernel, or from 22 rows with an fp32 x the blocked
GEMM of `cpu_kernels/gemm_i8.c`), against the path it replaced (the int8 weight widened to the activation dtype for
`F.linear`, then the scale), with the float weights' packed groups as the reference. The three alternate within
each repeat, so a shared machine's slow and fast minutes fall on all of them.

Usage: python benchmarks/bench_packed_linear.py [--config smollm2-135m] [--dtype float32] [--rows 1 8 16 64 256]
[--int8]; `--smoke` in seconds. Prints a rich table, then the JSON report as the last stdout line.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import console, emit, table, timed

from astrai.configs.models import NAMED
from astrai.models.decoder import init_params, projection_groups
from astrai.ops import packed_linear
from astrai.ops.linear import linear
from astrai.ops.quant import quantize_int8

RESULTS = Path(__file__).parent / "results" / "bench_packed_linear.json"


def _weights(args) -> tuple[torch.dtype, list[tuple], list[torch.Tensor]]:
    """(dtype, the projection groups, every weight) of the config's random weights, the groups packed as the
    engine packs them; sets the thread count."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    dtype = getattr(torch, args.dtype)
    with torch.device("cpu"):
        params = init_params(NAMED[args.config]())
    groups = [tuple(w.to(dtype) for w in g) for g in projection_groups(params)]
    for g in groups:
        packed_linear.pack_group(g)
    return dtype, groups, [w for g in groups for w in g]


def run(args) -> dict:
    dtype, groups, weights = _weights(args)
    single = {id(w): torch.ops.mkldnn._reorder_linear_weight(w) for w in weights}
    flops_per_row = 2 * sum(w.numel() for w in weights)
    rows_out = []
    for rows in args.rows:
        inputs = {n: torch.randn(rows, n).to(dtype) for n in {w.shape[1] for w in weights}}

        def gemm(inputs=inputs):
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def packed_single(inputs=inputs):
            for w in weights:
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], single[id(w)], None, "none", [], "")

        def packed_groups(inputs=inputs):
            for g in groups:
                x = inputs[g[0].shape[1]]
                if len(g) > 1:
                    packed_linear.run_packed_group(x, g, [None] * len(g))
                else:
                    packed_linear.run_packed(x, g[0], None)

        row = {"rows": rows}
        with torch.inference_mode():
            for name, fn in (("f_linear", gemm), ("packed", packed_single), ("packed_groups", packed_groups)):
                fn()  # warm-up: oneDNN builds its primitives on the first call
                ms, lo, hi = timed(fn, args.repeats)
                row |= {f"{name}_ms": ms, f"{name}_min": lo, f"{name}_max": hi,
                        f"{name}_gflops": flops_per_row * rows / ms / 1e6}  # fmt: skip
        row["speedup"] = row["f_linear_ms"] / row["packed_groups_ms"]
        rows_out.append(row)
        console.print(f"[dim]{rows} rows: F.linear {row['f_linear_ms']:.1f} ms, groups {row['packed_groups_ms']:.1f}")
    return _report(args, weights, groups, rows_out)


def run_int8(args) -> dict:
    """`--int8`: ms per pass through the int8 kernel (`ops.linear`) vs the widened weight vs the float packs."""
    dtype, groups, weights = _weights(args)
    quantized = [quantize_int8(w) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    rows_out = []
    for rows in args.rows:
        inputs = {n: torch.randn(rows, n).to(dtype) for n in {w.shape[1] for w in weights}}

        def kernel(inputs=inputs):
            for q, scale in quantized:
                linear(inputs[q.shape[1]], q, None, scale)

        def widened(inputs=inputs):
            for q, scale in quantized:
                F.linear(inputs[q.shape[1]], q.to(dtype)) * scale

        def float_packed(inputs=inputs):
            for g in groups:
                packed_linear.run_packed_group(inputs[g[0].shape[1]], g, [None] * len(g))

        arms = {"int8_kernel": kernel, "int8_widened": widened, "float_packed": float_packed}
        times: dict[str, list[float]] = {name: [] for name in arms}
        with torch.inference_mode():
            for fn in arms.values():
                fn()  # warm-up: oneDNN primitives, the kernel library
            for r in range(args.repeats):
                for name in arms if r % 2 == 0 else reversed(arms):
                    times[name].append(timed(arms[name], 1)[0])
        row = {"rows": rows}
        for name, values in times.items():
            ms = statistics.median(values)
            row |= {f"{name}_ms": ms, f"{name}_min": min(values), f"{name}_max": max(values),
                    f"{name}_gflops": flops_per_row * rows / ms / 1e6}  # fmt: skip
        row["speedup"] = row["int8_widened_ms"] / row["int8_kernel_ms"]
        rows_out.append(row)
        console.print(f"[dim]{rows} rows: kernel {row['int8_kernel_ms']:.1f} ms, widened {row['int8_widened_ms']:.1f}")
    return _report(args, weights, groups, rows_out)


def _report(args, weights: list, groups: list, rows_out: list[dict]) -> dict:
    return dict(benchmark="bench_packed_linear", config=args.config, dtype=args.dtype, int8=args.int8,
                threads=torch.get_num_threads(), machine=platform.processor() or platform.machine(),
                torch=torch.__version__, weights=len(weights), groups=len(groups),
                weight_mib=sum(w.nbytes for w in weights) / 2**20, repeats=args.repeats, results=rows_out)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--int8", action="store_true", help="int8 weights: the kernel vs the widened weight")
    parser.add_argument("--smoke", action="store_true", help="tiny config, two row counts (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.rows, args.repeats = "tiny", [1, 32 if args.int8 else 16], 2  # int8: the GEMM from 22
    if not packed_linear.AVAILABLE:
        console.print("[red]this torch build has no oneDNN linear ops")
        return 1
    report = run_int8(args) if args.int8 else run(args)
    arms = ("int8_kernel", "int8_widened", "float_packed") if args.int8 else ("f_linear", "packed", "packed_groups")
    cols = [("rows", "")] + [(f"{n}_{k}", ".1f") for n in arms for k in ("ms", "gflops")] + [("speedup", ".2f")]
    console.print(table(f"all {report['weights']} projections of {report['config']} ({report['weight_mib']:.0f} "
                        f"MiB as {report['dtype']}{', int8 vs float' if args.int8 else ''}), {report['threads']} "
                        f"threads: ms per pass, median of {report['repeats']} (min-max in the JSON)",
                        report["results"], cols))  # fmt: skip
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

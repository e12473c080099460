"""CPU projections: MKL's GEMM (`F.linear`) vs oneDNN with pre-packed weights, single and grouped.

One pass multiplies every projection weight of a model (random weights of a named config, SmolLM2-135M by
default: 30 layers of q/k/v/o/gate/up/down plus the tied LM head) by an activation of R rows, for the row
counts decode and prefill see. Columns, per R: `F.linear` (MKL sgemm in fp32; in bf16 torch already calls
oneDNN, unpacked), each weight through its own oneDNN pack (`astrai.ops.packed_linear.pack_weights`), and the
engine's layout: q/k/v and gate/up packed as one matrix each (`pack_group`). Median ms per pass over
`--repeats` passes (min-max), the GFLOP/s that makes, and the speed-up of the engine's layout over `F.linear`.
Few-row decode inside compiled graphs takes neither (a multiply + row-sum loop, `astrai.ops.linear`); the
rows shown here are what batched decode and prefill run.

Usage: python benchmarks/bench_packed_linear.py [--config smollm2-135m] [--dtype float32] [--rows 1 8 16 64 256]
`--smoke` in seconds. Prints a rich table, then the JSON report as the last stdout line.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import console, emit, table, timed

from astrai.configs.models import NAMED
from astrai.models.decoder import init_params, projection_groups
from astrai.ops import packed_linear

RESULTS = Path(__file__).parent / "results" / "bench_packed_linear.json"


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    dtype = getattr(torch, args.dtype)
    cfg = NAMED[args.config]()
    with torch.device("cpu"):
        params = init_params(cfg)
    groups = [tuple(w.to(dtype) for w in g) for g in projection_groups(params)]
    del params
    weights = [w for g in groups for w in g]
    for g in groups:
        packed_linear.pack_group(g)
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
    return dict(benchmark="bench_packed_linear", config=args.config, dtype=args.dtype,
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
    parser.add_argument("--smoke", action="store_true", help="tiny config, two row counts (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.rows, args.repeats = "tiny", [1, 16], 2
    if not packed_linear.AVAILABLE:
        console.print("[red]this torch build has no oneDNN linear ops")
        return 1
    report = run(args)
    cols = [("rows", "")] + [(f"{n}_{k}", ".1f") for n in ("f_linear", "packed", "packed_groups")
                             for k in ("ms", "gflops")] + [("speedup", ".2f")]  # fmt: skip
    console.print(table(f"all {report['weights']} projections of {report['config']} ({report['weight_mib']:.0f} "
                        f"MiB, {report['dtype']}), {report['threads']} threads: ms per pass, median of "
                        f"{report['repeats']} (min-max in the JSON)", report["results"], cols))  # fmt: skip
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Rotary embedding benchmark: achieved GB/s and fraction of HBM peak over a tokens x heads grid.

Providers (all rotate q [T, H, D] and k [T, K, D] bf16 with per-token fp32 cos/sin [T, D/2]):
    triton         triton_kernels.rotary.rotary (one launch for q and k)
    torch          triton_kernels.rotary.rotary_ref in eager mode
    torch_compile  torch.compile(rotary_ref)
    cuda_ref       our CUDA reference (`cuda_ref.rotary`), when it builds/imports
GB/s counts the bytes a rotation must move, the same for every provider: read q, k, cos, sin and write both
outputs. The fraction of peak uses a table of HBM bandwidths by device name, or a measured device-to-device copy
for unknown devices.

Prints a rich table, writes benchmarks/results/bench_rotary.json and prints that JSON as the last stdout line.
`--smoke` runs one tiny case under the Triton interpreter on CPU against the reference (seconds, for CI).
Without a CUDA device and without `--smoke` there is nothing to measure: it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import bench_ms, console, cuda_ref_fn, device_peaks, emit, table

RESULTS = Path(__file__).resolve().parent / "results" / "bench_rotary.json"


def _providers(interleaved: bool) -> dict[str, Callable]:
    from astrai.triton_kernels.rotary import rotary, rotary_ref

    compiled = torch.compile(rotary_ref)
    providers = {
        "triton": lambda *a: rotary(*a, interleaved=interleaved),
        "torch": lambda *a: rotary_ref(*a, interleaved=interleaved),
        "torch_compile": lambda *a: compiled(*a, interleaved=interleaved),
    }
    if (cuda_rotary := cuda_ref_fn("rotary")) is not None:
        providers["cuda_ref"] = lambda *a: cuda_rotary(*a, interleaved=interleaved)
    return providers


def _moved_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, elem: int) -> int:
    # q and k read and written once, plus the cos and sin rows (fp32).
    return 2 * tokens * (heads + kv_heads) * head_dim * elem + 2 * tokens * (head_dim // 2) * 4


def bench(args: argparse.Namespace, peak: float) -> list[dict]:
    """Time every provider on each (layout, heads, tokens) case; one row per (case, provider)."""
    rows = []
    for interleaved in (False, True):
        providers = _providers(interleaved)
        for heads, kv_heads in args.heads:
            for tokens in args.tokens:
                torch.manual_seed(0)
                q = torch.randn(tokens, heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(tokens, kv_heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
                angles = torch.rand(tokens, args.head_dim // 2, device="cuda") * 6.3
                inputs = (q, k, angles.cos(), angles.sin())
                expected = providers["torch"](*inputs)
                nbytes = _moved_bytes(tokens, heads, kv_heads, args.head_dim, q.element_size())
                for name, fn in providers.items():
                    try:
                        out = fn(*inputs)
                        diff = max(
                            (o.float() - e.float()).abs().max().item() for o, e in zip(out, expected, strict=True)
                        )
                        ms = bench_ms(lambda fn=fn, inputs=inputs: fn(*inputs), graphs=args.graphs)
                    except Exception as e:  # one failing provider must not hide the others
                        console.print(f"[red]{name} T={tokens} H={heads} K={kv_heads} failed: {e}")
                        continue
                    gbps = nbytes / (ms * 1e-3) / 1e9
                    rows.append(dict(layout="interleaved" if interleaved else "half", tokens=tokens, heads=heads,
                                     kv_heads=kv_heads, provider=name, ms=ms, gbps=gbps, frac_peak=gbps * 1e9 / peak,
                                     max_diff_vs_torch=diff))  # fmt: skip
    return rows


def smoke() -> list[dict]:
    """One tiny fp32 case per layout, interpreted on CPU, against the reference."""
    from astrai.triton_kernels.rotary import rotary, rotary_ref

    torch.manual_seed(0)
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    angles = torch.rand(9, 16) * 6.3
    inputs = (q, k, angles.cos(), angles.sin(), torch.tensor([8, 0, 3, 3, 7]))
    rows = []
    for interleaved in (False, True):
        start = time.perf_counter()
        out = rotary(*inputs, interleaved=interleaved)
        ms = (time.perf_counter() - start) * 1e3
        ref = rotary_ref(*inputs, interleaved=interleaved)
        diff = max((o - r).abs().max().item() for o, r in zip(out, ref, strict=True))
        rows.append(dict(layout="interleaved" if interleaved else "half", shape="T=5 H=4 K=2 D=32", ms=ms,
                         max_diff=diff, ok=diff <= 1e-5))  # fmt: skip
    return rows


def _heads(text: str) -> tuple[int, int]:
    heads, kv_heads = text.split(",")
    return int(heads), int(kv_heads)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny interpreted CPU check against the reference (CI)")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 4096, 32768], help="token counts T")
    p.add_argument("--heads", type=_heads, nargs="+", default=[(32, 8), (64, 8)], help="H,K pairs")
    p.add_argument("--head-dim", type=int, default=128, help="head dim D")
    p.add_argument(
        "--no-graphs",
        dest="graphs",
        action="store_false",
        help="time eager launches instead of CUDA-graph replays (adds Python launch overhead)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
        rows = smoke()
        cols = [("layout", ""), ("shape", ""), ("ms", ".1f"), ("max_diff", ".2e"), ("ok", "")]
        console.print(table("rotary vs rotary_ref (interpreter, CPU, fp32)", rows, cols))
        emit(dict(bench="rotary", mode="smoke", rows=rows), args.out)
        return 0 if all(r["ok"] for r in rows) else 1
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        print(json.dumps(dict(bench="rotary", mode="skipped", reason="no CUDA device")))
        return 0
    name = torch.cuda.get_device_name()
    peak, _, source = device_peaks(name, graphs=args.graphs)
    rows = bench(args, peak)
    cols = [("layout", ""), ("tokens", ""), ("heads", ""), ("kv_heads", ""), ("provider", ""), ("ms", ".4f"),
            ("gbps", ".0f"), ("frac_peak", ".1%"), ("max_diff_vs_torch", ".2e")]  # fmt: skip
    console.print(table(f"rotary q+k, bf16, D={args.head_dim}, {name} (peak {peak / 1e12:.2f} TB/s, {source})",
                         rows, cols))  # fmt: skip
    result = dict(bench="rotary", mode="gpu", device=name, cuda_graphs=args.graphs, peak_gbps=peak / 1e9,
                  peak_source=source, rows=rows)  # fmt: skip
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

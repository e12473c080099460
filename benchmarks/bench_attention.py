"""Attention kernel benchmarks: paged decode (GB/s and fraction of HBM peak) and prefill (TFLOP/s).

Decode (one query token per request, every request `ctx` tokens long, pages shuffled in the pool):
    triton      triton_kernels.decode_attention on the paged pool
    torch_sdpa  F.scaled_dot_product_attention on contiguous per-request K/V (enable_gqa)
    cuda_ref    our CUDA reference (`cuda_ref.decode_attention`), when it builds/imports
    flashinfer  BatchDecodeWithPagedKVCacheWrapper on the same pool, when installed
    flash_attn  flash_attn_with_kvcache on contiguous K/V, when installed
GB/s counts the K/V bytes a request must read plus q and out, the same for every provider (so it is an
effective bandwidth); the fraction of peak uses a table of HBM bandwidths by device name, or a measured
device-to-device copy for unknown devices.
Prefill (plain causal prefill, prefix 0): triton_kernels.extend_attention vs torch SDPA (is_causal) and flash-attn,
in TFLOP/s (causal FLOPs = 2 * 2 * B * H * D * ctx^2 / 2).

Prints rich tables, writes benchmarks/results/bench_attention.json and prints that JSON as the last stdout line.
`--smoke` runs one tiny case of each kernel against its reference under the Triton interpreter on CPU (CI).
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
import torch.nn.functional as F
from _common import bench_ms, console, cuda_ref_fn, device_peaks, emit, optional_module, table

RESULTS = Path(__file__).resolve().parent / "results" / "bench_attention.json"


def _paged_case(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, page_size: int) -> dict:
    """bf16 q [B, H, D], a paged pool with shuffled pages, and the same K/V laid out contiguously [B, ctx, K, D]."""
    dev, dtype = "cuda", torch.bfloat16
    pages_per_req = ctx // page_size
    perm = torch.randperm(batch * pages_per_req, device=dev).to(torch.int32)
    block_table = perm.view(batch, pages_per_req)  # [B, P]
    k_nhd = torch.randn(batch, ctx, kv_heads, head_dim, device=dev, dtype=dtype)  # [B, ctx, K, D]
    v_nhd = torch.randn_like(k_nhd)
    k_cache = torch.empty(batch * ctx, kv_heads, head_dim, device=dev, dtype=dtype)  # [S, K, D]
    v_cache = torch.empty_like(k_cache)
    slots = (block_table.long()[:, :, None] * page_size + torch.arange(page_size, device=dev)).view(-1)
    k_cache[slots] = k_nhd.view(-1, kv_heads, head_dim)
    v_cache[slots] = v_nhd.view(-1, kv_heads, head_dim)
    return dict(q=torch.randn(batch, heads, head_dim, device=dev, dtype=dtype), k_cache=k_cache, v_cache=v_cache,
                block_table=block_table, seq_lens=torch.full((batch,), ctx, device=dev, dtype=torch.int32),
                k_nhd=k_nhd, v_nhd=v_nhd)  # fmt: skip


def _decode_providers(c: dict, page_size: int, scale: float, skip: list[str]) -> dict[str, Callable[[], torch.Tensor]]:
    from astrai.triton_kernels.decode_attention import decode_attention

    paged = (c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["seq_lens"])
    kw = dict(page_size=page_size, scale=scale)
    q4 = c["q"][:, :, None]  # [B, H, 1, D]
    k_bhsd, v_bhsd = c["k_nhd"].transpose(1, 2), c["v_nhd"].transpose(1, 2)  # [B, K, ctx, D] views
    providers = {
        "triton": lambda: decode_attention(*paged, **kw),
        "torch_sdpa": lambda: F.scaled_dot_product_attention(q4, k_bhsd, v_bhsd, scale=scale, enable_gqa=True)[:, :, 0],
    }
    if "cuda_ref" not in skip and (cuda_ref_decode := cuda_ref_fn("decode_attention")) is not None:
        providers["cuda_ref"] = lambda: cuda_ref_decode(*paged, **kw)
    if "flashinfer" not in skip and (fi := _flashinfer_decode(c, page_size, scale)) is not None:
        providers["flashinfer"] = fi
    if (fa := optional_module("flash_attn")) is not None:
        lens = c["seq_lens"]
        providers["flash_attn"] = lambda: fa.flash_attn_with_kvcache(
            c["q"][:, None], c["k_nhd"], c["v_nhd"], cache_seqlens=lens, softmax_scale=scale
        )[:, 0]
    return {name: fn for name, fn in providers.items() if name not in skip}


def _flashinfer_decode(c: dict, page_size: int, scale: float) -> Callable[[], torch.Tensor] | None:
    flashinfer = optional_module("flashinfer")
    if flashinfer is None:
        return None
    try:
        batch, heads, head_dim = c["q"].shape
        kv_heads, pages = c["k_cache"].shape[1], c["block_table"].shape[1]
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * pages
        last = torch.full((batch,), page_size, device="cuda", dtype=torch.int32)
        wrapper.plan(indptr, c["block_table"].reshape(-1), last, heads, kv_heads, head_dim, page_size,
                     sm_scale=scale, q_data_type=c["q"].dtype, kv_data_type=c["k_cache"].dtype)  # fmt: skip
        paged = tuple(t.view(-1, page_size, kv_heads, head_dim) for t in (c["k_cache"], c["v_cache"]))
        return lambda: wrapper.run(c["q"], paged)
    except Exception as e:  # API drift between flashinfer versions: skip rather than fail the benchmark
        console.print(f"[yellow]flashinfer decode skipped: {e}")
        return None


def _measure(
    providers: dict[str, Callable[[], torch.Tensor]], label: str, graphs: bool
) -> list[tuple[str, float, float | None]]:
    """(provider, median ms, max |out - torch SDPA out|) per provider; a failing provider is reported and skipped."""
    try:
        expected = providers["torch_sdpa"]().float() if "torch_sdpa" in providers else None
    except Exception as e:  # e.g. out of memory in a math fallback: keep timing the others, without diffs
        console.print(f"[yellow]{label}: torch_sdpa failed ({e}); no diffs")
        expected = None
    results = []
    for name, fn in providers.items():
        try:
            out = fn()
            diff = None if expected is None else (out.float() - expected).abs().max().item()
            results.append((name, bench_ms(fn, graphs=graphs), diff))
        except Exception as e:  # one failing provider must not hide the others
            console.print(f"[red]{label}: {name} failed: {e}")
    return results


def bench_decode(args: argparse.Namespace, peak_bw: float) -> list[dict]:
    """Time every decode provider over the batch x context grid; returns one row per (case, provider)."""
    heads, kv_heads, head_dim, page = args.heads, args.kv_heads, args.head_dim, args.page_size
    rows = []
    for batch in args.batch:
        for ctx in args.ctx:
            torch.manual_seed(0)
            c = _paged_case(batch, ctx, heads, kv_heads, head_dim, page)
            # K and V of every cached token plus q and out, bf16.
            nbytes = 2 * batch * ctx * kv_heads * head_dim * 2 + 2 * batch * heads * head_dim * 2
            providers = _decode_providers(c, page, head_dim**-0.5, args.skip)
            for name, ms, diff in _measure(providers, f"decode B={batch} ctx={ctx}", args.graphs):
                gbps = nbytes / (ms * 1e-3) / 1e9
                rows.append(dict(batch=batch, ctx=ctx, provider=name, ms=ms, gbps=gbps,
                                 frac_peak=gbps * 1e9 / peak_bw, max_diff_vs_sdpa=diff))  # fmt: skip
            del c, providers
            torch.cuda.empty_cache()
    return rows


def _extend_providers(c: dict, q: torch.Tensor, page_size: int, scale: float) -> dict[str, Callable]:
    from astrai.triton_kernels.extend_attention import extend_attention

    batch, ctx = c["k_nhd"].shape[:2]
    cu_seqlens_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * ctx  # [B + 1]
    args = (q, c["k_cache"], c["v_cache"], cu_seqlens_q, c["seq_lens"], c["block_table"])
    q_bhsd = q.view(batch, ctx, *q.shape[1:]).transpose(1, 2)  # [B, H, ctx, D]
    k_bhsd, v_bhsd = c["k_nhd"].transpose(1, 2), c["v_nhd"].transpose(1, 2)  # [B, K, ctx, D]
    providers = {
        "triton": lambda: extend_attention(*args, page_size=page_size, scale=scale),
        "torch_sdpa": lambda: (
            F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, is_causal=True, scale=scale, enable_gqa=True)
            .transpose(1, 2)
            .reshape(q.shape)
        ),
    }
    if (fa := optional_module("flash_attn")) is not None:
        q_nhd = q.view(batch, ctx, *q.shape[1:])  # [B, ctx, H, D]
        providers["flash_attn"] = lambda: fa.flash_attn_func(
            q_nhd, c["k_nhd"], c["v_nhd"], causal=True, softmax_scale=scale
        ).reshape(q.shape)
    return providers


def bench_extend(args: argparse.Namespace, peak_flops: float | None) -> list[dict]:
    """Time plain causal prefill (every request `ctx` new tokens, no prefix); one row per (case, provider)."""
    try:
        import astrai.triton_kernels.extend_attention  # noqa: F401
    except ImportError as e:
        console.print(f"[yellow]extend section skipped: triton_kernels.extend_attention not importable ({e})")
        return []
    heads, kv_heads, head_dim, page = args.heads, args.kv_heads, args.head_dim, args.page_size
    rows = []
    for batch in args.extend_batch:
        for ctx in args.extend_ctx:
            torch.manual_seed(0)
            c = _paged_case(batch, ctx, heads, kv_heads, head_dim, page)
            q = torch.randn(batch * ctx, heads, head_dim, device="cuda", dtype=torch.bfloat16)  # [T, H, D]
            flops = 4 * batch * heads * head_dim * ctx * ctx / 2
            providers = _extend_providers(c, q, page, head_dim**-0.5)
            providers = {name: fn for name, fn in providers.items() if name not in args.skip}
            for name, ms, diff in _measure(providers, f"extend B={batch} ctx={ctx}", args.graphs):
                tflops = flops / (ms * 1e-3) / 1e12
                frac = tflops * 1e12 / peak_flops if peak_flops else None
                rows.append(dict(batch=batch, ctx=ctx, provider=name, ms=ms, tflops=tflops, frac_peak=frac,
                                 max_diff_vs_sdpa=diff))  # fmt: skip
            del c, q, providers
            torch.cuda.empty_cache()
    return rows


def _smoke_case(name: str, shape: str, run: Callable[[], torch.Tensor], ref: Callable[[], torch.Tensor]) -> dict:
    start = time.perf_counter()
    out = run()
    ms = (time.perf_counter() - start) * 1e3
    diff = (out.double() - ref().double()).abs().max().item() if out.numel() else 0.0
    return dict(kernel=name, shape=shape, ms=ms, max_diff=diff, ok=diff <= 1e-4)


def smoke() -> list[dict]:
    """One tiny fp32 case per kernel, interpreted on CPU, against its reference."""
    from astrai.triton_kernels.decode_attention import decode_attention, decode_attention_ref
    from astrai.triton_kernels.kv_store import kv_store_, kv_store_ref_

    torch.manual_seed(0)
    kv_heads, group, head_dim, page = 2, 2, 32, 4
    k_cache = torch.randn(64, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    k, v = torch.randn(2, 5, kv_heads, head_dim).unbind(0)  # [T, K, D] each
    slots = torch.tensor([9, -1, 30, 2, 63])

    def store(fn: Callable) -> torch.Tensor:
        caches = k_cache.clone(), v_cache.clone()
        fn(*caches, k, v, slots)
        return torch.cat(caches)

    rows = [_smoke_case("kv_store_", "T=5 K=2 D=32", lambda: store(kv_store_), lambda: store(kv_store_ref_))]
    block_table = torch.randperm(16)[:12].view(2, 6).to(torch.int32)  # [B, P], shuffled pages
    seq_lens = torch.tensor([5, 19], dtype=torch.int32)
    q = torch.randn(2, kv_heads * group, head_dim)
    paged = (k_cache, v_cache, block_table, seq_lens)
    kw = dict(page_size=page, scale=head_dim**-0.5)
    run, ref = (lambda: decode_attention(q, *paged, **kw)), (lambda: decode_attention_ref(q, *paged, **kw))
    rows.append(_smoke_case("decode_attention", "B=2 H=4 K=2 D=32 N=4", run, ref))
    try:
        from astrai.triton_kernels.extend_attention import extend_attention, extend_attention_ref
    except ImportError as e:
        console.print(f"[yellow]extend_attention smoke skipped: {e}")
        return rows
    q_ext = torch.randn(8, kv_heads * group, head_dim)  # [T, H, D]: 3 new tokens of request 0, 5 of request 1
    ext = (q_ext, k_cache, v_cache, torch.tensor([0, 3, 8], dtype=torch.int32), seq_lens, block_table)
    run, ref = (lambda: extend_attention(*ext, **kw)), (lambda: extend_attention_ref(*ext, **kw))
    rows.append(_smoke_case("extend_attention", "T=8 H=4 K=2 D=32 N=4", run, ref))
    return rows


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny interpreted CPU check of each kernel (CI)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="decode batch sizes")
    p.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096, 16384], help="decode context lengths")
    p.add_argument("--extend-batch", type=int, nargs="+", default=[1, 4], help="prefill batch sizes")
    p.add_argument("--extend-ctx", type=int, nargs="+", default=[1024, 4096, 8192], help="prefill lengths")
    p.add_argument("--heads", type=int, default=32, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=8, help="kv heads K")
    p.add_argument("--head-dim", type=int, default=128, help="head dim D")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (must divide every ctx)")
    p.add_argument("--skip", nargs="+", default=[], help="providers to leave out, e.g. cuda_ref (builds on import)")
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
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        rows = smoke()
        cols = [("kernel", ""), ("shape", ""), ("ms", ".1f"), ("max_diff", ".2e"), ("ok", "")]
        console.print(table("attention kernels vs references (interpreter, CPU, fp32)", rows, cols))
        emit(dict(bench="attention", mode="smoke", rows=rows), args.out)
        return 0 if all(r["ok"] for r in rows) else 1
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        print(json.dumps(dict(bench="attention", mode="skipped", reason="no CUDA device")))
        return 0
    name = torch.cuda.get_device_name()
    peak_bw, peak_flops, source = device_peaks(name, graphs=args.graphs)
    decode = bench_decode(args, peak_bw)
    cols = [("batch", ""), ("ctx", ""), ("provider", ""), ("ms", ".4f"), ("gbps", ".0f"), ("frac_peak", ".1%"),
            ("max_diff_vs_sdpa", ".2e")]  # fmt: skip
    console.print(table(f"paged decode, bf16, H={args.heads} K={args.kv_heads} D={args.head_dim}, {name} "
                         f"(peak {peak_bw / 1e12:.2f} TB/s, {source})", decode, cols))  # fmt: skip
    extend = bench_extend(args, peak_flops)
    cols = [c if c[0] != "gbps" else ("tflops", ".1f") for c in cols]
    console.print(table("causal prefill (extend, prefix 0), bf16", extend, cols))
    result = dict(bench="attention", mode="gpu", device=name, cuda_graphs=args.graphs, peak_gbps=peak_bw / 1e9,
                  peak_source=source, peak_tflops=peak_flops / 1e12 if peak_flops else None, decode=decode,
                  extend=extend)  # fmt: skip
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

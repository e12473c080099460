"""Shared benchmark plumbing: device peaks, timing (CUDA graphs by default), optional providers, output.

Every benchmark prints rich tables and then its JSON report as the last stdout line.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

console = Console(width=140)
# Peak HBM bandwidth (bytes/s) and dense bf16 tensor throughput (FLOP/s) by device-name substring; first match wins.
PEAKS: list[tuple[str, float, float]] = [
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # SXM (device name "H100 80GB HBM3")
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),  # 40 GB parts
    ("L40S", 0.864e12, 362e12),
    ("RTX 4090", 1.008e12, 165e12),
]


def bench_ms(fn: Callable[[], object], *, graphs: bool = True) -> float:
    """Median milliseconds of `fn` on the current CUDA device.

    With `graphs`, `fn` is captured in a CUDA graph and replayed (`triton.testing.do_bench_cudagraph`), which
    removes Python launch overhead: this is how a serving decode step runs. Falls back to plain `do_bench` when
    capture fails.
    """
    import triton.testing

    fn()  # compile / autotune outside the timed region (and outside any capture)
    torch.cuda.synchronize()
    if graphs:
        try:
            return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
        except Exception as e:  # not capturable: time it eagerly and say so
            console.print(f"[yellow]CUDA-graph timing failed ({type(e).__name__}: {e}); timing eagerly")
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def device_peaks(device_name: str, *, graphs: bool = True) -> tuple[float, float | None, str]:
    """(bandwidth B/s, bf16 FLOP/s or None, source) of the current device; measures a copy if unknown."""
    for key, bandwidth, flops in PEAKS:
        if key in device_name:
            return bandwidth, flops, "table"
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), graphs=graphs)
    return 2 * src.numel() * 4 / (ms * 1e-3), None, "measured copy"


def optional_module(module: str):
    """`module` if it imports, else None (a missing optional provider only removes a column)."""
    try:
        return __import__(module, fromlist=["_"])
    except Exception:
        return None


def cuda_ref_fn(name: str) -> Callable | None:
    """The `cuda_ref` Python wrapper `name`, after building the extension; None (with a note) if it can't build."""
    cuda_ref = optional_module("cuda_ref")
    if cuda_ref is None:
        return None
    try:
        cuda_ref.load()  # build once, outside any timed region or graph capture
    except Exception as e:
        console.print(f"[yellow]cuda_ref unavailable: {e}")
        return None
    return getattr(cuda_ref, name)


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """(median, min, max) wall milliseconds of `fn()` over `repeats` calls (CPU; synchronise inside `fn` on GPU)."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - start))
    return statistics.median(out), min(out), max(out)


def table(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> Table:
    """A rich table of `rows`; `columns` are (key, format spec) pairs, floats formatted with the spec."""
    out = Table(title=title)
    for key, _ in columns:
        out.add_column(key, justify="right")
    for row in rows:
        cells = [(row.get(key), spec) for key, spec in columns]
        out.add_row(*["-" if v is None else format(v, f) if f else str(v) for v, f in cells])
    return out


def emit(result: dict, out: Path) -> None:
    """Write `result` as JSON to `out` and print it as the last stdout line."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    console.file.flush()
    print(json.dumps(result), flush=True)


def hf_generate_kwargs(mode: str, cache_len: int) -> dict:
    """transformers `generate` keywords of a baseline: "static-compile" (its fastest decode path: a static cache
    of `cache_len` tokens and `torch.compile`, on every device) or "eager" (a DynamicCache, no compile)."""
    if mode != "static-compile":
        return dict(disable_compile=True)
    from transformers import CompileConfig

    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    return dict(cache_implementation="static", max_cache_len=cache_len, compile_config=compile_config)

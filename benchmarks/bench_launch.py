"""Host time per call of the autotuned Triton attention ops: through `triton.autotune`'s per-call lookup, or from
the config it chose, remembered by `triton_kernels/_launch.py`'s `TunedKernel` (issue 16 item 1).

Outside CUDA graphs (eager and compiled prefill, where attention is an opaque op) every layer calls the split-KV
decode and the extend attention ops once a step, so their host path is paid ~60 times a step on a 30-layer model.
Each op call is timed whole, in inference mode as the engine runs it: the custom-op dispatch, the launcher's checks
and allocations, the tuner's lookup (or the remembered config's), and the kernel launch.

- On a GPU the kernels launch for real; shapes are small, so a call is bound by its host path. Each round ends
  with a device sync, and the per-call figure is the round's wall time over its calls. The same call replayed
  from a CUDA graph (`graph_us`, no host path) gives the device's own time beside it.
- On a machine without one the kernel modules are imported under the Triton interpreter. They run their GPU
  branch (GPU block sizes, the tuner) with each kernel's final `JITFunction.run` stubbed out, so what is timed is
  the host path alone, launch excepted. `ASTRAI_TRITON_AUTOTUNE=0` there: the tuner picks a config without
  timing any.

The two launch paths alternate round by round; medians over rounds, with the min-max. Prints a rich table, then the
JSON report as the last stdout line. `--smoke` runs a few calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before the kernel modules are imported: Triton reads it when a kernel is defined
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["ASTRAI_TRITON_AUTOTUNE"] = "0"

from _common import bench_ms, console, emit, table  # noqa: E402

from astrai.triton_kernels import _launch, decode_attention, extend_attention  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_launch.json"
# SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64 dims, 16-token pages
HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def _stub_launches() -> None:
    """CPU: the GPU branch of both launchers, each kernel's final launch replaced by a no-op."""
    for module, name in ((decode_attention, "_decode_stage1_tuned"), (extend_attention, "_extend_attention_tuned")):
        module.interpreting = lambda: False
        getattr(module, name).autotuner.fn.run = lambda *args, **kwargs: None


def _inputs(rows: int, context: int, new_tokens: int, device: str, dtype: torch.dtype) -> dict:
    pages = -(-(context + new_tokens) // PAGE)
    cache = torch.randn(2, rows * pages * PAGE, KV_HEADS, HEAD_DIM, device=device).to(dtype)
    table_ = torch.arange(rows * pages, dtype=torch.int32, device=device).view(rows, pages)
    lens = torch.full((rows,), context, dtype=torch.int32, device=device)
    decode = dict(q=torch.randn(rows, HEADS, HEAD_DIM, device=device).to(dtype), k_cache=cache[0], v_cache=cache[1],
                  block_table=table_, seq_lens=lens, page_size=PAGE, scale=0.125)  # fmt: skip
    cu = torch.arange(0, (rows + 1) * new_tokens, new_tokens, dtype=torch.int32, device=device)
    extend = dict(q=torch.randn(rows * new_tokens, HEADS, HEAD_DIM, device=device).to(dtype), k_cache=cache[0],
                  v_cache=cache[1], cu_seqlens_q=cu, seq_lens=lens + new_tokens, block_table=table_, page_size=PAGE,
                  scale=0.125)  # fmt: skip
    return {"decode_attention": (torch.ops.astrai.decode_attention, decode),
            "extend_attention": (torch.ops.astrai.extend_attention, extend)}  # fmt: skip


def _round(op, kwargs: dict, calls: int) -> float:
    """Microseconds per call over `calls` calls (synchronised at the end on a GPU)."""
    start = time.perf_counter()
    for _ in range(calls):
        op(**kwargs)
    if CUDA:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def run(args) -> dict:
    device = "cuda" if CUDA else "cpu"
    if not CUDA:
        _stub_launches()
    dtype = getattr(torch, args.dtype)
    cache_configs, rows = _launch.CACHE_CONFIGS, []
    with torch.inference_mode():
        for name, (op, kwargs) in _inputs(args.rows, args.context, args.new_tokens, device, dtype).items():
            for _ in range(3):  # the first call tunes (GPU: times every config) and compiles
                op(**kwargs)
            times = {"tuner": [], "remembered": []}
            for _ in range(args.rounds):
                for launch in times:
                    _launch.CACHE_CONFIGS = launch == "remembered"
                    times[launch].append(_round(op, kwargs, args.calls))
            _launch.CACHE_CONFIGS = cache_configs
            tuner, kept = (statistics.median(times[k]) for k in ("tuner", "remembered"))
            graph = 1e3 * bench_ms(lambda op=op, kwargs=kwargs: op(**kwargs)) if CUDA else None
            rows.append({"op": name, "tuner_us": tuner, "tuner_range": [min(times["tuner"]), max(times["tuner"])],
                         "remembered_us": kept, "remembered_range": [min(times["remembered"]),
                         max(times["remembered"])], "saved_us": tuner - kept, "graph_us": graph})  # fmt: skip
    per_step = sum(r["saved_us"] for r in rows) * args.layers
    return {"benchmark": "bench_launch", "device": torch.cuda.get_device_name() if CUDA else "cpu",
            "kernel_launch": "real" if CUDA else "stubbed (interpreter import, GPU branch)", "dtype": args.dtype,
            "torch": torch.__version__, "rows": args.rows, "context": args.context, "new_tokens": args.new_tokens,
            "calls": args.calls, "rounds": args.rounds, "layers": args.layers, "results": rows,
            "saved_ms_per_step": per_step / 1e3}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="decode rows (and extend requests)")
    parser.add_argument("--context", type=int, default=256, help="tokens already in each request's cache")
    parser.add_argument("--new-tokens", type=int, default=16, help="extend attention's new tokens per request")
    parser.add_argument("--dtype", default="bfloat16" if CUDA else "float32")
    parser.add_argument("--calls", type=int, default=200, help="op calls per timed round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, default=30, help="per-step saving: both ops once per layer")
    parser.add_argument("--smoke", action="store_true", help="a few calls (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.calls, args.rounds = 5, 2
    report = run(args)
    title = f"host time per op call, µs ({report['device']}, kernel launch {report['kernel_launch']})"
    console.print(table(title, report["results"], [("op", "s"), ("tuner_us", ".1f"), ("remembered_us", ".1f"),
                                                   ("saved_us", ".1f"), ("graph_us", ".1f")]))  # fmt: skip
    console.print(f"saved per step of {args.layers} layers (both ops per layer): {report['saved_ms_per_step']:.3f} ms")
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Few-row products `x @ cat(weights).T` on AVX-512 CPUs: the matrix-vector work of batch-1..8 decode.

Why a hand-written kernel: decode on CPU reads every weight once per token per row of the batch, unless a
kernel reads it once for several rows. Inductor's multiply + row-sum loop (`astrai.ops.linear`) re-reads each
weight per row, and oneDNN/MKL run these shapes at 6-10 GB/s. `matvec.c` walks each weight row by row as one
contiguous stream, two x rows per pass; bf16 uses AVX512-BF16's `vdpbf16ps` (exact products, fp32
accumulation), so the weight is never widened. Measured over all projections of SmolLM2-135M on the 2-core
development box: 16-25 GB/s against the loop's 5-12 (bf16, 1-4 rows); a compiled decode step 1.6-2.4x faster
in bf16 at 2-8 rows, 1.1-1.4x in fp32 at 2-4 (docs/benchmarks.md, "CPU matvec kernel").

int8 weights (`astrai.ops.quant`'s weight-only quantization) multiply an fp32 or bf16 x the same way, widened in
registers: the result is the product with the integer weights, and the caller applies the per-row scales. With an
fp32 x and 22 rows or more (prefill), the same entry runs `gemm_i8.c`'s blocked GEMM instead, which widens each
panel of weight rows once for all the rows of x.

bf16 products of 2 rows or more run on AMX tiles where the CPU has them (`amx.c`, called from `matvec.c`'s bf16 entry):
1.15-1.3x the row kernel at 2-3 rows, 2x at 16, and the path of batched bf16 decode (`amx()`, `ops.linear`).

The C source is built with the folder's other kernels on first use (`astrai.cpu_kernels.library`).

`supports(dtype)` says whether the kernel runs here for an x of `dtype` (with weights of that dtype or int8):
an x86-64 CPU with AVX-512 (F, BW, VL; plus AVX512-BF16 for bf16), a working compiler, and `ASTRAI_CPU_KERNELS`
not set to 0. `unavailable_reason()` says why not. `matvec` is always correct: where the kernel cannot run it
computes `matvec_ref`. The `astrai::cpu_matvec` op runs the kernel and raises where it cannot (callers ask
`supports` first); its CPU kernel is `ops.cpp`'s where that builds, else `_op` here. No autograd: callers use it
only when no gradient is needed.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import library
from .library import build_dir

__all__ = ["amx", "build_dir", "matvec", "matvec_ref", "projection", "supports", "unavailable_reason"]

_FUNCTIONS = {torch.float32: "astrai_matvec_f32", torch.bfloat16: "astrai_matvec_bf16"}
_FUNCTIONS_INT8 = {torch.float32: "astrai_matvec_i8_f32", torch.bfloat16: "astrai_matvec_i8_bf16"}  # by x's dtype
# x, M, K, weight pointers, weight rows, weight count, y, threads
_ARGUMENTS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.POINTER(ctypes.c_void_p),
              ctypes.POINTER(ctypes.c_long), ctypes.c_long, ctypes.c_void_p, ctypes.c_int)  # fmt: skip
_KERNELS: dict[bool, dict[torch.dtype, Any]] = {}


def _kernels(int8: bool = False) -> dict[torch.dtype, Any]:
    """The ctypes entry for each x dtype this CPU runs, for weights of x's dtype or int8 (empty without the
    library)."""
    if int8 not in _KERNELS:
        _KERNELS[int8] = library.bind(_FUNCTIONS_INT8 if int8 else _FUNCTIONS, _ARGUMENTS, None)
    return _KERNELS[int8]


def unavailable_reason(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the kernel cannot run `dtype` products here, or None when it can (builds it on first call)."""
    if dtype not in library.FEATURES:
        return f"{dtype} is not supported (fp32 and bf16 are)"
    reason = library.load().reason
    if reason is not None:
        return reason
    if dtype not in _kernels():
        return "this CPU lacks AVX512-BF16" if dtype == torch.bfloat16 else "this CPU lacks AVX-512 (F, BW, VL)"
    return None


@library.constant_when_compiled
def supports(dtype: torch.dtype) -> bool:
    """Whether `matvec` runs the kernel for `dtype` here. A constant to `torch.compile`, which calls it once
    while tracing (so the first compiled trace builds the library)."""
    return unavailable_reason(dtype) is None


AMX_ENV = "ASTRAI_CPU_AMX"


@library.constant_when_compiled
def amx() -> bool:
    """Whether `ops.linear` sends batched bf16 decode products (up to its `AMX_MAX_ROWS` rows) to the kernel, which
    runs them on `amx.c`'s tiles: an AMX CPU whose OS grants the tile state, unless `ASTRAI_CPU_AMX=0`. A constant to
    `torch.compile`, like `supports`."""
    if os.environ.get(AMX_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return supports(torch.bfloat16) and bool(library.load().features & library.AMX)


def matvec_ref(x: Tensor, weights: Sequence[Tensor]) -> Tensor:
    """The plain-torch reference: x [M, K] @ cat(weights).T in fp32 -> [M, sum N] fp32 (int8 weights as their
    integer values)."""
    return x.float() @ torch.cat([w.float() for w in weights]).T


def projection(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None], scales: Sequence[Tensor] | None = None
) -> Tensor:
    """x [..., K] -> [..., sum N] in x's dtype: the `astrai::cpu_matvec` op, then each weight's int8 scale (`scales`,
    one per weight, or None) and bias on its columns in fp32, as `ops.linear`'s loop applies them. Traceable by
    `torch.compile` (the op is opaque); callers check `supports` first."""
    rows = x.numel() // x.shape[-1]
    out = torch.ops.astrai.cpu_matvec(x.reshape(rows, x.shape[-1]), list(weights))
    if scales is not None:
        out = out * torch.cat([s.float() for s in scales])
    if any(b is not None for b in biases):
        zeros = [out.new_zeros(w.shape[0]) for w in weights]
        out = out + torch.cat([z if b is None else b.float() for b, z in zip(biases, zeros, strict=True)])
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def _check(x: Tensor, weights: Sequence[Tensor]) -> None:
    if x.dim() != 2 or not weights:
        raise ValueError(f"matvec takes x [M, K] and at least one weight, got x {tuple(x.shape)}")
    kind = weights[0].dtype if weights[0].dtype in (x.dtype, torch.int8) else x.dtype
    for w in weights:
        if w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != kind or w.device != x.device:
            raise ValueError(
                f"matvec weight {tuple(w.shape)} {w.dtype} on {w.device} does not fit x {tuple(x.shape)} "
                f"{x.dtype} on {x.device} (wanted [N, {x.shape[1]}] on its device, every weight of x's dtype "
                "or every one int8)"
            )


def matvec(x: Tensor, weights: Sequence[Tensor]) -> Tensor:
    """x [M, K] @ cat(weights).T -> [M, sum N] fp32: one call for weights that share an input (q/k/v,
    gate/up), each weight's columns after the previous one's; weights of x's dtype, or all int8 (their integer
    values: the caller applies the scales). The kernel where `supports(x.dtype)`, else `matvec_ref`. Meant for
    few rows (it loads each weight once per two rows of x), and for int8 weights with an fp32 x at any count."""
    _check(x, weights)
    int8 = weights[0].dtype == torch.int8
    kernel = _kernels(int8).get(x.dtype) if x.device.type == "cpu" and x.shape[1] else None
    if kernel is None:
        return matvec_ref(x, weights)
    x = x if x.is_contiguous() else x.contiguous()
    weights = [w if w.is_contiguous() else w.contiguous() for w in weights]
    pointers, rows, total = _arrays(weights)
    out = torch.empty(x.shape[0], total, dtype=torch.float32)
    if out.numel():
        kernel(x.data_ptr(), x.shape[0], x.shape[1], pointers, rows, len(weights), out.data_ptr(),
               torch.get_num_threads())  # fmt: skip
    return out


# (data pointer, rows, columns) of each weight -> the ctypes arrays of their pointers and rows, and the total
# rows: building them costs as much as the rest of a call, and decode passes the same weights every step. The
# key holds the shapes too, so a freed weight's address reused by another tensor never meets a stale entry.
_ARRAYS: dict[tuple, tuple[Any, Any, int]] = {}
_MAX_ARRAYS = 4096


def _arrays(weights: Sequence[Tensor]) -> tuple[Any, Any, int]:
    key = tuple((w.data_ptr(), *w.shape) for w in weights)
    found = _ARRAYS.get(key)
    if found is None:
        if len(_ARRAYS) >= _MAX_ARRAYS:
            _ARRAYS.clear()
        count = len(weights)
        found = _ARRAYS[key] = (
            (ctypes.c_void_p * count)(*(w.data_ptr() for w in weights)),
            (ctypes.c_long * count)(*(w.shape[0] for w in weights)),
            sum(w.shape[0] for w in weights),
        )
    return found


def _op(x: Tensor, weights: list[Tensor]) -> Tensor:
    """The op's Python kernel: `matvec`, raising where the kernel cannot run, as `ops.cpp`'s does (the reason is
    looked up only then: this runs per call where `ops.cpp` is not built)."""
    if x.device.type != "cpu" or x.dtype not in _kernels(bool(weights) and weights[0].dtype == torch.int8):
        reason = unavailable_reason(x.dtype) if x.device.type == "cpu" else f"x is on {x.device}, not the CPU"
        raise ValueError(f"cpu_matvec cannot run here ({reason}); matvec() falls back to plain torch")
    return matvec(x, weights)


# `torch.ops.astrai.cpu_matvec`: opaque to torch.compile, which calls it from compiled decode steps (~120 times a
# token at 2-8 rows). Registered with torch.library directly rather than `custom_op` (a dispatch costs ~8 us
# against ~18 us); under CompositeExplicitAutograd, so that `ops.cpp`'s CPU kernel, where it loads, takes
# precedence (~1 us a dispatch; `library.load` loads it).
_LIBRARY = torch.library.Library("astrai", "FRAGMENT")
_LIBRARY.define("cpu_matvec(Tensor x, Tensor[] weights) -> Tensor")
_LIBRARY.impl("cpu_matvec", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("astrai::cpu_matvec", lib=_LIBRARY)
def _(x: Tensor, weights: list[Tensor]) -> Tensor:
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights), dtype=torch.float32)

"""Batched multi-LoRA update on AVX-512 CPUs (`lora.c`): each row reads only its own slot's adapter factors.

`astrai.ops.lora.lora_delta` calls the `astrai::cpu_lora_delta` op on CPU where `supports(dtype)`; elsewhere it
computes the slot-masked plain-torch form, which multiplies every row by every slot's factors (S times the
arithmetic of this kernel; with 8 slots it made a 16-row decode step 66% slower, this kernel's cost does not grow
with the slot count: docs/benchmarks.md, "CPU multi-LoRA serving: bench_lora").

`supports(dtype)`: fp32 with AVX-512 (F, BW, VL), bf16 with AVX512-BF16 as well (the library's feature bits; the
bf16 entry itself only widens), a working compiler, `ASTRAI_CPU_KERNELS` not 0. `lora_delta` is always correct:
where the kernel cannot run it computes `lora_delta_ref`. No autograd: serving only.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from . import library

__all__ = ["MAX_RANK", "lora_delta", "lora_delta_ref", "supports"]

MAX_RANK = 256  # lora.c's MAX_RANK: the rank the kernel's per-row buffer holds
_FUNCTIONS = {torch.float32: "astrai_lora_f32", torch.bfloat16: "astrai_lora_bf16"}
# x, M, K, a, S, R, b, N, scaling, slots, y, threads
_POINTER, _LONG = ctypes.c_void_p, ctypes.c_long
_INT = ctypes.c_int
_ARGUMENTS = (_POINTER, _LONG, _LONG, _POINTER, _LONG, _LONG, _POINTER, _LONG, _POINTER, _POINTER, _POINTER, _INT)
_KERNELS: dict[torch.dtype, Any] | None = None


def _kernels() -> dict[torch.dtype, Any]:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = library.bind(_FUNCTIONS, _ARGUMENTS, ctypes.c_int)
    return _KERNELS


@library.constant_when_compiled
def supports(dtype: torch.dtype) -> bool:
    """Whether the kernel runs `dtype` here (a constant to `torch.compile`; builds the library on first call)."""
    return dtype in _kernels()


def lora_delta_ref(x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, slot_ids: Tensor) -> Tensor:
    """The plain-torch reference, row by row: x [M, K] -> [M, N] fp32."""
    ids = slot_ids.long().clamp(min=0)
    shrunk = torch.einsum("mk,mrk->mr", x.float(), a[ids].float()) * scaling.float()[ids, None]
    out = torch.einsum("mr,mnr->mn", shrunk, b.float().permute(1, 0, 2)[ids])
    return torch.where((slot_ids >= 0)[:, None], out, 0.0)


def lora_delta(x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, slot_ids: Tensor) -> Tensor:
    """Each row's update, x [M, K] (a [S, R, K], b [N, S, R], scaling [S], slot_ids [M], -1: none) -> [M, N] fp32:
    the kernel where it runs for x's dtype (a and b of that dtype), else `lora_delta_ref`."""
    num_slots, rank, width = a.shape
    if x.dim() != 2 or x.shape[1] != width or b.shape[1:] != (num_slots, rank) or slot_ids.shape != (x.shape[0],):
        shapes = f"x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, slot_ids {tuple(slot_ids.shape)}"
        raise ValueError(f"lora_delta: {shapes} do not fit (x [M, K], a [S, R, K], b [N, S, R], slot_ids [M])")
    kernel = _kernels().get(x.dtype) if x.device.type == "cpu" else None
    if kernel is None or a.dtype != x.dtype or b.dtype != x.dtype or rank > MAX_RANK:
        return lora_delta_ref(x, a, b, scaling, slot_ids)
    x, a, b = (t if t.is_contiguous() else t.contiguous() for t in (x, a, b))
    scaling = scaling.to(torch.float32).contiguous()
    slot_ids = slot_ids.to(torch.int64).contiguous()
    out = torch.empty(x.shape[0], b.shape[0], dtype=torch.float32)
    if out.numel():
        kernel(x.data_ptr(), x.shape[0], width, a.data_ptr(), num_slots, rank, b.data_ptr(), b.shape[0],
               scaling.data_ptr(), slot_ids.data_ptr(), out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


# `torch.ops.astrai.cpu_lora_delta`: opaque to torch.compile (compiled steps call it once per adapted projection).
# Registered with torch.library directly, as `cpu_matvec` is (a cheaper dispatch than `custom_op`).
_LIBRARY = torch.library.Library("astrai", "FRAGMENT")
_LIBRARY.define("cpu_lora_delta(Tensor x, Tensor a, Tensor b, Tensor scaling, Tensor slot_ids) -> Tensor")
_LIBRARY.impl("cpu_lora_delta", lora_delta, "CompositeExplicitAutograd")


@torch.library.register_fake("astrai::cpu_lora_delta", lib=_LIBRARY)
def _(x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, slot_ids: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], b.shape[0], dtype=torch.float32)

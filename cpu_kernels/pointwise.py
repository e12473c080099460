"""The pointwise work of eager CPU prefill in one pass each (`pointwise.c`): RMSNorm, SiLU(gate) * up, and rotary with
the KV store of a paged layer.

Why: the engine runs CPU prefill eagerly, where torch runs each of these as a chain of single ops over [tokens, width]
with fp32 copies in between (for a 2048-token bf16 prefill of SmolLM2-135M on the 2-core Xeon: ~460 ms of a 995 ms
step). Each function computes what the torch code it stands in for computes, rounding where that code rounds; see
`pointwise.c` for where they may still differ (summation order, exp within ~1 ulp).

`supports(dtype)` says whether the kernels run `dtype` (fp32 with AVX-512, bf16 with AVX512-BF16) here. The functions
raise ValueError on tensors they do not take; `astrai.ops.pointwise` and `astrai.ops.rotary` check first and run the
torch code otherwise (inside `torch.compile`, where inductor fuses that code itself, they always do). No autograd:
callers use them only when no gradient is needed.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from . import library

__all__ = ["rms_norm", "rotary_kv_store_", "silu_mul", "supports"]

_L, _P, _F, _I = ctypes.c_long, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rms_norm": ((_P, _L, _L, _L, _P, _F, _P, _I), None),  # x, rows, E, row stride, gain, eps, out, threads
    "silu_mul": ((_P, _L, _P, _L, _L, _L, _P, _I), None),  # gate, its row stride, up, its row stride, rows, I, out
    # q, its token and head strides, k (and strides), v (and strides), T, H, Kh, D, cos, sin, their row stride, q_out,
    # k pool, v pool, pool strides (rows, heads), pool rows, slots, threads
    "rotary_kv_store": (
        (_P, _L, _L, _P, _L, _L, _P, _L, _L, _L, _L, _L, _L, _P, _P, _L, _P, _P, _P, _L, _L, _L, _P, _I),
        _I,
    ),  # fmt: skip
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_KERNELS: dict[str, dict[torch.dtype, Any]] = {}


def _kernel(name: str, dtype: torch.dtype) -> Any:
    if name not in _KERNELS:
        argtypes, restype = _SIGNATURES[name]
        _KERNELS[name] = library.bind({d: f"astrai_{name}_{s}" for d, s in _SUFFIX.items()}, argtypes, restype)
    kernel = _KERNELS[name].get(dtype)  # KeyError-free: None where this CPU lacks the instructions
    if kernel is None:
        raise ValueError(f"the CPU {name} kernel cannot run {dtype} here")
    return kernel


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels run tensors of `dtype` on this CPU (builds the library on the first call)."""
    try:
        _kernel("rms_norm", dtype)
    except (KeyError, ValueError):
        return False
    return True


def _check(name: str, *tensors: Tensor) -> None:
    dtype = tensors[0].dtype
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype or t.stride(-1) != 1:
            raise ValueError(f"{name} takes CPU tensors of one dtype with a contiguous last dim, got {t.dtype} "
                             f"on {t.device}, strides {t.stride()}")  # fmt: skip


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)`: x [..., E] (rows may be strided),
    weight [E] in x's dtype -> a new contiguous tensor like x."""
    _check("rms_norm", x, weight)
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"rms_norm gain {tuple(weight.shape)} does not fit x {tuple(x.shape)}")
    rows = x.reshape(-1, width) if x.dim() != 2 else x  # a view where the leading dims allow it
    out = torch.empty(x.shape, dtype=x.dtype)
    if out.numel():
        _kernel("rms_norm", x.dtype)(rows.data_ptr(), rows.shape[0], width, rows.stride(0), weight.data_ptr(), eps,
                                     out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`F.silu(gate) * up` for gate, up [rows, I] of one dtype (rows may be strided: views of one fused projection)
    -> a new [rows, I]."""
    _check("silu_mul", gate, up)
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"silu_mul takes gate and up [rows, I] of one shape, got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")  # fmt: skip
    out = torch.empty(gate.shape, dtype=gate.dtype)
    if out.numel():
        _kernel("silu_mul", gate.dtype)(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), gate.shape[0],
                                        gate.shape[1], out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


def rotary_kv_store_(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> Tensor:
    """`rotary_ref` (halves form) of q [T, H, D] and k [T, Kh, D] with cos, sin [T, D/2] fp32, then the rotated k and
    v [T, Kh, D] stored into the pools [S, Kh, D] at slot_mapping [T] int64 (a negative slot writes nothing); returns
    the rotated q, a new [T, H, D]. D must be a multiple of 32; tokens and heads may be strided."""
    _check("rotary_kv_store_", q, k, v, k_cache, v_cache)
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != (tokens, kv_heads, dim) or v.shape != k.shape or k_cache.shape[1:] != (kv_heads, dim):
        raise ValueError(f"rotary_kv_store_ shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"pool {tuple(k_cache.shape)}")  # fmt: skip
    if dim % 32 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"rotary_kv_store_ takes a head dim that is a multiple of 32 (got {dim}) and two pools of one "
                         "layout")  # fmt: skip
    if cos.dtype != torch.float32 or cos.shape != (tokens, dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"rotary_kv_store_ tables must be fp32 [T, D/2], got {cos.dtype} {tuple(cos.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    if tokens == 0:
        return out
    status = _kernel("rotary_kv_store", q.dtype)(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
        v.stride(1), tokens, heads, kv_heads, dim, cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.shape[0],
        slots.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise IndexError(f"a KV slot lies past the pool's {k_cache.shape[0]} rows")
    return out

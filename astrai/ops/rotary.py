"""Rotary embedding on q and k (`rotary`), and with the KV store of a paged layer fused in (`rotary_kv_store_`):
Triton kernels on CUDA, plain torch on CPU, except that an eager CPU `rotary_kv_store_` that needs no gradient runs
one hand-written pass (`astrai.cpu_kernels.pointwise`; the halves form, head dims that are multiples of 32).

`ASTRAI_FUSED_ROTARY_KV_STORE=0` (or false / no / off; read at import) makes `rotary_kv_store_` run its two steps
on CUDA too (the Triton rotary kernel, then the Triton KV store); `FUSED_KV_STORE` is that switch, which the
engine's start check (`astrai.inference.fast_paths`) turns off when the one-launch kernel fails it.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from astrai.cpu_kernels import pointwise as cpu_pointwise
from astrai.ops.backend import attn_backend
from astrai.ops.kv_store import kv_store_
from astrai.ops.pointwise import cpu_kernel_applies

FUSED_KV_STORE_ENV = "ASTRAI_FUSED_ROTARY_KV_STORE"
FUSED_KV_STORE = os.environ.get(FUSED_KV_STORE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Rotate q and k by per-token angles.

    Args:
        q: [N, H, D] queries; k: [N, K, D] keys.
        cos, sin: [N, D/2] float32 per-token tables (see `astrai.nn.rope.rope_cos_sin`).
        interleaved: rotate adjacent pairs instead of halves.

    Returns:
        (q, k) rotated, new tensors in the input dtype.
    """
    backend = attn_backend(q)
    if backend == "triton":
        from astrai.triton_kernels.rotary import rotary as rotary_kernel

        return rotary_kernel(q, k, cos, sin, interleaved=interleaved)
    if backend == "cuda_ref":
        import astrai.cuda_ref as cuda_ref

        return cuda_ref.rotary(q, k, cos, sin, interleaved=interleaved)
    # the reference is vectorised fp32 torch, so it is also the CPU path
    from astrai.triton_kernels.rotary import rotary_ref

    return rotary_ref(q, k, cos, sin, interleaved=interleaved)


def fused_kv_store(q: Tensor) -> bool:
    """Whether `rotary_kv_store_` runs as one launch for `q`: the Triton backend, with `FUSED_KV_STORE` on."""
    return FUSED_KV_STORE and attn_backend(q) == "triton"


def _fused_launch(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor], slot_mapping: Tensor,
    interleaved: bool, q_norm: Tensor | None, k_norm: Tensor | None, eps: float,
) -> Tensor:  # fmt: skip
    """The one-launch Triton kernel (`triton_kernels/rotary_kv_store.py`)."""
    from astrai.triton_kernels.rotary_kv_store import rotary_kv_store_ as fused_kernel_

    return fused_kernel_(q, k, v, cos, sin, kv[0], kv[1], slot_mapping, interleaved, q_norm, k_norm, eps)


def rotary_kv_store_(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor], slot_mapping: Tensor,
    *, interleaved: bool = False, q_norm: Tensor | None = None, k_norm: Tensor | None = None, eps: float = 0.0,
) -> Tensor:  # fmt: skip
    """Rotate q and k, write the rotated k and v into the pools `kv` at `slot_mapping` (in place; a negative slot
    writes nothing), and return the rotated q: `rotary` then `kv_store_`, in one Triton launch on CUDA
    (`triton_kernels/rotary_kv_store.py`; unless `FUSED_KV_STORE` is off), the two steps elsewhere. With `q_norm`
    and `k_norm` (qwen3's per-head RMSNorm gains [D], epsilon `eps`) q and k are normalised first, in the same
    launch on CUDA.

    Args:
        q: [T, H, D]; k, v: [T, K, D] (any token/head strides, e.g. views of a fused qkv projection).
        cos, sin: [T, D/2] float32 per-token tables.
        kv: (k_cache, v_cache) pools [S, K, D] of this layer.
        slot_mapping: [T] int64 pool slot per token.
        q_norm, k_norm: RMSNorm gains [D] of q and k (both or neither), in q's dtype or float32.
    """
    if fused_kv_store(q):
        return _fused_launch(q, k, v, cos, sin, kv, slot_mapping, interleaved, q_norm, k_norm, eps)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together: pass both gains or neither")
    if q_norm is not None:
        from astrai.triton_kernels.rotary_kv_store import rms_norm_ref

        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    if _cpu_kernel(q, k, v, cos, kv, interleaved):  # eager CPU: one pass (`cpu_kernels/pointwise.c`)
        return cpu_pointwise.rotary_kv_store_(q, k, v, cos, sin, kv[0], kv[1], slot_mapping)
    q, k = rotary(q, k, cos, sin, interleaved=interleaved)
    kv_store_(kv[0], kv[1], k, v, slot_mapping)
    return q


def _cpu_kernel(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, kv: tuple[Tensor, Tensor], interleaved: bool) -> bool:
    """Whether `rotary_kv_store_` may run the CPU kernel: `ops.pointwise.cpu_kernel_applies`, the halves form, a head
    dim that is a multiple of 32, fp32 tables of one row per token, and pools of q's dtype and one layout."""
    if interleaved or q.dim() != 3 or q.shape[-1] % 32 or cos.dtype != torch.float32 or cos.dim() != 2:
        return False
    if cos.shape[0] != q.shape[0] or kv[0].stride() != kv[1].stride() or kv[0].shape != kv[1].shape:
        return False
    tensors = (q, k, v, *kv)
    return all(t.stride(-1) == 1 for t in tensors) and cpu_kernel_applies(*tensors)

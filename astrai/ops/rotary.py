"""Rotary embedding on q and k (`rotary`), and with the KV store of a paged layer fused in (`rotary_kv_store_`):
Triton kernels on CUDA, plain torch on CPU."""

from __future__ import annotations

from torch import Tensor

from astrai.ops.backend import attn_backend
from astrai.ops.kv_store import kv_store_


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


def rotary_kv_store_(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor], slot_mapping: Tensor,
    *, interleaved: bool = False, q_norm: Tensor | None = None, k_norm: Tensor | None = None, eps: float = 0.0,
) -> Tensor:  # fmt: skip
    """Rotate q and k, write the rotated k and v into the pools `kv` at `slot_mapping` (in place; a negative slot
    writes nothing), and return the rotated q: `rotary` then `kv_store_`, in one Triton launch on CUDA
    (`triton_kernels/rotary_kv_store.py`), the two steps elsewhere. With `q_norm` and `k_norm` (qwen3's per-head
    RMSNorm gains [D], epsilon `eps`) q and k are normalised first, in the same launch on CUDA.

    Args:
        q: [T, H, D]; k, v: [T, K, D] (any token/head strides, e.g. views of a fused qkv projection).
        cos, sin: [T, D/2] float32 per-token tables.
        kv: (k_cache, v_cache) pools [S, K, D] of this layer.
        slot_mapping: [T] int64 pool slot per token.
        q_norm, k_norm: RMSNorm gains [D] of q and k (both or neither), in q's dtype or float32.
    """
    if attn_backend(q) == "triton":
        from astrai.triton_kernels.rotary_kv_store import rotary_kv_store_ as fused_kernel_

        return fused_kernel_(q, k, v, cos, sin, kv[0], kv[1], slot_mapping, interleaved, q_norm, k_norm, eps)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together: pass both gains or neither")
    if q_norm is not None:
        from astrai.triton_kernels.rotary_kv_store import rms_norm_ref

        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    q, k = rotary(q, k, cos, sin, interleaved=interleaved)
    kv_store_(kv[0], kv[1], k, v, slot_mapping)
    return q

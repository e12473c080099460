"""Rotary embedding of the new tokens' q and k, and the store of k and v into the paged KV pool, in one launch.

A paged attention layer (decode, prefill, mixed steps) rotates q and k, then writes k and v into the pool: two
launches per layer, and the rotated k goes through global memory once more between them. This kernel does both:
it rotates q into a new tensor, rotates k straight into its pool slots and copies v into its slots. The rotated
k never exists outside the pool. One kernel per layer and step instead of two (issue 16 item 1: a batch-1
decode step is a chain of tiny launches).

Math and layouts are those of `rotary` (half-rotation or interleaved, per-token cos/sin tables [T, D/2], q/k/v
with a contiguous last dim and any token/head strides, e.g. views of a fused qkv projection) and `kv_store_`
(pools [S, K, D] with a contiguous last dim, `slot_mapping` [T] int64, a negative slot marks a padding row and
writes nothing). k is rounded once, to the pool's dtype; with the pool in k's dtype (as the engine keeps it) the
pool holds exactly what `rotary` then `kv_store_` would write.

With `q_norm`/`k_norm` gains [D] (qwen3's per-head RMSNorm of q and k, `eps` its epsilon) each q and k row is
normalised before it is rotated, with `nn.norm.rms_norm`'s math and roundings: one launch for what is otherwise
a norm kernel, then this one.

Grid `(cdiv(T, BLOCK_T), 2 * cdiv(K, BLOCK_H) + cdiv(H, BLOCK_H))`: the first head blocks rotate q, then k
(into the pool), then the v copy. Inference only: no autograd (the dense training path never stores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import cdiv, check_last_dim_contiguous, next_power_of_2
from .kv_store import kv_store_ref_
from .rotary import block_sizes, rotary_ref, rotate_block

__all__ = ["rms_norm_ref", "rotary_kv_store_", "rotary_kv_store_ref_"]


@triton.jit
def _copy_to_slots(
    x_ptr, o_ptr, slot_ptr, t0, h0, num_tokens, num_heads, stride_x_t, stride_x_h, stride_o_s, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # o[slot[t], h] = x[t, h] for rows (t0 + r // BLOCK_H, h0 + r % BLOCK_H); a negative slot writes nothing.
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = t0 + rows // BLOCK_H
    head = h0 + rows % BLOCK_H
    tok_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (tok_ok & (head < num_heads) & (slot >= 0))[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(x_ptr + (tok * stride_x_t + head * stride_x_h)[:, None] + d[None, :], mask=mask)
    tl.store(o_ptr + (slot * stride_o_s + head * stride_o_h)[:, None] + d[None, :], x.to(o_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


@triton.jit
def _rotary_kv_store_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, slot_ptr,
    num_tokens, num_q_heads, num_k_heads,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_qo_t, stride_qo_h, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
    stride_cos_r, stride_sin_r, qn_ptr, kn_ptr, eps,
    INTERLEAVED: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr, ROUND_NORM: tl.constexpr,
):  # fmt: skip
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    pid_h = tl.program_id(1)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    num_k_blocks = tl.cdiv(num_k_heads, BLOCK_H)
    if pid_h < num_q_blocks:
        rotate_block(
            q_ptr, qo_ptr, cos_ptr, sin_ptr, slot_ptr, slot_ptr, t0, pid_h * BLOCK_H, num_tokens, num_q_heads,
            num_tokens, stride_q_t, stride_q_h, stride_qo_t, stride_qo_h, stride_cos_r, stride_sin_r, 0,
            False, False, INTERLEAVED, False, HALF, HALF_PAD, BLOCK_T, BLOCK_H, qn_ptr, eps, HAS_NORM, ROUND_NORM,
        )  # fmt: skip
    elif pid_h < num_q_blocks + num_k_blocks:
        rotate_block(
            k_ptr, kc_ptr, cos_ptr, sin_ptr, slot_ptr, slot_ptr, t0, (pid_h - num_q_blocks) * BLOCK_H, num_tokens,
            num_k_heads, num_tokens, stride_k_t, stride_k_h, stride_kc_s, stride_kc_h, stride_cos_r, stride_sin_r,
            0, False, True, INTERLEAVED, False, HALF, HALF_PAD, BLOCK_T, BLOCK_H, kn_ptr, eps, HAS_NORM, ROUND_NORM,
        )  # fmt: skip
    else:
        _copy_to_slots(
            v_ptr, vc_ptr, slot_ptr, t0, (pid_h - num_q_blocks - num_k_blocks) * BLOCK_H, num_tokens, num_k_heads,
            stride_v_t, stride_v_h, stride_vc_s, stride_vc_h, 2 * HALF, 2 * HALF_PAD, BLOCK_T, BLOCK_H,
        )  # fmt: skip


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, with `nn.norm.rms_norm`'s math and roundings (fp32, the normalised values cast
    back to x's dtype, then the gain): `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary_kv_store_ref_(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    slot_mapping: Tensor, interleaved: bool = False, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
    eps: float = 0.0,
) -> Tensor:  # fmt: skip
    """The specification: `rms_norm_ref` of q and k with their gains (when given), `rotary_ref` on them, then
    `kv_store_ref_` of the rotated k and v (cast to the pool's dtype); returns the rotated q. Same arguments as
    `rotary_kv_store_`."""
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    q_out, k_out = rotary_ref(q, k, cos, sin, interleaved=interleaved)
    kv_store_ref_(k_cache, v_cache, k_out.to(k_cache.dtype), v.to(v_cache.dtype), slot_mapping)
    return q_out


def _check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm=None, k_norm=None) -> None:
    if not (q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape and q.shape[0] == k.shape[0]):
        raise ValueError(f"q [T, H, D], k and v [T, K, D] expected, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")  # fmt: skip
    if q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"q and k need one even head dim, got {q.shape[2]} and {k.shape[2]}")
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.shape[1:] != k.shape[1:]:
        raise ValueError(f"pools [S, {k.shape[1]}, {k.shape[2]}] expected, got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")  # fmt: skip
    half = q.shape[2] // 2
    if cos.shape != (q.shape[0], half) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin [{q.shape[0]}, {half}] expected, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (q.shape[0],):
        raise ValueError(f"slot_mapping [{q.shape[0]}] int64 expected, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")  # fmt: skip
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together: pass both gains or neither")
    if q_norm is not None:
        dim = q.shape[2]
        if q_norm.shape != (dim,) or k_norm.shape != (dim,) or q_norm.dtype != k_norm.dtype:
            raise ValueError(f"q_norm and k_norm [{dim}] of one dtype expected, got {tuple(q_norm.shape)} "
                             f"{q_norm.dtype} and {tuple(k_norm.shape)} {k_norm.dtype}")  # fmt: skip
        if q_norm.dtype != q.dtype and q_norm.dtype != torch.float32:
            raise ValueError(f"norm gains in q's dtype ({q.dtype}) or float32 expected, got {q_norm.dtype}")
        if q_norm.stride(0) != 1 or k_norm.stride(0) != 1:
            raise ValueError("q_norm and k_norm must be contiguous")
    others = dict(k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    others.update({name: t for name, t in (("q_norm", q_norm), ("k_norm", k_norm)) if t is not None})
    if wrong := [name for name, t in others.items() if t.device != q.device]:
        raise ValueError(f"{', '.join(wrong)} not on q's device {q.device}")
    check_last_dim_contiguous(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)


@torch.library.custom_op("astrai::rotary_kv_store_", mutates_args=("k_cache", "v_cache"))
def rotary_kv_store_(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    slot_mapping: Tensor, interleaved: bool = False, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
    eps: float = 0.0,
) -> Tensor:  # fmt: skip
    """Rotate q (returned, a new [T, H, D] tensor in q's dtype) and k, and store the rotated k and v into the
    pools at `slot_mapping` in place (Triton; CUDA, or CPU under the interpreter). With `q_norm` and `k_norm`
    (gains [D], in q's dtype or float32) q and k are RMS-normalised first (`eps`). See the module docstring."""
    _check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    block_t, block_h = block_sizes(num_tokens, num_q_heads, num_k_heads, head_dim)
    has_norm = q_norm is not None  # the gains are never read without HAS_NORM
    heads = cdiv(num_q_heads, block_h) + 2 * cdiv(num_k_heads, block_h)
    _rotary_kv_store_kernel[(cdiv(num_tokens, block_t), heads)](
        q, k, v, q_out, k_cache, v_cache, cos, sin, slot_mapping, num_tokens, num_q_heads, num_k_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos.stride(0), sin.stride(0), q_norm if has_norm else cos, k_norm if has_norm else cos, float(eps),
        INTERLEAVED=interleaved, HALF=head_dim // 2, HALF_PAD=next_power_of_2(head_dim // 2),
        BLOCK_T=block_t, BLOCK_H=block_h, HAS_NORM=has_norm, ROUND_NORM=has_norm and q_norm.dtype == q.dtype,
        num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip
    return q_out


@rotary_kv_store_.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, interleaved=False, q_norm=None, k_norm=None, eps=0.0):
    return q.new_empty(q.shape)

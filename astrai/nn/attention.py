"""Grouped-query self-attention layer: projections, optional qk-norm, RoPE, then dense or paged attention.

Order of operations follows transformers (llama, mistral, qwen2, qwen3): project, split heads, per-head
RMSNorm on q and k (qwen3), rotate, attend, merge heads, output projection. With a KV cache the new K/V are
written into the pool first (qk-norm, rotation and store are one kernel on CUDA, `ops.rotary.rotary_kv_store_`)
and attention reads everything (prefix and new tokens) from the pool.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch
from torch import Tensor

from astrai.nn.linear import LinearParams, init_linear, linear, linear_group
from astrai.nn.norm import RMSNormParams, init_rms_norm, rms_norm
from astrai.ops.attention import AttnMeta, dense_attention, paged_attention
from astrai.ops.rotary import rotary, rotary_kv_store_
from astrai.tree import pytree


@pytree
@attrs.frozen(eq=False)
class AttentionParams:
    """Projections of one attention layer (HF names, so checkpoints map 1:1)."""

    q_proj: LinearParams  # [H*D, E]
    k_proj: LinearParams  # [K*D, E]
    v_proj: LinearParams  # [K*D, E]
    o_proj: LinearParams  # [E, H*D]
    q_norm: RMSNormParams | None = None  # [D]
    k_norm: RMSNormParams | None = None  # [D]


@pytree
@attrs.frozen(eq=False)
class FusedAttentionParams:
    """An attention layer for serving, with q/k/v as one projection (`astrai.models.fuse`): one GEMM per step
    instead of three, as vLLM's QKVParallelLinear. `qkv_proj` holds the q, k and v rows in that order."""

    qkv_proj: LinearParams  # [(H + 2K) * D, E]
    o_proj: LinearParams  # [E, H*D]
    q_norm: RMSNormParams | None = None  # [D]
    k_norm: RMSNormParams | None = None  # [D]


class AttentionShape(NamedTuple):
    """Static per-layer attention settings (a NamedTuple so compiled code can build and read it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float = 1e-6
    window: int = 0
    interleaved_rope: bool = False

    @property
    def scale(self) -> float:
        """Softmax scale D^-1/2."""
        return self.head_dim**-0.5


def init_attention(
    dim: int,
    shape: AttentionShape,
    *,
    qkv_bias: bool = False,
    out_bias: bool = False,
    qk_norm: bool = False,
    std: float = 0.02,
    out_std: float | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> AttentionParams:
    """Normal-initialised projections; `out_std` (default `std`) for the residual-output projection."""
    q_dim, kv_dim = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    kw = dict(std=std, generator=generator, dtype=dtype)
    return AttentionParams(
        q_proj=init_linear(dim, q_dim, bias=qkv_bias, **kw),
        k_proj=init_linear(dim, kv_dim, bias=qkv_bias, **kw),
        v_proj=init_linear(dim, kv_dim, bias=qkv_bias, **kw),
        o_proj=init_linear(
            q_dim, dim, bias=out_bias, std=out_std if out_std is not None else std, generator=generator, dtype=dtype
        ),
        q_norm=init_rms_norm(shape.head_dim, dtype=dtype) if qk_norm else None,
        k_norm=init_rms_norm(shape.head_dim, dtype=dtype) if qk_norm else None,
    )


def attention(
    p: AttentionParams | FusedAttentionParams,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    shape: AttentionShape,
    meta: AttnMeta | None = None,
    kv: tuple[Tensor, Tensor] | None = None,
    doc_ids: Tensor | None = None,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Self-attention.

    Args:
        p: layer parameters (q/k/v apart, or fused into one projection for serving).
        x: [B, T, E] (dense, causal over each row) or [T, E] (paged: flattened new tokens of a batch).
        cos, sin: [B*T or T, D/2] float32 rotation tables for the tokens of `x` in row-major order.
        shape: static head layout, window and rope layout.
        meta: paged-step metadata; required with `kv`.
        kv: (k_cache, v_cache) pool tensors [S, K, D] of this layer, written in place.
        doc_ids: dense mode only, [B, T] document index per token (packed rows: no attention across documents).
        causal: dense mode only; False attends to every (unpadded) key, as embedding encoders do.
        key_padding_mask: dense mode only, [B, T] bool, True for real tokens; padded keys are never attended.

    Returns:
        Same leading shape as `x`, last dim E.
    """
    lead = x.shape[:-1]
    heads, kv_heads, dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    if isinstance(p, FusedAttentionParams):
        q, k, v = linear(p.qkv_proj, x).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    else:
        q, k, v = linear_group((p.q_proj, p.k_proj, p.v_proj), x)
    q, k, v = q.view(*lead, heads, dim), k.view(*lead, kv_heads, dim), v.view(*lead, kv_heads, dim)
    qk_norm = p.q_norm is not None and p.k_norm is not None
    if qk_norm and kv is None:  # paged layers normalise inside rotary_kv_store_ (one launch on CUDA)
        q, k = rms_norm(p.q_norm, q, eps=shape.norm_eps), rms_norm(p.k_norm, k, eps=shape.norm_eps)
    # rotary works on flat tokens: [B*T, heads, D]
    q, k, v = q.reshape(-1, heads, dim), k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim)
    if kv is None:
        q, k = rotary(q, k, cos, sin, interleaved=shape.interleaved_rope)
        out = dense_attention(
            q.view(*lead, heads, dim),
            k.view(*lead, kv_heads, dim),
            v.view(*lead, kv_heads, dim),
            scale=shape.scale,
            window=shape.window,
            doc_ids=doc_ids,
            causal=causal,
            key_padding_mask=key_padding_mask,
        )
    else:
        if meta is None:
            raise ValueError("paged attention needs AttnMeta together with the KV cache")
        # normalise q and k (qwen3), rotate, and store the new K/V into the pool: one kernel on CUDA
        norms = {"q_norm": p.q_norm.weight, "k_norm": p.k_norm.weight, "eps": shape.norm_eps} if qk_norm else {}
        q = rotary_kv_store_(q, k, v, cos, sin, kv, meta.slot_mapping, interleaved=shape.interleaved_rope, **norms)
        out = paged_attention(q, kv[0], kv[1], meta, scale=shape.scale, window=shape.window)
    return linear(p.o_proj, out.reshape(*lead, heads * dim))

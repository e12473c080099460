"""MLA's paged ops over the latent pool: store new latent rows, and attention in latent space.

The pool holds one [c_kv ; k_pe] row of R + Dr elements per token and layer (`astrai.nn.mla` explains the
absorbed form): MQA with one shared head whose key is the whole row and whose value is its first R dims.
Decode dispatches per `astrai.ops.backend` like the GQA ops: the Triton kernel (`triton_kernels.mla_decode`) on
CUDA, otherwise its torch reference `mla_decode_ref`. Extend always runs `mla_extend_ref` (there is no Triton
extend kernel for the latent pool yet): `extend_attention_ref` over the same MQA view, so every paged latent op
has exactly one torch implementation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astrai.ops.attention import AttnMeta
from astrai.ops.backend import attn_backend


def mla_store_latent_(cache: Tensor, c_kv: Tensor, k_pe: Tensor, slot_mapping: Tensor) -> None:
    """cache[slot_mapping[t]] = [c_kv[t] ; k_pe[t]] in place; rows with a negative slot are skipped.

    Args:
        cache: [S, R + Dr] latent pool of one layer (mutated).
        c_kv: [T, R] normalised latents; k_pe: [T, Dr] rotated rope keys.
        slot_mapping: [T] int64 destination slots.
    """
    from astrai.triton_kernels.kv_store import store_rows_ref_

    store_rows_ref_(cache, torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype), slot_mapping)  # rows [T, R + Dr]


def mla_extend_ref(
    q: Tensor,
    cache: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    *,
    kv_lora_rank: int,
    page_size: int,
    scale: float,
) -> Tensor:
    """Latent attention of ragged new tokens: plain torch in fp32 (the specification and the path on every device).

    Args:
        q: [T, H, R + Dr] absorbed queries; request b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1], the last
            new tokens of its seq_lens[b] cached ones.
        cache: [S, R + Dr] latent pool; position j of request b sits in slot
            block_table[b, j // page_size] * page_size + j % page_size.
        cu_seqlens_q: [B+1] int32; seq_lens: [B] int32; block_table: [B, P] int32.
        kv_lora_rank: R; page_size: N; scale: softmax scale.

    Returns:
        [T, H, R] in q's dtype; rows owned by no request are zero.
    """
    from astrai.triton_kernels.extend_attention import extend_attention_ref

    kv = cache[:, None, :]  # [S, 1, R + Dr]: one shared head, value = key row (the Dr extra dims are dropped)
    out = extend_attention_ref(q, kv, kv, cu_seqlens_q, seq_lens, block_table, page_size=page_size, scale=scale)
    return out[..., :kv_lora_rank]


def mla_paged_attention(q: Tensor, cache: Tensor, meta: AttnMeta, *, kv_lora_rank: int, scale: float) -> Tensor:
    """Latent-space attention of new tokens over the pool (their entries must already be stored).

    Args:
        q: [T, H, R + Dr] absorbed queries [q_lat ; q_pe].
        cache: [S, R + Dr] latent pool of this layer.
        meta: batch metadata (decode when every request has one new token).
        kv_lora_rank: R.
        scale: softmax scale.

    Returns:
        [T, H, R] attention-weighted latents (W_UV not yet applied).
    """
    kw = dict(kv_lora_rank=kv_lora_rank, page_size=meta.page_size, scale=scale)
    if not meta.decode:
        return mla_extend_ref(q, cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_table, **kw)
    from astrai.triton_kernels import mla_decode as kernel

    decode = kernel.mla_decode if attn_backend(q) == "triton" else kernel.mla_decode_ref
    return decode(q, cache, meta.block_table, meta.seq_lens, **kw)

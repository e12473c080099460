"""MLA's paged ops over the latent pool: store new latent rows, and attention in latent space.

The pool holds one [c_kv ; k_pe] row of R + Dr elements per token and layer (`astrai.nn.mla` explains the
absorbed form). Decode dispatches per `astrai.ops.backend` like the GQA ops: the Triton kernel
(`triton_kernels.mla_decode`) on CUDA, otherwise the shared torch paths over an MQA view of the pool; extend
always runs the torch path (there is no Triton extend kernel for the latent pool yet).
"""

from __future__ import annotations

import torch
from torch import Tensor

from astrai.ops.attention import AttnMeta
from astrai.ops.backend import attn_backend
from astrai.ops.paged_torch import decode_attention_torch, extend_attention_torch


def mla_store_latent_(cache: Tensor, c_kv: Tensor, k_pe: Tensor, slot_mapping: Tensor) -> None:
    """cache[slot_mapping[t]] = [c_kv[t] ; k_pe[t]] in place; rows with a negative slot are skipped.

    Args:
        cache: [S, R + Dr] latent pool of one layer (mutated).
        c_kv: [T, R] normalised latents; k_pe: [T, Dr] rotated rope keys.
        slot_mapping: [T] int64 destination slots.
    """
    entry = torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype)  # [T, R + Dr]
    # Sync-free skip of padding rows, as kv_store_ref_: padding rows rewrite what the first valid row writes.
    valid = slot_mapping >= 0
    rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    src = torch.where(valid, rows, torch.argmax(valid.to(torch.int32)))  # [T] row each row writes
    dst = slot_mapping[src]  # negative only when no row is valid
    dst_safe = dst.clamp(min=0)
    new = torch.where((dst >= 0)[:, None], entry.index_select(0, src), cache.index_select(0, dst_safe))
    cache.index_copy_(0, dst_safe, new)


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
    if meta.decode and attn_backend(q) == "triton":
        from triton_kernels.mla_decode import mla_decode

        return mla_decode(
            q, cache, meta.block_table, meta.seq_lens, kv_lora_rank=kv_lora_rank, page_size=meta.page_size, scale=scale
        )
    # MQA view of the pool, one shared head [S, 1, R + Dr]: key [c_kv ; k_pe], value the same row; the torch paths
    # assume value width == query width, so the Dr extra output dims (~11% for DeepSeek-V3) are computed and dropped.
    kv = cache[:, None, :]
    if meta.decode:
        out = decode_attention_torch(q, kv, kv, meta.block_table, meta.seq_lens, page_size=meta.page_size, scale=scale)
    else:
        out = extend_attention_torch(q, kv, kv, meta.cu_seqlens_q, meta.seq_lens, meta.block_table,
                                     page_size=meta.page_size, scale=scale)  # fmt: skip
    return out[..., :kv_lora_rank]

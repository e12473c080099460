"""KV pool allocation and paged-step metadata (host side).

`init_kv_cache` preallocates the per-layer pool tensors (K and V per layer for GQA; one [S, R + Dr] latent
tensor per layer for MLA, see `astrai.nn.mla`); `make_attn_meta` turns per-request page lists and
lengths into the `AttnMeta` tree a step consumes. Page 0 is reserved as a null page: padding rows write there
and page tables may point there, so no request's data is ever clobbered by padding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astrai.models.config import ModelConfig
from astrai.nn.mla import init_mla_cache
from astrai.ops.attention import AttnMeta, KVCache, LatentCache

NULL_PAGE = 0


def init_kv_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, *, dtype: torch.dtype, device: torch.device | str
) -> KVCache | LatentCache:
    """Zeroed pool of `num_pages` pages (page 0 is the null page) per layer.

    Returns:
        GQA: KVCache with k/v tuples of L tensors [num_pages * page_size, K, D].
        MLA: LatentCache with L tensors [num_pages * page_size, kv_lora_rank + qk_rope_head_dim].
    """
    if num_pages < 2:
        raise ValueError(f"the KV pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
    if cfg.attn_type == "mla":
        slots = num_pages * page_size
        return LatentCache(latent=init_mla_cache(cfg.mla, cfg.num_hidden_layers, slots, dtype=dtype, device=device))
    shape = (num_pages * page_size, cfg.num_key_value_heads, cfg.head_dim)
    layers = range(cfg.num_hidden_layers)
    return KVCache(
        k=tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in layers),
        v=tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in layers),
    )


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V (MLA: of the latent row) per token over all layers."""
    item = torch.empty((), dtype=dtype).element_size()
    if cfg.attn_type == "mla":
        return cfg.num_hidden_layers * cfg.mla.latent_dim * item
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * item


def make_attn_meta(
    pages: list[list[int]],
    cached: list[int],
    new: list[int],
    *,
    page_size: int,
    device: torch.device | str,
    decode: bool = False,
) -> AttnMeta:
    """Metadata of one step.

    Args:
        pages: per request, its page ids in order (enough pages for cached + new tokens).
        cached: per request, tokens already in the cache (the new tokens start at this position).
        new: per request, number of new tokens in this step.
        page_size: tokens per page.
        device: where the metadata tensors go.
        decode: every request has exactly one new token (selects the decode kernel).
    """
    if decode and any(n != 1 for n in new):
        raise ValueError("decode metadata needs exactly one new token per request")
    width = max(len(p) for p in pages)
    table = torch.full((len(pages), width), NULL_PAGE, dtype=torch.int32)
    for row, plist in enumerate(pages):
        table[row, : len(plist)] = torch.tensor(plist, dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new, strict=True)])
    req = torch.repeat_interleave(torch.arange(len(pages)), torch.tensor(new))
    slots = table[req, positions // page_size].long() * page_size + positions % page_size
    cu = torch.zeros(len(pages) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new), 0)
    seq_lens = torch.tensor([c + n for c, n in zip(cached, new, strict=True)], dtype=torch.int32)
    return AttnMeta(
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=seq_lens.to(device),
        block_table=table.to(device),
        page_size=page_size,
        decode=decode,
    )


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def logits_rows(meta: AttnMeta) -> Tensor:
    """[B] row index of each request's last new token (the row to sample from)."""
    return meta.cu_seqlens_q[1:].long() - 1

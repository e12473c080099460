"""KV pool allocation and paged-step metadata (host side).

`init_kv_cache` preallocates the per-layer pool tensors (K and V per layer for GQA; one [S, R + Dr] latent
tensor per layer for MLA, see `astrai.nn.mla`); `make_attn_meta` turns per-request page lists and
lengths into the `AttnMeta` tree a step consumes. Page 0 is reserved as a null page: padding rows write there
and page tables may point there, so no request's data is ever clobbered by padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
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
    pages: Sequence[Sequence[int]],
    cached: Sequence[int],
    new: Sequence[int],
    *,
    page_size: int,
    device: torch.device | str,
    decode: bool = False,
    rows: int | None = None,
    width: int | None = None,
) -> AttnMeta:
    """Metadata of one step: the one place an `AttnMeta` is built from per-request pages and lengths.

    Args:
        pages: per request, its page ids in order (enough pages for cached + new tokens).
        cached: per request, tokens already in the cache (the new tokens start at this position).
        new: per request, number of new tokens in this step.
        page_size: tokens per page.
        device: where the metadata tensors go.
        decode: every request has exactly one new token (selects the decode kernel).
        rows: pad to this many requests (default: no padding); a padding row has one token at position 0 that
            writes to slot -1 (skipped) and attends to nothing (length 0).
        width: block-table width in pages (default: the longest page list).
    """
    if decode and any(n != 1 for n in new):
        raise ValueError("decode metadata needs exactly one new token per request")
    count = len(pages)
    rows = count if rows is None else rows
    width = max(len(p) for p in pages) if width is None else width
    table = np.full((rows, width), NULL_PAGE, dtype=np.int32)  # numpy fills rows from lists ~3x faster than torch
    for row, plist in enumerate(pages):
        table[row, : len(plist)] = plist
    lengths = np.ones(rows, dtype=np.int64)  # padding rows feed one token
    lengths[:count] = new
    starts = np.zeros(rows, dtype=np.int64)
    starts[:count] = cached
    req = np.repeat(np.arange(rows), lengths)  # [T] request of each new token
    cu = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    positions = starts[req] + np.arange(int(cu[-1])) - cu[:-1][req]  # [T]
    slots = table[req, positions // page_size].astype(np.int64) * page_size + positions % page_size
    slots[int(cu[count]) :] = -1
    seq_lens = (starts + lengths).astype(np.int32)
    seq_lens[count:] = 0
    return AttnMeta(
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        cu_seqlens_q=torch.from_numpy(cu).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_table=torch.from_numpy(table).to(device),
        page_size=page_size,
        decode=decode,
    )


def logits_rows(meta: AttnMeta) -> Tensor:
    """[B] row index of each request's last new token (the row to sample from)."""
    return meta.cu_seqlens_q[1:].long() - 1

"""Vectorised plain-torch paged attention: the CPU path of `astrai.ops.attention`.

These gather each request's K/V from the pool into a padded [B, P*N] view and run SDPA with a mask. Shapes
depend only on tensor shapes (never on values), so they trace under `torch.compile` without host syncs.
Extend attention in eager mode loops over requests (the host knows their lengths: no wasted FLOPs; a fresh
prompt uses SDPA's causal fast path). Under `torch.compile` it flattens all requests' keys into one axis and
masks out other requests' keys instead: static-shaped and traceable, at B x the attention FLOPs.
The per-request loop references in `triton_kernels/*_ref` are the specification these are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _gather_pages(cache: Tensor, block_table: Tensor, seq_lens: Tensor, page_size: int) -> Tensor:
    # cache: [S, K, D], block_table: [B, P] -> [B, P*N, K, D]; rows past a request's length are zeroed, so
    # stale or non-finite values in pages it does not own can never leak through a 0-weight (0 * NaN = NaN)
    num_pages = cache.shape[0] // page_size
    pages = block_table.long().clamp(0, num_pages - 1)
    # index_select, not advanced indexing: the latter is orders of magnitude slower for this gather on CPU
    paged = cache.view(num_pages, page_size, *cache.shape[1:])  # [P_all, N, K, D]
    out = paged.index_select(0, pages.flatten()).view(*pages.shape, *paged.shape[1:]).flatten(1, 2)
    owned = torch.arange(out.shape[1], device=cache.device)[None, :] < seq_lens.long()[:, None]  # [B, P*N]
    return out.masked_fill(~owned[:, :, None, None], 0)


def _key_mask(q_pos: Tensor, k_pos: Tensor, seq_lens: Tensor, window: int) -> Tensor:
    # q_pos: [B, Tq], k_pos: [S], seq_lens: [B] -> [B, Tq, S] bool: causal, within length and window
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    if window > 0:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
    return mask


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    # q: [B, H, Tq, D], k/v: [B, K, S, D], mask: [B, 1, Tq, S]. Fully masked rows give zeros, not NaN.
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def decode_attention_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    page_size: int,
    scale: float,
    window: int = 0,
) -> Tensor:
    """q: [B, H, D] (one token per request at position seq_lens-1) -> [B, H, D]."""
    k = _gather_pages(k_cache, block_table, seq_lens, page_size)  # [B, S, K, D]
    v = _gather_pages(v_cache, block_table, seq_lens, page_size)
    k_pos = torch.arange(k.shape[1], device=q.device)
    q_pos = (seq_lens.long() - 1)[:, None]  # [B, 1]
    mask = _key_mask(q_pos, k_pos, seq_lens.long(), window)[:, None]  # [B, 1, 1, S]
    out = _sdpa(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), mask, scale)  # [B, H, 1, D]
    return out[:, :, 0, :]


def extend_attention_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    *,
    page_size: int,
    scale: float,
    window: int = 0,
) -> Tensor:
    """q: [T, H, D] ragged new tokens (request b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1]) -> [T, H, D].

    Eager calls loop over requests (the host can read the lengths; no wasted FLOPs); traced calls use the
    static-shape flattened form (see the module docstring).
    """
    if not torch.compiler.is_compiling():
        return _extend_per_request(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, page_size, scale, window)
    num_tokens, num_reqs = q.shape[0], seq_lens.shape[0]
    cu = cu_seqlens_q.long()
    rows = torch.arange(num_tokens, device=q.device)
    req = torch.searchsorted(cu[1:], rows, right=True).clamp(max=num_reqs - 1)  # [T] owning request
    q_len = cu[1:] - cu[:-1]
    q_pos = seq_lens.long()[req] - q_len[req] + (rows - cu[req])  # [T] absolute positions
    k = _gather_pages(k_cache, block_table, seq_lens, page_size)  # [B, S, K, D]
    v = _gather_pages(v_cache, block_table, seq_lens, page_size)
    span = k.shape[1]
    k_pos = torch.arange(span, device=q.device)
    # mask over the flattened [B*S] key axis: same request, causal, in length and window
    # padding rows past cu_seqlens_q[-1] own no request, so they attend to nothing and come out as zeros
    own = (req[:, None] == torch.arange(num_reqs, device=q.device)[None, :]) & (rows < cu[-1])[:, None]  # [T, B]
    per_req = _key_mask(q_pos[None, :], k_pos, seq_lens.long(), window)  # [B, T, S]
    mask = (per_req & own.T[:, :, None]).permute(1, 0, 2).reshape(1, 1, num_tokens, num_reqs * span)
    k_all = k.reshape(1, num_reqs * span, *k.shape[2:]).transpose(1, 2)  # [1, K, B*S, D]
    v_all = v.reshape(1, num_reqs * span, *v.shape[2:]).transpose(1, 2)
    out = _sdpa(q.transpose(0, 1)[None], k_all, v_all, mask, scale)  # [1, H, T, D]
    return out[0].transpose(0, 1)


def _extend_per_request(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor, block_table: Tensor,
    page_size: int, scale: float, window: int,
) -> Tensor:  # fmt: skip
    out = torch.zeros_like(q)  # rows owned by no request stay zero
    num_pages = k_cache.shape[0] // page_size
    k_paged = k_cache.view(num_pages, page_size, *k_cache.shape[1:])  # [P_all, N, K, D]
    v_paged = v_cache.view(num_pages, page_size, *v_cache.shape[1:])
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, length in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        pages = block_table[b, : -(-length // page_size)].long()
        k = k_paged.index_select(0, pages).flatten(0, 1)[:length].transpose(0, 1)  # [K, L, D]
        v = v_paged.index_select(0, pages).flatten(0, 1)[:length].transpose(0, 1)
        qb = q[start:end].transpose(0, 1)  # [H, n, D]
        gqa = qb.shape[0] != k.shape[0]
        prefix = length - (end - start)
        if prefix == 0 and window <= 0:
            o = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale,
                                               enable_gqa=gqa)  # fmt: skip
        else:
            q_pos = torch.arange(prefix, length, device=q.device)[None, :]  # [1, n]
            mask = _key_mask(q_pos, torch.arange(length, device=q.device), seq_lens[b : b + 1].long(), window)[0]
            o = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)  # fmt: skip
        out[start:end] = o.transpose(0, 1)
    return out

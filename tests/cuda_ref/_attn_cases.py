"""Input builders shared by the cuda_ref tests (GPU and CPU emulator): paged pools, decode/extend/rotary cases.

Pools are adversarial on purpose: pages are scattered, block-table padding points at a page of NaN, and every
slot no request may read (page tails past a request's length) holds NaN, so a kernel that reads one position
too many produces NaN instead of a near-miss. Query views are strided slices of a fused qkv tensor, and extend
padding rows (past cu_seqlens_q[B]) are NaN and must come out as zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PagedCase:
    """Arguments of a paged attention call (decode when cu_seqlens_q is None)."""

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_table: Tensor
    seq_lens: Tensor
    cu_seqlens_q: Tensor | None
    page_size: int
    scale: float
    window: int

    def tensors(self) -> list[Tensor]:
        ts = [self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens]
        return ts + ([self.cu_seqlens_q] if self.cu_seqlens_q is not None else [])


def make_pool(
    seq_lens: list[int], kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """(k_cache [S, K, D], v_cache [S, K, D], block_table [B, P] int32) on CPU with NaN in unreadable slots."""
    pages = [math.ceil(n / page_size) for n in seq_lens]
    max_pages = max(pages, default=0) + 1  # a spare column past every request's length
    used = sum(pages)
    nan_page = used  # the last page: block-table padding points here
    perm = torch.randperm(used, generator=gen).to(torch.int32)
    block_table = torch.full((len(seq_lens), max_pages), nan_page, dtype=torch.int32)
    slots = (used + 1) * page_size
    readable = torch.zeros(slots, dtype=torch.bool)
    start = 0
    for b, (n, p) in enumerate(zip(seq_lens, pages, strict=True)):
        block_table[b, :p] = perm[start : start + p]
        start += p
        pos = torch.arange(n)
        readable[block_table[b, pos // page_size].long() * page_size + pos % page_size] = True
    caches = []
    for _ in range(2):
        c = torch.randn(slots, kv_heads, head_dim, generator=gen)
        c[~readable] = float("nan")
        caches.append(c.to(dtype))
    return caches[0], caches[1], block_table


def _query(rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)  # [rows, H + 2K, D]
    return qkv[:, :heads]  # [rows, H, D], a strided view as from a fused projection


def decode_case(
    seq_lens: list[int],
    *,
    group: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    window: int = 0,
    seed: int = 0,
) -> PagedCase:
    """A decode batch (CPU tensors): one query per request, seq_lens[b] cached tokens including it."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_table = make_pool(seq_lens, kv_heads, head_dim, page_size, dtype, gen)
    q = _query(len(seq_lens), group * kv_heads, kv_heads, head_dim, dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return PagedCase(q, k_cache, v_cache, block_table, lens, None, page_size, head_dim**-0.5, window)


def extend_case(
    prefix_and_new: list[tuple[int, int]],
    *,
    group: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    window: int = 0,
    pad_rows: int = 2,
    seed: int = 0,
) -> PagedCase:
    """A ragged extend batch (CPU tensors): request b has prefix_and_new[b] = (cached prefix, new tokens)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in prefix_and_new]
    k_cache, v_cache, block_table = make_pool(seq_lens, kv_heads, head_dim, page_size, dtype, gen)
    new = [n for _, n in prefix_and_new]
    total = sum(new)
    q = _query(total + pad_rows, group * kv_heads, kv_heads, head_dim, dtype, gen)
    q[total:] = float("nan")  # rows owned by no request: never read, written as zeros
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return PagedCase(q, k_cache, v_cache, block_table, lens, cu, page_size, head_dim**-0.5, window)


def rotary_case(
    tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, *, table_rows: int | None, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """(q, k, cos, sin, positions) on CPU; positions is None when table_rows is None (one row per token)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)  # [T, H + 2K, D]
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]  # strided views
    rows = tokens if table_rows is None else table_rows
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [D/2]
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [R, D/2]
    positions = None if table_rows is None else torch.randint(0, rows, (tokens,), generator=gen)
    return q, k, angles.cos(), angles.sin(), positions

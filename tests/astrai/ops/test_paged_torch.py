"""The vectorised CPU attention path equals the per-request references in triton_kernels (the spec)."""

import random

import pytest
import torch

from astrai.ops.paged_torch import decode_attention_torch, extend_attention_torch
from helpers import assert_close
from triton_kernels.decode_attention import decode_attention_ref
from triton_kernels.extend_attention import extend_attention_ref


def _pool(lengths, page_size, kv_heads, dim, seed):
    """A NaN-poisoned pool where only the slots of each request's positions hold data; shuffled pages."""
    counts = [-(-n // page_size) for n in lengths]
    pages = list(range(1, sum(counts) + 2))
    random.Random(seed).shuffle(pages)
    width = max(counts) + 1
    table = torch.zeros(len(lengths), width, dtype=torch.int32)  # unused entries -> page 0 (NaN)
    k_cache = torch.full((len(pages) * page_size + page_size, kv_heads, dim), float("nan"))
    v_cache = k_cache.clone()
    i = 0
    for b, (n, c) in enumerate(zip(lengths, counts, strict=True)):
        table[b, :c] = torch.tensor(pages[i : i + c])
        i += c
        pos = torch.arange(n)
        slots = table[b, pos // page_size].long() * page_size + pos % page_size
        k_cache[slots] = torch.randn(n, kv_heads, dim)
        v_cache[slots] = torch.randn(n, kv_heads, dim)
    return k_cache, v_cache, table


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [0, 5])
def test_decode_matches_reference(page_size, heads, kv_heads, window):
    lengths = [1, 37, 16, 9]
    k_cache, v_cache, table = _pool(lengths, page_size, kv_heads, 32, seed=1)
    q = torch.randn(len(lengths), heads, 32)
    args = (q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32))
    kw = dict(page_size=page_size, scale=32**-0.5, window=window)
    assert_close(decode_attention_torch(*args, **kw), decode_attention_ref(*args, **kw), atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [0, 6])
def test_extend_matches_reference(page_size, heads, kv_heads, window):
    lengths, new = [5, 30, 12, 3], [5, 7, 1, 2]  # prefix 0, prefix > 0, a single new token
    k_cache, v_cache, table = _pool(lengths, page_size, kv_heads, 32, seed=2)
    cu = torch.zeros(len(new) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new), 0)
    q = torch.randn(int(cu[-1]) + 2, heads, 32)  # two padding rows at the end
    args = (q, k_cache, v_cache, cu, torch.tensor(lengths, dtype=torch.int32), table)
    kw = dict(page_size=page_size, scale=32**-0.5, window=window)
    out = extend_attention_torch(*args, **kw)
    assert_close(out, extend_attention_ref(*args, **kw), atol=1e-5)
    assert out[-2:].eq(0).all()

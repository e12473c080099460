"""Paged attention's CPU path (the kernels' torch references and the CPU decode kernel), eager and compiled, against a
naive dense oracle."""

import random

import pytest
import torch
import torch.nn.functional as F

from astrai.ops.attention import AttnMeta, paged_attention, pages_needed
from helpers import assert_close


def _pool(lengths, page_size, kv_heads, dim, seed):
    """A NaN-poisoned pool where only the slots of each request's positions hold data; shuffled pages."""
    counts = [pages_needed(n, page_size) for n in lengths]
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


def _meta(lengths, new, table, page_size, *, decode):
    cu = torch.zeros(len(new) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new), 0)
    unused = torch.zeros(int(cu[-1]), dtype=torch.int64)  # positions/slots: paged_attention does not read them
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    return AttnMeta(unused, unused, cu, seq_lens, table, page_size=page_size, decode=decode)


def _oracle(q, k_cache, v_cache, lengths, new, table, page_size, scale, window):
    """Independent formulation: per new token, rebuild its request's contiguous K/V slot by slot, then dense SDPA."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros_like(q)
    t = 0
    for b, (length, n) in enumerate(zip(lengths, new, strict=True)):
        slots = [int(table[b, j // page_size]) * page_size + j % page_size for j in range(length)]
        k = k_cache[slots].transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
        v = v_cache[slots].transpose(0, 1).repeat_interleave(group, 0)
        for p in range(length - n, length):
            lo = max(0, p - window + 1) if window > 0 else 0
            o = F.scaled_dot_product_attention(q[t][:, None], k[:, lo : p + 1], v[:, lo : p + 1], scale=scale)
            out[t] = o[:, 0]
            t += 1
    return out


def _compiled():
    """paged_attention traced by dynamo (the CPU path's static-shape branch), fresh per case."""
    torch._dynamo.reset()  # each case is its own graph; stay under the recompile limit
    return torch.compile(paged_attention, fullgraph=True, backend="eager")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [0, 5])
def test_decode_matches_oracle(compiled, page_size, heads, kv_heads, window):
    lengths = [1, 37, 16, 9]
    k_cache, v_cache, table = _pool(lengths, page_size, kv_heads, 32, seed=1)
    q = torch.randn(len(lengths), heads, 32)
    meta = _meta(lengths, [1] * len(lengths), table, page_size, decode=True)
    fn = _compiled() if compiled else paged_attention
    out = fn(q, k_cache, v_cache, meta, scale=32**-0.5, window=window)
    expected = _oracle(q, k_cache, v_cache, lengths, [1] * len(lengths), table, page_size, 32**-0.5, window)
    assert_close(out, expected, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [0, 6])
def test_extend_matches_oracle(compiled, page_size, heads, kv_heads, window):
    lengths, new = [5, 30, 12, 3], [5, 7, 1, 2]  # prefix 0, prefix > 0, a single new token
    k_cache, v_cache, table = _pool(lengths, page_size, kv_heads, 32, seed=2)
    q = torch.randn(sum(new) + 2, heads, 32)  # two padding rows at the end
    meta = _meta(lengths, new, table, page_size, decode=False)
    fn = _compiled() if compiled else paged_attention
    out = fn(q, k_cache, v_cache, meta, scale=32**-0.5, window=window)
    assert_close(out, _oracle(q, k_cache, v_cache, lengths, new, table, page_size, 32**-0.5, window), atol=1e-5)
    assert out[-2:].eq(0).all()


def test_pages_needed_rounds_up():
    assert [pages_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("page_size", "window"), [(16, 0), (1, 5)])
@pytest.mark.parametrize("longest", [None, 4], ids=["short", "split"])
def test_mixed_step_tokens_take_the_cpu_kernel(compiled, dtype, page_size, window, longest, monkeypatch):
    """A mixed step (prefilling requests and several one-token ones) equals the oracle, and the tokens of its requests
    of at most `PER_TOKEN_MAX_NEW` new tokens ran in one call of the CPU decode kernel, each token one query over the
    keys it may see (the padding row stays zero); fp32 sends only its decoding rows there by default. With the bound
    at 4 ("split") the 9-token prompt takes the reference's SDPA instead and the call holds the other six tokens."""
    from astrai.cpu_kernels import decode_attention as cpu_attention
    from astrai.ops import attention as ops_attention

    probe = (torch.empty(1, 8, 32, dtype=dtype), torch.empty(16, 2, 32, dtype=dtype))
    if not cpu_attention.supports(*probe):
        pytest.skip(f"no CPU decode kernel here: {cpu_attention.unavailable_reason(*probe)}")
    longest = 1 if longest is None and dtype == torch.float32 else longest  # fp32: the decoding rows only
    if longest is not None:
        monkeypatch.setitem(ops_attention.PER_TOKEN_MAX_NEW, dtype, longest)
    lengths, new = [40, 9, 17, 6, 3], [1, 9, 1, 1, 3]  # three decoding rows, a fresh prompt, a prefix hit
    k_cache, v_cache, table = _pool(lengths, page_size, 2, 32, seed=3)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(sum(new) + 1, 8, 32).to(dtype)  # one padding row
    meta = _meta(lengths, new, table, page_size, decode=False)
    kernels = cpu_attention._kernels()
    kernel, calls = kernels[dtype], []
    kernels[dtype] = lambda *args: calls.append(args[1]) or kernel(*args)  # args[1]: the batch
    try:
        fn = _compiled() if compiled else paged_attention
        out = fn(q, k_cache, v_cache, meta, scale=32**-0.5, window=window)
    finally:
        kernels[dtype] = kernel
    short = [n for n in new if longest is None or n <= longest]
    assert calls == [sum(short)]  # the short requests' tokens in one call (the padding row is not one)
    expected = _oracle(q.float(), k_cache.float(), v_cache.float(), lengths, new, table, page_size, 32**-0.5, window)
    assert_close(out.float(), expected, atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert out[-1].eq(0).all() and out.dtype == dtype


def test_cpu_extend_op_passes_opcheck():
    """The op's schema, fake (meta) implementation and dispatch agree with its real one (torch.library.opcheck).
    `ops.attention` calls the op only where the decode kernel runs (it runs the decoding rows), so neither does this."""
    from astrai.cpu_kernels import decode_attention as cpu_attention

    probe = (torch.empty(1, 8, 32), torch.empty(16, 2, 32))
    if not cpu_attention.supports(*probe):
        pytest.skip(f"no CPU decode kernel here: {cpu_attention.unavailable_reason(*probe)}")
    lengths, new = [20, 6, 9], [1, 6, 1]
    k_cache, v_cache, table = _pool(lengths, 4, 2, 32, seed=4)
    meta = _meta(lengths, new, table, 4, decode=False)
    args = (torch.randn(sum(new), 8, 32), k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, table, 4, 0.2, 0)
    torch.library.opcheck(torch.ops.astrai.cpu_extend_attention.default, args)

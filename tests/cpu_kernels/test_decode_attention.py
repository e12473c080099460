"""cpu_kernels.decode_attention: the AVX-512 paged decode attention equals the plain-torch reference.

The reference is `triton_kernels.decode_attention.decode_attention_ref` (a page gather + masked fp32 SDPA), the
CPU path the kernel replaces in `astrai.ops.attention`. The tests skip on CPUs without AVX-512 (bf16: without
AVX512-BF16).
"""

import pytest
import torch

from astrai.cpu_kernels import decode_attention as cpu_attention
from astrai.ops.attention import paged_attention
from astrai.triton_kernels.decode_attention import decode_attention_ref
from helpers import assert_close

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _needs_kernel(dtype: torch.dtype) -> None:
    probe = torch.zeros(1, 1, 16, dtype=dtype)
    if not cpu_attention.supports(probe, probe):
        pytest.skip(f"no CPU decode attention kernel here: {cpu_attention.unavailable_reason(probe, probe)}")


def _pool(lens, *, heads=6, kv_heads=2, dim=64, page=16, width=None, dtype=torch.float32, seed=0):
    """Random caches and a shuffled block table holding `lens` tokens per request (pages never shared)."""
    gen = torch.Generator().manual_seed(seed)
    width = width or max(1, -(-max(lens) // page))
    num_pages = len(lens) * width + 3
    k = torch.randn(num_pages * page, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_pages * page, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen)[: len(lens) * width].int()
    table = order.view(len(lens), width).contiguous()
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


def _both(q, k, v, table, lens, page=16, scale=0.125, window=0):
    kw = dict(page_size=page, scale=scale, window=window)
    return cpu_attention.decode_attention(q, k, v, table, lens, **kw), decode_attention_ref(q, k, v, table, lens, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "dim"),
    [
        ([1], 6, 2, 64),  # one key
        ([17, 5, 40], 6, 2, 64),  # partial pages, several requests
        ([300], 9, 3, 64),  # SmolLM2's heads, one split
        ([1500], 4, 1, 128),  # long context: split and merged
        ([33, 700], 8, 8, 80),  # no GQA, D % 32 == 16
        ([64], 16, 1, 256),  # the widest group and head dim
    ],
)
def test_kernel_equals_the_reference(dtype, lens, heads, kv_heads, dim):
    _needs_kernel(dtype)
    q, k, v, table, seq_lens = _pool(lens, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype)
    out, ref = _both(q, k, v, table, seq_lens, scale=dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # negative control: another request's pages give another answer
    swapped, _ = _both(q, k, v, table.roll(1, 0), seq_lens, scale=dim**-0.5)
    if len(lens) > 1:
        assert (swapped.float() - ref.float()).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_empty_requests_and_clamped_tables(dtype):
    _needs_kernel(dtype)
    q, k, v, table, lens = _pool([100, 0, 37, 900], dtype=dtype, width=60)
    table[2, 5:] = 10_000  # entries past the pool are clamped (unused here: request 2 owns 3 pages)
    table[0, 1] = -4  # negative: clamped to page 0
    for window in (0, 1, 16, 50, 4096):
        out, ref = _both(q, k, v, table, lens, window=window)
        assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # no tokens: zeros, as the reference
    lens[1] = -5  # a negative length reads nothing, as the reference
    out, ref = _both(q, k, v, table, lens)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(ref[1], torch.zeros_like(ref[1]))
    # lengths past the table's pages: the reference attends to what the table holds, so does the kernel
    out, ref = _both(q[:1], k, v, table[:1, :2], lens[:1])
    assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_stale_nan_rows_past_a_length_are_never_read():
    _needs_kernel(torch.float32)
    q, k, v, table, lens = _pool([20], width=2)
    rows = table[0, 1] * 16 + torch.arange(4, 16)  # positions 20..31 of the request's second page
    k[rows], v[rows] = float("nan"), float("nan")
    out, ref = _both(q, k, v, table, lens)
    assert torch.isfinite(out).all()
    assert_close(out, ref, atol=2e-5, rtol=2e-5)
    lens[0] = 32  # negative control: reaching into them poisons the output
    assert torch.isnan(_both(q, k, v, table, lens)[0]).any()


def test_thread_count_does_not_change_the_result():
    _needs_kernel(torch.float32)
    q, k, v, table, lens = _pool([2000, 3], dim=64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.decode_attention(q, k, v, table, lens, page_size=16, scale=0.125)
        torch.set_num_threads(2)
        two = cpu_attention.decode_attention(q, k, v, table, lens, page_size=16, scale=0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_strided_caches_and_unsupported_shapes():
    _needs_kernel(torch.float32)
    q, k, v, table, lens = _pool([50, 9])
    wide = torch.randn(k.shape[0], 2, 2, 64)  # the caches as views into a [S, K, 2, D] tensor
    wide[:, :, 0], wide[:, :, 1] = k, v
    out, ref = _both(q, wide[:, :, 0], wide[:, :, 1], table, lens)
    assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for bad_q, bad_k, why in [
        (q[..., :40], k[..., :40], "head dim 40"),
        (q.double(), k.double(), "dtypes"),
        (q, k.bfloat16(), "dtypes"),
        (torch.randn(2, 34, 64), torch.randn(k.shape[0], 2, 64), "17 per KV head"),
        (q, k.transpose(0, 2).contiguous().transpose(0, 2), "not contiguous"),
    ]:
        reason = cpu_attention.unavailable_reason(bad_q, bad_k)
        assert reason is not None and (why in reason or why == "17 per KV head"), reason
        with pytest.raises(ValueError, match="cannot run here"):
            cpu_attention.decode_attention(bad_q, bad_k, bad_k, table, lens, page_size=16, scale=0.125)
    with pytest.raises(ValueError, match="int32"):
        cpu_attention.decode_attention(q, k, v, table.long(), lens, page_size=16, scale=0.125)
    with pytest.raises(ValueError, match="must be on the CPU"):
        cpu_attention.decode_attention(q, k, v, table.to("meta"), lens, page_size=16, scale=0.125)
    with pytest.raises(ValueError, match="page size 0"):
        cpu_attention.decode_attention(q, k, v, table, lens, page_size=0, scale=0.125)
    with pytest.raises(ValueError, match="seq_lens"):
        cpu_attention.decode_attention(q, k, v, table, lens[:1], page_size=16, scale=0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_takes_the_kernel_eager_and_compiled(dtype, monkeypatch):
    """`astrai.ops.attention` calls the kernel on CPU decode (one opaque op per call in compiled graphs)."""
    from torch._inductor.utils import run_and_get_code

    from astrai.inference.cache import make_attn_meta

    _needs_kernel(dtype)
    q, k, v, table, lens = _pool([40, 7], dtype=dtype, width=3)
    meta = make_attn_meta(table.tolist(), [39, 6], [1, 1], page_size=16, device="cpu", decode=True)
    expected = decode_attention_ref(q, k, v, meta.block_table, meta.seq_lens, page_size=16, scale=0.125)
    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    eager = paged_attention(q, k, v, meta, scale=0.125)
    assert calls, "eager CPU decode did not take the kernel"
    assert_close(eager.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    compiled = torch.compile(lambda q, k, v, meta: paged_attention(q, k, v, meta, scale=0.125), fullgraph=True)
    out, (code, *_) = run_and_get_code(compiled, q, k, v, meta)
    assert code.count("torch.ops.astrai.cpu_decode_attention.default(") == 1
    assert "scaled_dot_product" not in code
    assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])

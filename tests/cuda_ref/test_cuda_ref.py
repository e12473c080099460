"""The compiled CUDA references on a GPU against the plain-torch references (computed on CPU, so no TF32).

Covers both kernel paths (tensor-core MMA and the scalar fallback forced with allow_mma=False) over fp32/fp16/
bf16, page sizes 1 and 16, GQA group sizes 1/4/8 (and 20: two MMA head passes), head dims 64/128 (and 256),
mixed request lengths with a padding row, sliding windows, strided query views, NaN-poisoned unreadable pool
slots (see _attn_cases), unchanged inputs, CUDA-graph capture (current stream, no host sync), int64 address
offsets, and the ValueError checks of the wrappers. Builds the extension on first use (about a minute).
"""

from __future__ import annotations

import pytest
import torch
from _attn_cases import PagedCase, decode_case, extend_case, rotary_case

from astrai import cuda_ref
from helpers import TOLERANCES, assert_close

pytestmark = [
    pytest.mark.cuda_ref,
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ref.available(), reason=f"cuda_ref: {cuda_ref.unavailable_reason()}"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DECODE_LENS = [0, 1, 16, 17, 40, 300, 2049]  # padding row, tile edges, many splits
EXTEND_PAIRS = [(0, 70), (33, 1), (0, 0), (90, 17), (0, 200), (700, 64)]  # (cached prefix, new tokens)
# (group size G, kv heads K, head dim D, page size N)
SHAPES = [(1, 2, 64, 1), (4, 2, 128, 16), (8, 1, 64, 16), (4, 2, 64, 1), (1, 4, 128, 16), (8, 2, 128, 1)]
EXTRA_SHAPES = [(20, 1, 64, 16), (4, 1, 256, 16)]


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    cuda_ref.load()


def _strided_cuda(t: torch.Tensor) -> torch.Tensor:
    # .cuda() would make the strided query views contiguous; keep their exact strides instead.
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
    return out.copy_(t)


def _cuda(case: PagedCase) -> PagedCase:
    return PagedCase(**{k: (_strided_cuda(v) if isinstance(v, torch.Tensor) else v) for k, v in vars(case).items()})


def _run_decode(case: PagedCase, allow_mma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from astrai.triton_kernels.decode_attention import decode_attention_ref

    g = _cuda(case)
    before = [t.clone() for t in g.tensors()]
    kw = dict(page_size=case.page_size, scale=case.scale, window=case.window)
    out = cuda_ref.decode_attention(g.q, g.k_cache, g.v_cache, g.block_table, g.seq_lens, allow_mma=allow_mma, **kw)
    for t, b in zip(g.tensors(), before, strict=True):
        assert torch.equal(t.nan_to_num(), b.nan_to_num()), "an input was modified"
    ref = decode_attention_ref(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, **kw)
    return out, ref


def _run_extend(case: PagedCase, allow_mma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from astrai.triton_kernels.extend_attention import extend_attention_ref

    g = _cuda(case)
    before = [t.clone() for t in g.tensors()]
    kw = dict(page_size=case.page_size, scale=case.scale, window=case.window)
    args = (g.q, g.k_cache, g.v_cache, g.cu_seqlens_q, g.seq_lens, g.block_table)
    out = cuda_ref.extend_attention(*args, allow_mma=allow_mma, **kw)
    for t, b in zip(g.tensors(), before, strict=True):
        assert torch.equal(t.nan_to_num(), b.nan_to_num()), "an input was modified"
    ref_args = (case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table)
    return out, extend_attention_ref(*ref_args, **kw)


@pytest.mark.parametrize("allow_mma", [True, False], ids=["mma", "scalar"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize(("group", "kv_heads", "head_dim", "page_size"), SHAPES + EXTRA_SHAPES)
def test_decode_matches_ref(group, kv_heads, head_dim, page_size, window, dtype, allow_mma):
    case = decode_case(DECODE_LENS, group=group, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                       dtype=dtype, window=window)  # fmt: skip
    out, ref = _run_decode(case, allow_mma)
    assert out.is_contiguous() and out.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, ref, atol=atol, rtol=rtol, msg=f"decode G={group} K={kv_heads} D={head_dim} N={page_size}")


@pytest.mark.parametrize("allow_mma", [True, False], ids=["mma", "scalar"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 45])
@pytest.mark.parametrize(("group", "kv_heads", "head_dim", "page_size"), SHAPES + EXTRA_SHAPES)
def test_extend_matches_ref(group, kv_heads, head_dim, page_size, window, dtype, allow_mma):
    case = extend_case(EXTEND_PAIRS, group=group, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                       dtype=dtype, window=window)  # fmt: skip
    out, ref = _run_extend(case, allow_mma)
    assert out.is_contiguous() and out.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, ref, atol=atol, rtol=rtol, msg=f"extend G={group} K={kv_heads} D={head_dim} N={page_size}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("table_rows", [None, 4096])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_ref(dtype, interleaved, table_rows, head_dim):
    from astrai.triton_kernels.rotary import rotary_ref

    q, k, cos, sin, positions = rotary_case(37, 8, 2, head_dim, dtype, table_rows=table_rows)
    gq, gk = q.cuda(), k.cuda()
    gpos = positions.cuda() if positions is not None else None
    q0, k0 = gq.clone(), gk.clone()
    q_out, k_out = cuda_ref.rotary(gq, gk, cos.cuda(), sin.cuda(), gpos, interleaved=interleaved)
    q_ref, k_ref = rotary_ref(q, k, cos, sin, positions, interleaved=interleaved)
    atol, rtol = TOLERANCES[dtype]
    assert_close(q_out, q_ref, atol=atol, rtol=rtol, msg="rotary q")
    assert_close(k_out, k_ref, atol=atol, rtol=rtol, msg="rotary k")
    assert torch.equal(gq, q0) and torch.equal(gk, k0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_in_cuda_graph(dtype):
    """Capture on a side stream and replay with new queries: launches use the current stream, never sync."""
    from astrai.triton_kernels.decode_attention import decode_attention_ref

    case = decode_case([5, 300, 64], group=4, kv_heads=2, head_dim=128, page_size=16, dtype=dtype)
    g = _cuda(case)
    q_static = g.q.clone()
    kw = dict(page_size=case.page_size, scale=case.scale)
    cuda_ref.decode_attention(q_static, g.k_cache, g.v_cache, g.block_table, g.seq_lens, **kw)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_ref.decode_attention(q_static, g.k_cache, g.v_cache, g.block_table, g.seq_lens, **kw)
    new_q = torch.randn(case.q.shape, dtype=torch.float32).to(dtype)
    q_static.copy_(new_q.cuda())
    graph.replay()
    torch.cuda.synchronize()
    ref = decode_attention_ref(new_q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, **kw)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, ref, atol=atol, rtol=rtol, msg="graph replay")


def test_int64_offsets():
    """Pages placed past 2^31 elements into the pool: slot arithmetic must be 64-bit (~8.6 GB of GPU memory)."""
    from astrai.triton_kernels.decode_attention import decode_attention_ref

    dtype, head_dim, page_size = torch.bfloat16, 128, 16
    base = decode_case([50, 300], group=4, kv_heads=1, head_dim=head_dim, page_size=page_size, dtype=dtype)
    shift = 2**31 // (head_dim * page_size) + 8  # pages before the real ones: slot * D > 2^31
    big_k = torch.empty((shift * page_size + base.k_cache.shape[0], 1, head_dim), dtype=dtype, device="cuda")
    big_v = torch.empty_like(big_k)
    big_k[shift * page_size :] = base.k_cache.cuda()
    big_v[shift * page_size :] = base.v_cache.cuda()
    table = (base.block_table + shift).cuda()
    kw = dict(page_size=page_size, scale=base.scale)
    ref = decode_attention_ref(base.q, base.k_cache, base.v_cache, base.block_table, base.seq_lens, **kw)
    atol, rtol = TOLERANCES[dtype]
    for allow_mma in (True, False):
        q, lens = _strided_cuda(base.q), base.seq_lens.cuda()
        out = cuda_ref.decode_attention(q, big_k, big_v, table, lens, allow_mma=allow_mma, **kw)
        assert_close(out, ref, atol=atol, rtol=rtol, msg=f"int64 offsets, allow_mma={allow_mma}")


def _valid_decode_args() -> tuple[tuple, dict]:
    g = _cuda(decode_case([3, 9], group=2, kv_heads=2, head_dim=64, page_size=4, dtype=torch.float16))
    return (g.q, g.k_cache, g.v_cache, g.block_table, g.seq_lens), dict(page_size=4, scale=0.125)


@pytest.mark.parametrize(
    ("index", "bad", "match"),
    [
        (3, lambda t: t.long(), "block_table must be torch.int32"),
        (4, lambda t: t.long(), "seq_lens must be torch.int32"),
        (0, lambda t: t.float(), "k_cache must be torch.float32"),
        (0, lambda t: t.cpu(), "CUDA tensor"),
        (0, lambda t: torch.zeros(*t.shape[:2], 96, dtype=t.dtype, device=t.device), "head dim must be one of"),
        (1, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "contiguous last dim"),
        (0, lambda t: t[:, :3], "multiple of K"),
    ],
)
def test_decode_rejects_bad_inputs(index, bad, match):
    args, kw = _valid_decode_args()
    args = list(args)
    args[index] = bad(args[index])
    with pytest.raises(ValueError, match=match):
        cuda_ref.decode_attention(*args, **kw)


def test_extend_and_rotary_reject_bad_inputs():
    g = _cuda(extend_case([(2, 3)], group=1, kv_heads=1, head_dim=64, page_size=4, dtype=torch.float16))
    with pytest.raises(ValueError, match="cu_seqlens_q needs"):
        cuda_ref.extend_attention(g.q, g.k_cache, g.v_cache, g.cu_seqlens_q[:1], g.seq_lens, g.block_table,
                                  page_size=4, scale=0.125)  # fmt: skip
    with pytest.raises(ValueError, match="window"):
        cuda_ref.extend_attention(g.q, g.k_cache, g.v_cache, g.cu_seqlens_q, g.seq_lens, g.block_table,
                                  page_size=4, scale=0.125, window=-1)  # fmt: skip
    q, k, cos, sin, _ = rotary_case(4, 2, 1, 64, torch.float16, table_rows=None)
    with pytest.raises(ValueError, match="float32"):
        cuda_ref.rotary(q.cuda(), k.cuda(), cos.cuda().half(), sin.cuda())
    with pytest.raises(ValueError, match="T=4 rows"):
        cuda_ref.rotary(q.cuda(), k.cuda(), cos[:3].cuda(), sin[:3].cuda())

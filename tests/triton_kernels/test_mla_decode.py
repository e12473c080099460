"""mla_decode (Triton; interpreted on CPU) against mla_decode_ref, and the ref against a per-token oracle."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from astrai.triton_kernels.mla_decode import _mla_decode, mla_decode, mla_decode_ref
from helpers import DEVICE, TOLERANCES, assert_close, assert_compiles_for_gpu

# A single token, lengths off a block multiple (16), an exact multiple, and a padding row (0).
LENS = [1, 37, 0, 32, 5]


def _batch(lens: list[int], *, heads: int, rank: int, rope_dim: int, page_size: int, dtype: torch.dtype,
           device: str = DEVICE):  # fmt: skip
    """q and a latent pool; each request's pages are a shuffled subset and table entries past its pages point at
    other requests' pages, so reading past a length changes the result."""
    batch = len(lens)
    max_pages = max(1, -(-max(lens) // page_size)) + 1
    num_pages = batch * max_pages + 3
    block_table = torch.randperm(num_pages)[: batch * max_pages].view(batch, max_pages).to(torch.int32)
    cache = torch.randn(num_pages * page_size, rank + rope_dim).to(dtype)
    q = torch.randn(batch, heads, rank + rope_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, cache, block_table, seq_lens))


def _oracle(q: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, *, rank: int, page_size: int,
            scale: float) -> Tensor:  # fmt: skip
    """Independent formulation: per request, expand the latent into explicit per-head K and V, then softmax."""
    out = torch.zeros(*q.shape[:2], rank, dtype=torch.float64)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        rows = cache[[int(block_table[b, j // page_size]) * page_size + j % page_size for j in range(n)]].double()
        k_nope, k_pe = rows[:, :rank], rows[:, rank:]  # [L, R], [L, Dr]
        scores = (q[b, :, :rank].double() @ k_nope.T + q[b, :, rank:].double() @ k_pe.T) * scale  # [H, L]
        out[b] = torch.softmax(scores, -1) @ k_nope
    return out


def _check(out: Tensor, ref: Tensor, dtype: torch.dtype, msg: str = "") -> None:
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.is_contiguous()
    assert_close(out, ref, atol=atol, rtol=rtol, msg=msg)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "rank", "rope_dim"), [(4, 32, 16), (3, 48, 8)])
def test_matches_ref(dtype: torch.dtype, page_size: int, heads: int, rank: int, rope_dim: int) -> None:
    q, cache, bt, lens = _batch(LENS, heads=heads, rank=rank, rope_dim=rope_dim, page_size=page_size, dtype=dtype)
    kw = dict(kv_lora_rank=rank, page_size=page_size, scale=(rank + rope_dim) ** -0.5)
    out = mla_decode(q, cache, bt, lens, **kw)
    assert out.shape == (len(LENS), heads, rank)
    _check(out, mla_decode_ref(q, cache, bt, lens, **kw), dtype)
    assert not out[2].any()  # padding row


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_split_merge(num_splits: int, page_size: int) -> None:
    # more splits than blocks leaves empty splits, which the merge must weigh as zero
    q, cache, bt, lens = _batch(LENS, heads=4, rank=32, rope_dim=16, page_size=page_size, dtype=torch.float32)
    out = _mla_decode(q, cache, bt, lens, 32, page_size, 0.15, num_splits)
    ref = mla_decode_ref(q, cache, bt, lens, kv_lora_rank=32, page_size=page_size, scale=0.15)
    _check(out, ref, torch.float32, f"splits {num_splits}")


def test_many_heads_span_head_blocks() -> None:
    # 20 heads: two head blocks of 16, the second partly masked
    q, cache, bt, lens = _batch([3, 20], heads=20, rank=16, rope_dim=16, page_size=4, dtype=torch.float32)
    kw = dict(kv_lora_rank=16, page_size=4, scale=0.2)
    _check(mla_decode(q, cache, bt, lens, **kw), mla_decode_ref(q, cache, bt, lens, **kw), torch.float32)


@pytest.mark.parametrize("page_size", [1, 4])
def test_ref_matches_oracle(page_size: int) -> None:
    q, cache, bt, lens = _batch(LENS, heads=2, rank=24, rope_dim=8, page_size=page_size, dtype=torch.float32)
    ref = mla_decode_ref(q, cache, bt, lens, kv_lora_rank=24, page_size=page_size, scale=0.3)
    assert_close(ref, _oracle(q, cache, bt, lens, rank=24, page_size=page_size, scale=0.3), atol=1e-5)


def test_inputs_unchanged_and_empty_batch() -> None:
    args = _batch(LENS, heads=2, rank=32, rope_dim=16, page_size=16, dtype=torch.bfloat16)
    before = [t.clone() for t in args]
    mla_decode(*args, kv_lora_rank=32, page_size=16, scale=0.2)
    for t, b in zip(args, before, strict=True):
        assert torch.equal(t, b)
    q, cache, bt, lens = args
    assert mla_decode(q[:0], cache, bt[:0], lens[:0], kv_lora_rank=32, page_size=16, scale=0.2).shape == (0, 2, 32)


def test_strided_inputs() -> None:
    # q as a view into a wider buffer and a pool with padded rows: only the last dims must be contiguous
    q, cache, bt, lens = _batch([6, 11], heads=2, rank=16, rope_dim=16, page_size=4, dtype=torch.float32)
    q_wide = torch.zeros(2, 3, 32)
    q_wide[:, :2] = q
    cache_wide = torch.zeros(cache.shape[0], 40)
    cache_wide[:, :32] = cache
    kw = dict(kv_lora_rank=16, page_size=4, scale=0.2)
    out = mla_decode(q_wide[:, :2], cache_wide[:, :32], bt, lens, **kw)
    _check(out, mla_decode_ref(q, cache, bt, lens, **kw), torch.float32)


def test_opcheck() -> None:
    args = _batch([5, 0, 19], heads=2, rank=16, rope_dim=16, page_size=4, dtype=torch.float32)
    torch.library.opcheck(mla_decode, args, dict(kv_lora_rank=16, page_size=4, scale=0.25))


def test_compiles_fullgraph() -> None:
    q, cache, bt, lens = _batch([5, 0, 19], heads=2, rank=16, rope_dim=16, page_size=4, dtype=torch.float32)

    def step(q: Tensor) -> Tensor:
        return mla_decode(q * 2.0, cache, bt, lens, kv_lora_rank=16, page_size=4, scale=0.25) + 1.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fails on a graph break or a host sync
    assert_close(compiled(q), step(q), atol=1e-6)


# Compiles the GPU variants (bf16 tensor-core dots, fp32 ieee dots, per-page and per-token slot paths, direct and
# merged outputs) to PTX/cubin for sm_80 and sm_90 without a device: the interpreter accepts programs the compiler
# rejects. DeepSeek-V3 sizes: R = 512, Dr = 64.
_AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from astrai.triton_kernels.mla_decode import _mla_decode_stage1_kernel as s1

for dt, page, block_n, splits in [("bf16", 64, 16, 1), ("fp16", 1, 32, 4), ("fp32", 16, 16, 2)]:
    types = {n: "*" + dt for n in ("q_ptr", "cache_ptr", "out_ptr")}
    types.update(block_table_ptr="*i32", seq_lens_ptr="*i32", mid_o_ptr="*fp32", mid_lse_ptr="*fp32",
                 scale_log2e="fp32")
    consts = dict(NUM_HEADS=128, KV_LORA_RANK=512, ROPE_DIM=64, BLOCK_H=16, BLOCK_R=512, BLOCK_PE=64,
                  BLOCK_N=block_n, PAGE_SIZE=page, NUM_SPLITS=splits, UPCAST=False)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in s1.arg_names}
    for arch in (80, 90):
        triton.compile(ASTSource(s1, sig, consts), target=GPUTarget("cuda", arch, 32),
                       options=dict(enable_fp_fusion=True, num_warps=4, num_stages=2))
"""


@pytest.mark.slow
def test_compiles_for_gpu_targets() -> None:
    assert_compiles_for_gpu(_AOT_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 64])
def test_compiled_gpu(dtype: torch.dtype, page_size: int) -> None:
    # DeepSeek-V3 widths, 16 heads (one TP shard of 128), long ragged requests: autotuned blocks and splits
    args = _batch([1, 700, 4099, 0, 2048], heads=16, rank=512, rope_dim=64, page_size=page_size, dtype=dtype,
                  device="cuda")  # fmt: skip
    kw = dict(kv_lora_rank=512, page_size=page_size, scale=192**-0.5)
    _check(mla_decode(*args, **kw), mla_decode_ref(*args, **kw), dtype)

"""decode_attention (Triton; interpreted on CPU) against decode_attention_ref, and the ref against SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.triton_kernels.decode_attention import (
    _decode_attention,
    _num_splits,
    decode_attention,
    decode_attention_ref,
)
from helpers import DEVICE, TOLERANCES, assert_close, assert_compiles_for_gpu

# Mixed lengths: a single token, lengths that are not multiples of a block (16), an exact multiple, and a
# padding row (0).
LENS = [1, 37, 0, 80, 16]


def _batch(lens: list[int], *, kv_heads: int, group: int, head_dim: int, page_size: int, dtype: torch.dtype,
           device: str = DEVICE, spare_pages: int = 1):  # fmt: skip
    """q and a pool where each request's pages are a shuffled, non-contiguous subset.

    Block-table entries past a request's pages point at other requests' pages, so reading them changes the result.
    """
    batch = len(lens)
    max_pages = max(1, -(-max(lens) // page_size)) + spare_pages
    num_pages = batch * max_pages + 3
    block_table = torch.randperm(num_pages)[: batch * max_pages].view(batch, max_pages).to(torch.int32)
    slots = num_pages * page_size
    k_cache = torch.randn(slots, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim).to(dtype)
    q = torch.randn(batch, kv_heads * group, head_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, block_table, seq_lens))


def _sdpa_oracle(q, k_cache, v_cache, block_table, seq_lens, *, page_size, scale, window) -> Tensor:
    """Independent formulation: per request, gather contiguous K/V position by position, then torch SDPA."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        slots = [int(block_table[b, p // page_size]) * page_size + p % page_size for p in range(seq_len)]
        k = k_cache[slots].float().transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
        v = v_cache[slots].float().transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
        allowed = torch.arange(seq_len, device=q.device) > seq_len - 1 - window
        if window <= 0:
            allowed = torch.ones(seq_len, dtype=torch.bool, device=q.device)
        o = F.scaled_dot_product_attention(q[b].float()[:, None], k, v, attn_mask=allowed[None, None], scale=scale)
        out[b] = o[:, 0]  # [H, D]
    return out


def _check(out: Tensor, ref: Tensor, dtype: torch.dtype, msg: str = "") -> None:
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.is_contiguous()
    assert_close(out, ref, atol=atol, rtol=rtol, msg=msg)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (4, 128), (8, 64)])
def test_matches_ref(dtype: torch.dtype, page_size: int, group: int, head_dim: int) -> None:
    q, kc, vc, bt, lens = _batch(LENS, kv_heads=2, group=group, head_dim=head_dim, page_size=page_size, dtype=dtype)
    kw = dict(page_size=page_size, scale=head_dim**-0.5)
    out = decode_attention(q, kc, vc, bt, lens, **kw)
    _check(out, decode_attention_ref(q, kc, vc, bt, lens, **kw), dtype)
    assert not out[2].any()  # padding row


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [0, 5])
def test_split_merge(num_splits: int, page_size: int, window: int) -> None:
    # More splits than blocks leaves empty splits, which the merge must weigh as zero.
    q, kc, vc, bt, lens = _batch(LENS, kv_heads=2, group=4, head_dim=64, page_size=page_size, dtype=torch.float32)
    out = _decode_attention(q, kc, vc, bt, lens, page_size, 0.125, window, num_splits)
    ref = decode_attention_ref(q, kc, vc, bt, lens, page_size=page_size, scale=0.125, window=window)
    _check(out, ref, torch.float32, f"splits {num_splits}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [1, 7, 16, 200])
def test_sliding_window(dtype: torch.dtype, page_size: int, window: int) -> None:
    q, kc, vc, bt, lens = _batch(LENS, kv_heads=2, group=2, head_dim=64, page_size=page_size, dtype=dtype)
    kw = dict(page_size=page_size, scale=0.125, window=window)
    _check(decode_attention(q, kc, vc, bt, lens, **kw), decode_attention_ref(q, kc, vc, bt, lens, **kw), dtype)


@pytest.mark.parametrize("head_dim", [80, 256])
def test_other_head_dims(head_dim: int) -> None:
    q, kc, vc, bt, lens = _batch([3, 20], kv_heads=1, group=2, head_dim=head_dim, page_size=4, dtype=torch.float32)
    kw = dict(page_size=4, scale=head_dim**-0.5)
    _check(decode_attention(q, kc, vc, bt, lens, **kw), decode_attention_ref(q, kc, vc, bt, lens, **kw), torch.float32)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [0, 5])
def test_ref_matches_sdpa(page_size: int, group: int, window: int) -> None:
    q, kc, vc, bt, lens = _batch(LENS, kv_heads=2, group=group, head_dim=32, page_size=page_size, dtype=torch.float32)
    kw = dict(page_size=page_size, scale=0.3, window=window)
    assert_close(decode_attention_ref(q, kc, vc, bt, lens, **kw), _sdpa_oracle(q, kc, vc, bt, lens, **kw), atol=1e-5)


def test_inputs_unchanged_and_empty_batch() -> None:
    args = _batch(LENS, kv_heads=2, group=2, head_dim=32, page_size=16, dtype=torch.bfloat16)
    before = [t.clone() for t in args]
    decode_attention(*args, page_size=16, scale=0.2, window=9)
    for t, b in zip(args, before, strict=True):
        assert torch.equal(t, b)
    q, kc, vc, bt, lens = args
    assert decode_attention(q[:0], kc, vc, bt[:0], lens[:0], page_size=16, scale=0.2).shape == (0, 4, 32)


def test_opcheck() -> None:
    args = _batch([5, 0, 19], kv_heads=2, group=2, head_dim=16, page_size=4, dtype=torch.float32)
    torch.library.opcheck(decode_attention, args, dict(page_size=4, scale=0.25, window=6))


def test_compiles_fullgraph() -> None:
    q, kc, vc, bt, lens = _batch([5, 0, 19], kv_heads=2, group=2, head_dim=16, page_size=4, dtype=torch.float32)

    def step(q: Tensor) -> Tensor:
        return decode_attention(q * 2.0, kc, vc, bt, lens, page_size=4, scale=0.25) + 1.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fails on a graph break or a host sync
    assert_close(compiled(q), step(q), atol=1e-6)


def test_num_splits_from_shapes() -> None:
    cpu = torch.device("cpu")
    assert _num_splits(4, 2, 80, cpu) == 1  # short maximum length: one split
    assert _num_splits(1, 1, 4096, cpu) == 16  # few programs: split up to the 4 x stand-in SM count
    for batch, heads, max_len in [(1, 8, 16384), (64, 8, 1 << 20), (3, 1, 300), (1, 1, 1 << 20)]:
        n = _num_splits(batch, heads, max_len, cpu)
        assert 1 <= n <= 64 and n & (n - 1) == 0 and n * 256 <= max(max_len, 256)


# Compiles the GPU variants (16-bit tensor-core dots, fp32 ieee dots, per-page and per-token slot paths, direct
# and merged outputs) to PTX/cubin for sm_80 and sm_90 without a device: the CPU suite otherwise only ever runs
# the interpreter, which accepts programs the compiler rejects.
_AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from astrai.triton_kernels.decode_attention import _decode_stage1_kernel as s1, _decode_stage2_kernel as s2

def build(fn, types, consts, **options):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    for arch in (80, 90):
        triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32),
                       options=dict(enable_fp_fusion=True, **options))

for dt, page, block_n, splits in [("bf16", 16, 16, 1), ("fp16", 1, 64, 3), ("fp32", 64, 32, 4)]:
    types = {n: "*" + dt for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    types.update(block_table_ptr="*i32", seq_lens_ptr="*i32", mid_o_ptr="*fp32", mid_lse_ptr="*fp32",
                 scale_log2e="fp32")
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=block_n, PAGE_SIZE=page,
                  NUM_SPLITS=splits, UPCAST=False)
    build(s1, types, consts, num_warps=4, num_stages=3)
types = dict(mid_o_ptr="*fp32", mid_lse_ptr="*fp32", out_ptr="*bf16")
build(s2, types, dict(HEAD_DIM=80, BLOCK_D=128, NUM_SPLITS=3, BLOCK_S=4), num_warps=4)
"""


def test_compiles_for_gpu_targets() -> None:
    assert_compiles_for_gpu(_AOT_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_compiled_gpu(dtype: torch.dtype, page_size: int) -> None:
    # Long requests exercise autotuned block sizes, several splits and 16-bit tensor-core dots.
    lens = [1, 700, 4099, 0, 2048]
    args = _batch(lens, kv_heads=8, group=4, head_dim=128, page_size=page_size, dtype=dtype, device="cuda")
    for window in (0, 1000):
        kw = dict(page_size=page_size, scale=128**-0.5, window=window)
        _check(decode_attention(*args, **kw), decode_attention_ref(*args, **kw), dtype, f"window {window}")


@pytest.mark.gpu
def test_int64_offsets_gpu() -> None:
    # Pool of 2**31 + 16 * 128 elements per cache; the requests' pages sit at its end, past int32 offsets.
    kv_heads, head_dim, page_size = 1, 128, 16
    num_pages = 2**31 // (kv_heads * head_dim * page_size) + 1
    k_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.arange(num_pages - 8, num_pages, device="cuda", dtype=torch.int32).flip(0).view(2, 4)
    q = torch.randn(2, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor([64, 33], device="cuda", dtype=torch.int32)
    kw = dict(page_size=page_size, scale=head_dim**-0.5)
    args = (q, k_cache, v_cache, block_table, seq_lens)
    _check(decode_attention(*args, **kw), decode_attention_ref(*args, **kw), torch.bfloat16)

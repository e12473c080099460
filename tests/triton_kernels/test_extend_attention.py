"""Ragged paged extend attention: Triton kernel vs `extend_attention_ref`, and the ref vs torch SDPA.

On CPU the kernel runs under the Triton interpreter, so batches stay tiny. Pools are poisoned: slots no request
owns and block-table entries past each request's pages point at NaN K/V, so a read outside the contract shows.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from astrai.triton_kernels.extend_attention import extend_attention, extend_attention_ref
from helpers import TOLERANCES, assert_close, assert_compiles_for_gpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = list(TOLERANCES)


def make_batch(q_lens, prefixes, heads, kv_heads, head_dim, page_size, dtype, *, pad_tokens=0, device=DEVICE):
    """Random ragged batch whose K/V (prefix and new) sit in shuffled pages of a NaN-poisoned pool.

    Returns:
        dict of the op's tensor arguments plus `page_size`; q has `pad_tokens` extra rows owned by no request.
    """
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    pages_per_req = [math.ceil(s / page_size) for s in seq_lens]
    max_pages = max(pages_per_req) + 2  # extra columns must never be read
    num_pages = sum(pages_per_req) + 3  # + spare pages (poisoned) + the poison page at index 0
    perm = (torch.randperm(num_pages - 1) + 1).tolist()  # page 0 stays poison
    block_table = torch.zeros(len(q_lens), max_pages, dtype=torch.int32)
    for b, n_pages in enumerate(pages_per_req):
        block_table[b, :n_pages] = torch.tensor([perm.pop() for _ in range(n_pages)], dtype=torch.int32)
    slots = num_pages * page_size
    k_cache = torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype)
    for b, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        slot = block_table[b, pos // page_size].long() * page_size + pos % page_size
        k_cache[slot] = torch.randn(seq_len, kv_heads, head_dim).to(dtype)
        v_cache[slot] = torch.randn(seq_len, kv_heads, head_dim).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens) + pad_tokens, heads, head_dim).to(dtype)
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu)
    tensors |= dict(seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=block_table)
    return {name: t.to(device) for name, t in tensors.items()} | dict(page_size=page_size)


# (q_lens, prefixes, H, K, D, page size, window)
CASES = {
    "prefill": ([19], [0], 4, 4, 64, 1, 0),
    "prefix_hit": ([13], [21], 4, 1, 128, 16, 0),
    "mixed_page16": ([1, 17, 9, 30], [40, 0, 5, 11], 8, 1, 64, 16, 0),
    "mixed_page1": ([1, 17, 9, 30], [40, 0, 5, 11], 8, 2, 128, 1, 0),
    "window": ([25, 1, 12], [10, 30, 0], 4, 1, 64, 16, 7),
    "window_tile_multiple": ([40], [20], 2, 2, 64, 1, 16),
    "odd_shapes": ([11, 6], [3, 0], 6, 2, 80, 3, 0),
    "empty_request": ([5, 0, 8], [2, 9, 0], 2, 1, 64, 4, 0),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_ref(case: str, dtype: torch.dtype) -> None:
    q_lens, prefixes, heads, kv_heads, head_dim, page_size, window = CASES[case]
    batch = make_batch(q_lens, prefixes, heads, kv_heads, head_dim, page_size, dtype, pad_tokens=2)
    kw = dict(scale=head_dim**-0.5, window=window)
    out = extend_attention(**batch, **kw)
    ref = extend_attention_ref(**batch, **kw)
    assert out.dtype == dtype and out.shape == batch["q"].shape
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, ref, atol=atol, rtol=rtol, msg=case)
    assert not out[-2:].any(), "rows owned by no request must be zeros"


def _pool_gather(batch: dict, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    # K/V of request b in position order: [L, K, D] each.
    seq_len, n = int(batch["seq_lens"][b]), batch["page_size"]
    pos = torch.arange(seq_len, device=batch["q"].device)
    slot = batch["block_table"][b, pos // n].long() * n + pos % n
    return batch["k_cache"][slot], batch["v_cache"][slot]


def test_ref_matches_sdpa_prefill() -> None:
    batch = make_batch([23], [0], 8, 2, 64, 4, torch.float32)
    k, v = _pool_gather(batch, 0)
    q = batch["q"]
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.125, enable_gqa=True
    ).transpose(0, 1)  # [H, T, D] -> [T, H, D]
    assert_close(extend_attention_ref(**batch, scale=0.125), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("q_lens, prefixes", [([7, 12], [16, 5]), ([1, 7, 1, 1, 12], [20, 16, 3, 40, 5])],
                         ids=["prefills", "decode_rows_batched"])  # fmt: skip
def test_ref_matches_sdpa_with_prefix(window: int, q_lens: list[int], prefixes: list[int]) -> None:
    # Full causal attention over prefix + new tokens; the new tokens are its last rows. The second case has
    # several one-token requests (a mixed step's decoding rows), which the eager reference batches together.
    batch = make_batch(q_lens, prefixes, 4, 2, 32, 8, torch.float32)
    ref = extend_attention_ref(**batch, scale=0.2, window=window)
    for b, (n, prefix) in enumerate(zip(q_lens, prefixes, strict=True)):
        k, v = _pool_gather(batch, b)
        q_full = torch.cat([torch.randn(prefix, 4, 32), batch["q"][batch["cu_seqlens_q"][b] :][:n]])
        pos = torch.arange(prefix + n)
        mask = pos[None, :] <= pos[:, None]
        if window:
            mask &= pos[None, :] > pos[:, None] - window
        full = F.scaled_dot_product_attention(
            q_full.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.2, enable_gqa=True
        ).transpose(0, 1)  # [H, L, D] -> [L, H, D]
        start = int(batch["cu_seqlens_q"][b])
        assert_close(ref[start : start + n], full[prefix:], atol=1e-5, rtol=1e-5, msg=f"request {b}")


def test_inputs_unchanged() -> None:
    batch = make_batch([6, 9], [4, 0], 4, 2, 64, 16, torch.float16)
    before = {k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    extend_attention(**batch, scale=0.125, window=5)
    for name, t in before.items():
        torch.testing.assert_close(batch[name], t, atol=0, rtol=0, equal_nan=True, msg=f"{name} was modified")


def test_strided_query() -> None:
    # q as a view of a fused qkv projection: token stride larger than H * D.
    batch = make_batch([9, 4], [0, 7], 4, 2, 64, 16, torch.float32)
    fused = torch.randn(batch["q"].shape[0], 8, 64, device=DEVICE)
    fused[:, :4] = batch["q"]
    batch["q"] = fused[:, :4]
    assert not batch["q"].is_contiguous()
    out = extend_attention(**batch, scale=0.125)
    assert_close(out, extend_attention_ref(**batch, scale=0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [extend_attention, extend_attention_ref], ids=["triton", "ref"])
def test_padding_requests_attend_to_nothing(kernel) -> None:
    """A compiled prefill step pads its batch with requests of one token and length 0 (`ModelRunner`): their rows
    come out as zeros, and the real request's rows are those of the batch without them."""
    batch = make_batch([6, 1, 1], [3, -1, -1], 4, 2, 64, 4, torch.float32)  # prefix -1: nothing in the pool
    assert batch["seq_lens"].tolist() == [9, 0, 0]
    real = dict(batch, q=batch["q"][:6], cu_seqlens_q=batch["cu_seqlens_q"][:2], seq_lens=batch["seq_lens"][:1],
                block_table=batch["block_table"][:1])  # fmt: skip
    out = kernel(**batch, scale=0.125)
    assert not out[6:].any() and out[:6].isfinite().all()
    assert_close(out[:6], extend_attention_ref(**real, scale=0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ["extend_attention", "extend_attention_ref"])  # the ref: what compiled CPU steps call
def test_opcheck(op: str) -> None:
    batch = make_batch([5, 3], [2, 0], 4, 2, 64, 4, torch.float32)
    args = tuple(batch[k] for k in ("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_table"))
    torch.library.opcheck(getattr(torch.ops.astrai, op).default, args, dict(page_size=4, scale=0.125, window=3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim_pad", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 7, 16, 256])
def test_autotune_prune_keeps_valid_configs(dtype: torch.dtype, head_dim_pad: int, group: int) -> None:
    # Host-side part of the GPU launch: every kept config holds one token of the group per block.
    from astrai.triton_kernels.extend_attention import _configs, _keep

    kept = _keep(_configs(), {"q_ptr": torch.empty(1, dtype=dtype)}, GROUP=group, HEAD_DIM_PAD=head_dim_pad)
    assert kept and all(c.kwargs["BLOCK_M"] >= group for c in kept)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "head_dim", "window"),
    [(torch.bfloat16, 128, 0), (torch.bfloat16, 256, 0), (torch.float16, 64, 100), (torch.float32, 128, 0)],
    ids=str,
)
def test_gpu_realistic_shapes(dtype: torch.dtype, head_dim: int, window: int) -> None:
    # Compiled kernel with autotuned tiles (each case is a new tuning key): long prefixes, many key tiles, GQA 4.
    batch = make_batch([1, 300, 77, 640], [500, 0, 129, 64], 32, 8, head_dim, 16, dtype)
    kw = dict(scale=head_dim**-0.5, window=window)
    atol, rtol = TOLERANCES[dtype]
    assert_close(extend_attention(**batch, **kw), extend_attention_ref(**batch, **kw), atol=atol, rtol=rtol)


@pytest.mark.gpu
def test_gpu_int64_slot_offsets() -> None:
    # A pool of more than 2**31 elements with the request's pages at its end: slot * stride overflows int32.
    kv_heads, head_dim, page_size = 8, 128, 16
    slots = (2**31 // (kv_heads * head_dim) // page_size + 64) * page_size
    k_cache = torch.randn(slots, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    num_pages = slots // page_size
    block_table = torch.arange(num_pages - 8, num_pages, dtype=torch.int32, device="cuda")[None]  # [1, 8]
    q = torch.randn(50, 16, head_dim, dtype=torch.bfloat16, device="cuda")
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, page_size=page_size, scale=0.08)
    args |= dict(cu_seqlens_q=torch.tensor([0, 50], dtype=torch.int32, device="cuda"))
    args |= dict(seq_lens=torch.tensor([120], dtype=torch.int32, device="cuda"))
    atol, rtol = TOLERANCES[torch.bfloat16]
    assert_close(extend_attention(**args), extend_attention_ref(**args), atol=atol, rtol=rtol)


_AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from astrai.triton_kernels.extend_attention import _extend_attention_kernel as kernel

for dt, window, upcast, precision in [("bf16", True, False, "tf32"), ("fp32", False, True, "ieee")]:
    types = {n: "*" + dt for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    types.update(cu_seqlens_q_ptr="*i32", seq_lens_ptr="*i32", block_table_ptr="*i32", qk_scale="fp32")
    consts = dict(GROUP=4, HEAD_DIM=96, HEAD_DIM_PAD=128, PAGE_SIZE=16, USE_WINDOW=window, UPCAST=upcast,
                  DOT_PRECISION=precision, BLOCK_M=64, BLOCK_N=32)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    for arch in (80, 90):
        triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=4, num_stages=2, enable_fp_fusion=True))
"""


def test_compiles_for_gpu_targets() -> None:
    # the interpreter runs the kernel as Python; this compiles the real JIT function to PTX for sm_80 and sm_90
    # (both window paths and an fp32 upcast variant), so code only a GPU build would reject fails here too
    assert_compiles_for_gpu(_AOT_SCRIPT)

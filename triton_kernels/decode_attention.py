"""Paged split-KV decode attention: one query token per request against its cached keys and values.

Math (per request b, query head h, kv head kh = h // G, query position p = seq_lens[b] - 1):
    out[b, h] = softmax_j(scale * q[b, h] . K[j, kh]) @ V[:, kh]   over positions p - window < j <= p
(`window = 0`: all j <= p). Softmax and accumulation are fp32; the output has q's dtype; a request with
seq_lens[b] == 0 (padding row) gets zeros.

Layouts (docs/kernels.md):
    q:                [B, H, D]  any strides, last dim contiguous
    k_cache, v_cache: [S, K, D]  any strides, last dim contiguous; slot of position j of request b is
                                 block_table[b, j // N] * N + j % N (N = page_size)
    block_table:      [B, P] int32, last dim contiguous; entries past a request's length are never read
    seq_lens:         [B] int32, cached tokens including the current one (seq_lens[b] <= P * N)

Design (flash-decoding as in lightllm's `gqa_flash_decoding` and SGLang's Triton `decode_attention`):
    stage 1, grid (B, K, NUM_SPLITS): the G query heads of one kv head form a [BLOCK_G, D] tile (G padded to
        >= 16 on GPU so both products run on tensor cores), so each K/V tile is loaded once per group. A
        program walks its share of the request's positions in BLOCK_N-aligned blocks, gathers slots through
        the block table (one scalar load per block when a page holds whole blocks), keeps an online softmax
        in base 2, and writes a normalised partial output and its log-sum-exp.
    stage 2, grid (B, H): merges the splits weighted by exp(lse). Skipped when NUM_SPLITS == 1 (stage 1 then
        writes the output directly).
    NUM_SPLITS comes from shapes only (B, K, P * N) and the SM count, so the launcher never syncs. Each
    request cuts its own attended range NUM_SPLITS ways in whole blocks; when it has fewer blocks than splits,
    the surplus programs write an empty partial (lse = -inf) and exit.
Not supported: MLA / split rope dims, quantised caches, more than one query token per request (see
extend_attention), logit soft-capping, attention sinks, ALiBi.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ._common import cdiv, check_last_dim_contiguous, interpreting, next_power_of_2, num_sms, prune_by, upcast
from ._launch import TunedKernel

__all__ = ["decode_attention", "decode_attention_ref", "keep"]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
_MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (q load, partial write, merge) dominates


@triton.jit
def _block_slots(bt_row_ptr, block_start, pos, mask_n, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 pool slots [BLOCK_N] of positions `pos` = block_start + arange(BLOCK_N) of one request."""
    if PAGE_SIZE % BLOCK_N == 0:
        # Blocks are BLOCK_N-aligned, so the whole block sits in one page: one block-table load per block.
        page = tl.load(bt_row_ptr + block_start // PAGE_SIZE).to(tl.int64)
    else:  # one (cached) block-table entry per token; masked tokens read nothing
        page = tl.load(bt_row_ptr + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    return page * PAGE_SIZE + (pos % PAGE_SIZE)


@triton.jit
def _online_softmax_step(q, k, v, mask_n, m_i, l_i, acc, scale_log2e):
    """Fold one [BLOCK_N, D] K/V block into the running (max, sum, acc) of a [BLOCK_G, D] query tile (base 2).

    Dots take the tiles' own dtype (bf16/fp16 tensor cores on GPU) and accumulate in fp32; "ieee" keeps fp32
    inputs exact instead of tf32. Masked keys get -inf scores.
    """
    qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e  # [BLOCK_G, BLOCK_N]
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_new, acc


@triton.jit
def _decode_stage1_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    stride_q_b, stride_q_h, stride_k_s, stride_k_k, stride_v_s, stride_v_k, stride_bt_b,
    stride_out_b, stride_out_h, stride_mid_b, stride_mid_h,
    scale_log2e, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # q [B, H, D] -> tile [BLOCK_G, BLOCK_D] of heads kh*G .. kh*G+G-1; K/V tiles [BLOCK_N, BLOCK_D] gathered
    # from [S, K, D]; mid_o [B, H, NUM_SPLITS, D] fp32 (split stride D), mid_lse [B, H, NUM_SPLITS] fp32 (log2).
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    heads = kh * GROUP + tl.arange(0, BLOCK_G)
    mask_g = tl.arange(0, BLOCK_G) < GROUP
    d = tl.arange(0, BLOCK_D)
    mask_d = d < HEAD_DIM

    seq_len = tl.load(seq_lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # first attended position
    lo_block = (lo // BLOCK_N) * BLOCK_N
    # Split `split` covers whole blocks [start, end) of the attended range [lo_block, seq_len); when the request
    # has fewer blocks than NUM_SPLITS, the trailing splits are empty and only write an empty partial.
    per_split = tl.maximum(tl.cdiv(seq_len - lo_block, NUM_SPLITS), 1)
    split_len = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
    start = lo_block + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q = tl.load(q_ptr + b * stride_q_b + heads[:, None] * stride_q_h + d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row_ptr = block_table_ptr + b * stride_bt_b
    # Every block visited holds at least one attended position (lo - lo_block < BLOCK_N and start < end),
    # so the running max is finite after the first block and exp2 never sees -inf - -inf.
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        mask_n = (pos < end) & (pos >= lo)
        slots = _block_slots(bt_row_ptr, block_start, pos, mask_n, PAGE_SIZE, BLOCK_N)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + slots[:, None] * stride_k_s + kh * stride_k_k + d[None, :],
                    mask=mask_kv, other=0.0)  # fmt: skip
        v = tl.load(v_cache_ptr + slots[:, None] * stride_v_s + kh * stride_v_k + d[None, :],
                    mask=mask_kv, other=0.0)  # fmt: skip
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(q, k, v, mask_n, m_i, l_i, acc, scale_log2e)

    has_keys = l_i > 0.0  # False for empty splits and padding rows
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # [BLOCK_G, BLOCK_D]; zeros where has_keys is False
    mask_o = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + b * stride_out_b + heads[:, None] * stride_out_h + d[None, :]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_o)
    else:
        mid = b * stride_mid_b + heads * stride_mid_h + split * HEAD_DIM  # [BLOCK_G]
        tl.store(mid_o_ptr + mid[:, None] + d[None, :], o, mask=mask_o)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        # mid_lse is mid_o without the D axis (both allocated contiguous), so its offset is mid // HEAD_DIM.
        tl.store(mid_lse_ptr + mid // HEAD_DIM, lse, mask=mask_g)


@triton.jit
def _decode_stage2_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_mid_b, stride_mid_h, stride_out_b, stride_out_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # mid_o [B, H, NUM_SPLITS, D] + mid_lse [B, H, NUM_SPLITS] (log2) -> out [B, H, D]; grid (B, H).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mask_s = s < NUM_SPLITS
    base = b * stride_mid_b + h * stride_mid_h
    lse = tl.load(mid_lse_ptr + base // HEAD_DIM + s, mask=mask_s, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0; all empty -> all 0
    o = tl.load(mid_o_ptr + base + s[:, None] * HEAD_DIM + d[None, :],
                mask=mask_s[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b * stride_out_b + h * stride_out_h + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def keep(conf: triton.Config, block_d: int) -> bool:
    """Autotune prune: whether a stage-1 config is worth timing for a head-dim tile of `block_d`.

    Keeps each [BLOCK_N, BLOCK_D] K/V tile within ~8K elements (register pressure with two tiles in flight)
    and gives 8 warps only to blocks of 64+ tokens, where they have work to share.
    """
    block_n = conf.kwargs["BLOCK_N"]
    return block_n * block_d <= 8192 and (conf.num_warps <= 4 or block_n >= 64)


_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bn in (16, 32, 64, 128)
    for w in (4, 8)
    for s in (2, 3)
]
# Tuned once per (head dim, group tile, page size, dtypes); the split count only changes the work per program.
_decode_stage1_tuned = TunedKernel(
    triton.autotune(
        configs=_CONFIGS,
        key=["BLOCK_D", "BLOCK_G", "PAGE_SIZE"],
        prune_configs_by={"early_config_prune": prune_by(keep, "BLOCK_D")},
    )(_decode_stage1_kernel)
)


def _gather_pages(cache: Tensor, block_table: Tensor, seq_lens: Tensor, page_size: int) -> Tensor:
    """Each request's pool rows in position order: cache [S, K, D] -> [B, P*N, K, D] (P = block_table width).

    Rows at positions past a request's length are zeroed, so stale or non-finite content of pages it does not own
    can never leak through a 0 attention weight (0 * NaN = NaN). Out-of-range table entries are clamped.
    """
    num_pages = cache.shape[0] // page_size
    pages = block_table.long().clamp(0, num_pages - 1)  # [B, P]
    # index_select, not advanced indexing: the latter is orders of magnitude slower for this gather on CPU
    paged = cache[: num_pages * page_size].view(num_pages, page_size, *cache.shape[1:])  # [P_all, N, K, D]
    out = paged.index_select(0, pages.flatten()).view(*pages.shape, *paged.shape[1:]).flatten(1, 2)
    owned = torch.arange(out.shape[1], device=cache.device)[None, :] < seq_lens.long()[:, None]  # [B, P*N]
    return out.masked_fill(~owned[:, :, None, None], 0)


def _key_mask(q_pos: Tensor, k_pos: Tensor, seq_lens: Tensor, window: int) -> Tensor:
    """q_pos [B, Tq], k_pos [S], seq_lens [B] -> [B, Tq, S] bool: causal, inside the length and the window."""
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    if window > 0:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
    return mask


def _masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """fp32 SDPA: q [B, H, Tq, D], k/v [B, K, S, D], mask [B, 1, Tq, S] -> [B, H, Tq, D] fp32.

    Rows with no key left (padding) come out as zeros, not NaN.
    """
    gqa = True if q.shape[1] != k.shape[1] else False  # a Python bool even when head counts are symbolic  # noqa: SIM210
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def decode_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor, *, page_size: int,
    scale: float, window: int = 0,
) -> Tensor:  # fmt: skip
    """Plain-torch fp32 specification of `decode_attention`, and the CPU path of `astrai.ops.attention`.

    Gathers every request's whole page list into a padded [B, P*N] view and runs masked SDPA: shapes depend only
    on tensor shapes, never on values, so it traces under `torch.compile` without host syncs. Same arguments and
    result as `decode_attention` (q's dtype; zeros for rows with seq_lens == 0); no layout requirements.
    """
    k = _gather_pages(k_cache, block_table, seq_lens, page_size)  # [B, S, K, D]
    v = _gather_pages(v_cache, block_table, seq_lens, page_size)
    lens = seq_lens.long()
    mask = _key_mask((lens - 1)[:, None], torch.arange(k.shape[1], device=q.device), lens, window)  # [B, 1, S]
    out = _masked_sdpa(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), mask[:, None], scale)  # [B, H, 1, D]
    return out[:, :, 0, :].to(q.dtype)


def _num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits per (request, kv head): enough programs for ~4 per SM, each split >= 256 of the max tokens."""
    want = cdiv(4 * num_sms(device), max(batch * num_kv_heads, 1))
    cap = max(1, max_len // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(next_power_of_2(want), _MAX_SPLITS, 1 << (cap.bit_length() - 1)))


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor) -> None:
    assert q.dim() == 3 and k_cache.dim() == 3 and k_cache.shape == v_cache.shape, "q [B,H,D], caches [S,K,D]"
    assert q.shape[2] == k_cache.shape[2] and q.shape[1] % k_cache.shape[1] == 0, f"{q.shape} vs {k_cache.shape}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share a dtype"
    assert block_table.dtype == seq_lens.dtype == torch.int32, "block_table and seq_lens are int32"
    assert block_table.dim() == 2 and seq_lens.shape == (q.shape[0],) == block_table.shape[:1]
    assert seq_lens.is_contiguous()
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table)


def _decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor, page_size: int, scale: float,
    window: int, num_splits: int,
) -> Tensor:  # fmt: skip
    """Launch both stages with an explicit split count (tests use it to force multi-split merges)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [B, H, D]
    if batch == 0:
        return out
    interp = interpreting()
    block_d = max(16, next_power_of_2(head_dim))
    # tl.dot needs M >= 16 on tensor cores; the interpreter has no minimum and pays for every padded row.
    block_g = next_power_of_2(group) if interp else max(16, next_power_of_2(group))
    # Partials are only read when there is more than one split; the 1-split kernel writes `out` directly.
    mid_shape = (batch, num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    mid_o = torch.empty((*mid_shape, head_dim), device=q.device, dtype=torch.float32)  # [B, H, NS, D]
    mid_lse = torch.empty(mid_shape, device=q.device, dtype=torch.float32)  # [B, H, NS]
    args = (q, k_cache, v_cache, block_table, seq_lens, out, mid_o, mid_lse,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            block_table.stride(0), out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1),
            scale * _LOG2E, window)  # fmt: skip
    # enable_fp_fusion is Triton's default, passed explicitly so Triton 3.9 does not warn that it is unset.
    meta = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_D=block_d, PAGE_SIZE=page_size,
                NUM_SPLITS=num_splits, UPCAST=upcast(), enable_fp_fusion=True)  # fmt: skip
    grid = (batch, num_kv_heads, num_splits)
    if interp:  # autotuning is meaningless under the interpreter (configs are stripped)
        _decode_stage1_kernel[grid](*args, **meta, BLOCK_N=16)
    else:
        _decode_stage1_tuned.launch(grid, args, meta)
    if num_splits > 1:
        _merge_splits(mid_o, mid_lse, out, head_dim=head_dim, block_d=block_d)
    return out


def _merge_splits(mid_o: Tensor, mid_lse: Tensor, out: Tensor, *, head_dim: int, block_d: int) -> None:
    """Stage 2 of split-KV decode: combine the per-split partial outputs by their log-sum-exp into `out`."""
    batch, num_heads, num_splits = mid_o.shape[0], mid_o.shape[1], mid_o.shape[2]
    _decode_stage2_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        BLOCK_S=next_power_of_2(num_splits), num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip


@torch.library.custom_op("astrai::decode_attention", mutates_args=())
def decode_attention(
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
    """Paged split-KV decode attention (Triton; CUDA, or CPU under the interpreter). Never syncs the host.

    Args:
        q: [B, H, D] query of each request's newest token (last dim contiguous).
        k_cache: [S, K, D] key pool (last dim contiguous), H % K == 0.
        v_cache: [S, K, D] value pool.
        block_table: [B, P] int32 page ids of each request, in order.
        seq_lens: [B] int32 cached tokens per request including the current one, at most P * page_size.
        page_size: N, slots per page.
        scale: softmax scale.
        window: sliding window in tokens (keys p - window < j <= p), 0 for none.

    Returns:
        [B, H, D] contiguous output in q's dtype; zeros for rows with seq_lens == 0.

    The first call per (head dim, group, page size, dtype) on a GPU autotunes stage 1 (several launches):
    warm up before capturing a CUDA graph.
    """
    _check(q, k_cache, v_cache, block_table, seq_lens)
    num_splits = _num_splits(q.shape[0], k_cache.shape[1], block_table.shape[1] * page_size, q.device)
    return _decode_attention(q, k_cache, v_cache, block_table, seq_lens, page_size, scale, window, num_splits)


@decode_attention.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, *, page_size, scale, window=0) -> Tensor:
    _check(q, k_cache, v_cache, block_table, seq_lens)
    return torch.empty_like(q, memory_format=torch.contiguous_format)

"""Ragged paged extend attention (prefill, prefix-cache hits, chunked prefill) as one Triton kernel.

Math: for request b with `n` new tokens and `seq_lens[b] = prefix + n` tokens in the pool, the i-th new token
sits at position `p = prefix + i` and computes `softmax(scale * q_p . K^T + mask) V` over the keys at positions
`kp` with `kp <= p` (full over the cached prefix, causal among the new tokens) and, when `window > 0`,
`kp > p - window`. K/V of every position (prefix and new) are read from the paged pool through
`block_table` (slot = `block_table[b, kp // N] * N + kp % N`, see docs/kernels.md).

Kernel design (FlashAttention-2, arXiv 2307.08691; grid after vLLM's `triton_unified_attention.py`):
- Grid `(T // BLOCK_Q + B, K)`, sized from shapes only (no host sync, CUDA-graph capturable). Query block `j`
  belongs to the request `b` with the largest `cu_seqlens_q[b] // BLOCK_Q + b <= j` (binary search over
  `cu_seqlens_q`); blocks past a request's last token exit at once. `sum_b ceil(n_b / BLOCK_Q)` never exceeds
  the bound, so every token is covered exactly once. Program ids run in reverse so the blocks with the most
  keys (a request's last) start first.
- GQA packing: one program owns one kv head and `BLOCK_Q = BLOCK_M // G` consecutive tokens times the G query
  heads that share it (row `r` = token `r // G`, head `r % G`). Each K/V tile is loaded once for G heads
  instead of G times (G-fold less pool traffic than one program per query head), and a request with a single
  new token still fills G rows of the tile. Rows past `BLOCK_Q * G` (G not a power of two) are masked.
- Key tiles of `BLOCK_N` positions in three ranges, so only tiles on the diagonal or on the window edge pay
  for masks: window-edge tiles (masked), tiles every row of the block sees entirely (unmasked, unmasked loads),
  diagonal tiles up to the block's last position (masked). Tiles past the causal bound or below the window
  are never visited.
- Online softmax in base 2 (`exp2`, `scale * log2(e)`), fp32 statistics and accumulator; bf16/fp16 `tl.dot`
  operands on GPU, IEEE fp32 dots for fp32 inputs. `UPCAST` (interpreter) casts tiles to fp32 (fact F6).
- Masked tiles guard rows that see none of their keys (`m = -inf`: window edges, padding rows) against NaN;
  padding rows are never stored.
- Address arithmetic on slots and token rows is int64.

Not supported: split-KV for very long prefixes with few new tokens (one program walks the whole prefix),
ALiBi, soft-capping, sinks, FP8 KV. Rows of `q` outside `cu_seqlens_q[0] : cu_seqlens_q[B]` come out as zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ._common import autotune_configs, cdiv, check_last_dim_contiguous, interpreting, next_power_of_2, upcast
from ._launch import TunedKernel
from .decode_attention import _gather_pages, _key_mask, _masked_sdpa, decode_attention_ref

__all__ = ["extend_attention", "extend_attention_ref"]


@triton.jit
def _find_request(cu_seqlens_q_ptr, block_idx, num_requests, BLOCK_Q: tl.constexpr):
    # Largest b with cu_seqlens_q[b] // BLOCK_Q + b <= block_idx: the first query block of request b.
    lo: tl.int32 = 0
    hi = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_rows(ptrs, row_mask, MASK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    # [R, HEAD_DIM_PAD] tile; the head-dim mask only exists for padded dims so full dims keep vector loads.
    if HEAD_DIM == HEAD_DIM_PAD:
        if MASK_ROWS:
            tile = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            tile = tl.load(ptrs)
    else:
        d_mask = tl.arange(0, HEAD_DIM_PAD) < HEAD_DIM
        if MASK_ROWS:
            tile = tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    return tile


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q,
    k_cache_ptr, v_cache_ptr, bt_row_ptr,
    kv_head, stride_kc_s, stride_kc_k, stride_vc_s, stride_vc_k,
    row_pos, start, end, kv_end, window, qk_scale,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # Online-softmax update of (acc, l_i, m_i) with the key tiles starting at start, start + BLOCK_N, ... < end.
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    for n0 in range(start, end, BLOCK_N):
        kpos = n0 + offs_n  # [BLOCK_N] key positions
        kv_valid = kpos < kv_end
        if MASKED:
            page = tl.load(bt_row_ptr + kpos // PAGE_SIZE, mask=kv_valid, other=0)
        else:
            page = tl.load(bt_row_ptr + kpos // PAGE_SIZE)
        slot = page.to(tl.int64) * PAGE_SIZE + kpos % PAGE_SIZE
        k_ptrs = k_cache_ptr + slot[:, None] * stride_kc_s + kv_head * stride_kc_k + offs_d[None, :]
        k = _load_rows(k_ptrs, kv_valid, MASKED, HEAD_DIM, HEAD_DIM_PAD)  # [BLOCK_N, D]
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = kpos[None, :] <= row_pos[:, None]
            if USE_WINDOW:
                visible = visible & (kpos[None, :] > row_pos[:, None] - window)
            s = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row may see no key of the tile (window edge, padding row): subtract 0, not -inf, to avoid NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_sub[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_new
            p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v_ptrs = v_cache_ptr + slot[:, None] * stride_vc_s + kv_head * stride_vc_k + offs_d[None, :]
        v = _load_rows(v_ptrs, kv_valid, MASKED, HEAD_DIM, HEAD_DIM_PAD)  # [BLOCK_N, D]
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale, window, num_requests,
    stride_q_t, stride_q_h, stride_kc_s, stride_kc_k, stride_vc_s, stride_vc_k,
    stride_o_t, stride_o_h, stride_bt_b,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # q/out: [T, H, D] (last dim contiguous); k_cache/v_cache: [S, K, D]; block_table: [B, P] int32;
    # cu_seqlens_q: [B+1] int32; seq_lens: [B] int32. Program (j, kh): query block j, kv head kh.
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    # Reversed launch order: a request's last blocks see the most keys, so they start first and the tail of the
    # grid is short blocks (and the spare programs, which exit at once).
    block_idx = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    b = _find_request(cu_seqlens_q_ptr, block_idx, num_requests, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    q0 = ((block_idx - (q_start // BLOCK_Q + b)) * BLOCK_Q).to(tl.int32)  # first new-token index of the block
    if q0 >= q_len:
        return
    prefix = tl.load(seq_lens_ptr + b) - q_len
    q_last = tl.minimum(q0 + BLOCK_Q, q_len) - 1

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_tok = q0 + offs_m // GROUP  # [BLOCK_M] new-token index of each row
    row_head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row
    row_valid = (offs_m < BLOCK_Q * GROUP) & (row_tok < q_len)
    row_pos = prefix + row_tok  # [BLOCK_M] absolute position of each row
    row_t = (q_start + row_tok).to(tl.int64)
    q_ptrs = q_ptr + row_t[:, None] * stride_q_t + row_head[:, None] * stride_q_h + offs_d[None, :]
    q = _load_rows(q_ptrs, row_valid, True, HEAD_DIM, HEAD_DIM_PAD)  # [BLOCK_M, D]
    if UPCAST:
        q = q.to(tl.float32)

    # Key ranges: [lo, min(full_lo, kv_end)) window edge (masked), [full_lo, full_hi) seen whole by every row
    # (unmasked), [full_hi, kv_end) diagonal (masked); kv_end = the block's last position + 1 <= seq_len.
    p_min = prefix + q0
    kv_end = prefix + q_last + 1
    lo = 0
    full_lo = 0
    if USE_WINDOW:
        lo = tl.maximum(p_min - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N
    full_hi = tl.maximum((p_min + 1) // BLOCK_N * BLOCK_N, full_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row_ptr = block_table_ptr + b.to(tl.int64) * stride_bt_b
    for phase in tl.static_range(3):  # the three key ranges in order, unrolled at compile time
        if phase == 0:
            start, end = lo, tl.minimum(full_lo, kv_end)
        elif phase == 1:
            start, end = full_lo, full_hi
        else:
            start, end = full_hi, kv_end
        if phase != 0 or USE_WINDOW:  # the window-edge range exists only with a window
            acc, l_i, m_i = _attend_tiles(
                acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head,
                stride_kc_s, stride_kc_k, stride_vc_s, stride_vc_k,
                row_pos, start, end, kv_end, window, qk_scale,
                phase != 1, USE_WINDOW, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, UPCAST, DOT_PRECISION,
            )  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + row_t[:, None] * stride_o_t + row_head[:, None] * stride_o_h + offs_d[None, :]
    o_mask = row_valid[:, None]
    if HEAD_DIM != HEAD_DIM_PAD:  # a head-dim mask only where needed: full dims keep vector stores
        o_mask = o_mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


def extend_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor, block_table: Tensor, *,
    page_size: int, scale: float, window: int = 0,
) -> Tensor:  # fmt: skip
    """Plain-torch fp32 specification of `extend_attention`, and the CPU path of `astrai.ops.attention`.

    Same arguments and result as `extend_attention` (q's dtype; rows owned by no request are zeros), no layout
    requirements. It loops over requests, reading their lengths on the host: no wasted FLOPs, and a fresh prompt
    takes SDPA's causal fast path. Under `torch.compile` it is the opaque op `astrai::extend_attention_ref`, so a
    compiled prefill step keeps this loop (tracing it would need the lengths as values; a shape-only version
    attends over every request's keys, B times the FLOPs).
    """
    if torch.compiler.is_compiling():
        return _extend_ref_op(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, page_size=page_size,
                              scale=scale, window=window)  # fmt: skip
    return extend_per_request(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, page_size, scale, window)


@torch.library.custom_op("astrai::extend_attention_ref", mutates_args=())
def _extend_ref_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor, block_table: Tensor, *,
    page_size: int, scale: float, window: int = 0,
) -> Tensor:  # fmt: skip
    """`extend_attention_ref` as an op that compiled graphs call without tracing into it."""
    return extend_per_request(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, page_size, scale, window)


@_extend_ref_op.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *, page_size, scale, window=0):
    return q.new_empty(q.shape)


def extend_per_request(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor, block_table: Tensor,
    page_size: int, scale: float, window: int, decode_rows: Callable[..., Tensor] = decode_attention_ref,
) -> Tensor:  # fmt: skip
    """The eager branch of `extend_attention_ref`: one SDPA per request over its own keys only, except that the
    one-token requests (the decoding rows of a mixed step) go through one batched call of `decode_rows` (the
    arguments of `decode_attention_ref`, which is the default; `astrai.ops.attention` passes the CPU kernel):
    a per-request loop costs ~15 small ops per request and layer, which dominated CPU mixed steps (64 decoding
    rows + a 16-token prompt: 640 ms, 400,000 aten ops)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # rows owned by no request stay zero
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    single = [b for b, length in enumerate(lens) if cu[b + 1] - cu[b] == 1 and length > 0]
    if len(single) > 1:
        idx = torch.tensor(single, device=q.device)
        rows = cu_seqlens_q[idx].long()
        width = cdiv(max(lens[b] for b in single), page_size)
        one = decode_rows(q[rows], k_cache, v_cache, block_table[idx, :width], seq_lens[idx], page_size=page_size,
                          scale=scale, window=window)  # fmt: skip
        out[rows] = one.float()
    batched = set(single) if len(single) > 1 else set()
    for b, length in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end == start or length == 0 or b in batched:  # length 0: a padding request, attends to nothing
            continue
        pages = block_table[b : b + 1, : cdiv(length, page_size)]  # [1, P_b]: only the pages it uses
        lens_b = seq_lens[b : b + 1]
        k = _gather_pages(k_cache, pages, lens_b, page_size)[:, :length].transpose(1, 2)  # [1, K, L, D]
        v = _gather_pages(v_cache, pages, lens_b, page_size)[:, :length].transpose(1, 2)
        qb = q[start:end].transpose(0, 1)[None]  # [1, H, n, D]
        prefix = length - (end - start)
        if prefix == 0 and window <= 0:
            o = F.scaled_dot_product_attention(qb.float(), k.float(), v.float(), is_causal=True, scale=scale,
                                               enable_gqa=qb.shape[1] != k.shape[1])  # fmt: skip
        else:
            q_pos = torch.arange(prefix, length, device=q.device)[None, :]  # [1, n]
            mask = _key_mask(q_pos, torch.arange(length, device=q.device), lens_b.long(), window)  # [1, n, L]
            o = _masked_sdpa(qb, k, v, mask[:, None], scale)  # [1, H, n, D]
        out[start:end] = o[0].transpose(0, 1)
    return out.to(q.dtype)


def _configs() -> list[triton.Config]:
    # (BLOCK_M, BLOCK_N, warps, stages): FA2-style shapes for Hopper/Ampere, kept short so first-call tuning is quick.
    shapes = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 4), (128, 64, 8, 4)]
    shapes += [(64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 4)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _keep(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop configs with fewer rows than the GQA group or whose tiles overflow shared memory (~200 KiB)."""
    args = {**named_args, **kwargs}
    group, dim = args["GROUP"], args["HEAD_DIM_PAD"]
    elem = args["q_ptr"].element_size()

    def smem(c: triton.Config) -> int:
        # Q tile once, a K and a V tile per pipeline stage.
        return (c.kwargs["BLOCK_M"] * dim + 2 * c.num_stages * c.kwargs["BLOCK_N"] * dim) * elem

    fits = [c for c in configs if c.kwargs["BLOCK_M"] >= group]
    kept = [c for c in fits if smem(c) <= 200 * 1024]
    if kept:
        return autotune_configs(kept)
    # Huge groups or head dims: the smallest tiles that still hold one token of the group.
    rows = max(64, next_power_of_2(group))
    return [triton.Config({"BLOCK_M": rows, "BLOCK_N": 32}, num_warps=4, num_stages=2)]


_extend_attention_tuned = TunedKernel(
    triton.autotune(
        configs=_configs(),
        key=["GROUP", "HEAD_DIM_PAD", "PAGE_SIZE", "USE_WINDOW"],
        prune_configs_by={"early_config_prune": _keep},
    )(_extend_attention_kernel)
)


def _interpreter_block_m(group: int) -> int:
    # About 8 tokens per block under the interpreter: several blocks per request even for short test sequences.
    return max(16, next_power_of_2(8 * group))


@torch.library.custom_op("astrai::extend_attention", mutates_args=())
def extend_attention(
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
    """Causal attention of ragged new tokens over the paged KV pool (prefill, prefix hits, chunked prefill).

    Args:
        q: [T, H, D] queries (last dim contiguous), request b owning rows `cu_seqlens_q[b] : cu_seqlens_q[b+1]`.
        k_cache, v_cache: [S, K, D] pool (last dim contiguous, q's dtype); every position of every request,
            prefix and new tokens alike, must already be stored.
        cu_seqlens_q: [B+1] int32 query offsets (qo_indptr).
        seq_lens: [B] int32 prefix + new tokens per request.
        block_table: [B, P] int32 pages of each request (last dim contiguous).
        page_size: N tokens per page.
        scale: softmax scale.
        window: sliding window in tokens (0: none).

    Returns:
        [T, H, D] in q's dtype, contiguous; rows owned by no request are zeros.
    """
    _check_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, page_size)
    num_tokens, num_heads, head_dim = q.shape
    num_requests, num_kv_heads = seq_lens.shape[0], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_requests == 0:
        return out
    args = (q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, scale * math.log2(math.e))
    args += (window, num_requests, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1))
    args += (v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), block_table.stride(0))
    consts = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        PAGE_SIZE=page_size,
        USE_WINDOW=window > 0,
        UPCAST=upcast(),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )

    def grid(meta: dict) -> tuple[int, int]:
        # Query blocks of all requests fit in T // BLOCK_Q + B (each request wastes at most one partial block).
        return (num_tokens // (meta["BLOCK_M"] // group) + num_requests, num_kv_heads)

    if interpreting():
        meta = dict(BLOCK_M=_interpreter_block_m(group), BLOCK_N=16)
        _extend_attention_kernel[grid(meta)](*args, **consts, **meta)
    else:
        # Explicit FMA fusion: triton 3.9 warns when it is left to the default (fatal under filterwarnings=error).
        _extend_attention_tuned.launch(grid, args, {**consts, "enable_fp_fusion": True})
    return out


@extend_attention.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *, page_size, scale, window=0):
    return q.new_empty(q.shape)


def _check_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                block_table: Tensor, page_size: int) -> None:  # fmt: skip
    assert q.dim() == 3 and k_cache.dim() == 3 and k_cache.shape == v_cache.shape, "q [T,H,D], caches [S,K,D]"
    assert q.shape[2] == k_cache.shape[2], f"head dims differ: q {q.shape}, cache {k_cache.shape}"
    assert q.shape[1] % k_cache.shape[1] == 0, f"H={q.shape[1]} not a multiple of K={k_cache.shape[1]}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
    for name, t in dict(cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_table=block_table).items():
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    b = seq_lens.shape[0]
    assert cu_seqlens_q.shape == (b + 1,) and block_table.dim() == 2 and block_table.shape[0] == b
    assert page_size >= 1, f"page_size must be positive, got {page_size}"
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table)
    check_last_dim_contiguous(cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)

"""Paged split-KV decode for Multi-head Latent Attention (MLA, DeepSeek-V2/V3) over the latent pool.

Math (per request b, query head h, query position p = seq_lens[b] - 1; R = kv_lora_rank, Dr = rope dims):
    score[j] = scale * (q[b, h, :R] . cache[j, :R] + q[b, h, R:] . cache[j, R:])     for 0 <= j <= p
    out[b, h] = softmax_j(score) @ cache[:, :R]
q holds the absorbed query [W_UK^T q_nope ; rope(q_pe)] and each pool row the normalised latent c_kv and the
rotated shared rope key k_pe (see astrai/nn/mla.py): MQA with key width R + Dr and value width R, the value
being the first R dims of the key. The output stays in latent space (the caller applies W_UV). Softmax and
accumulation are fp32; the output has q's dtype; a request with seq_lens[b] == 0 (padding row) gets zeros.

Layouts (docs/mla.md):
    q:           [B, H, R + Dr]  any strides, last dim contiguous
    cache:       [S, R + Dr]     any row stride, last dim contiguous; slot of position j of request b is
                                 block_table[b, j // N] * N + j % N (N = page_size)
    block_table: [B, P] int32, last dim contiguous; entries past a request's length are never read
    seq_lens:    [B] int32, cached tokens including the current one (seq_lens[b] <= P * N)

Design (as SGLang's Triton `decode_attention` grouped MLA path and FlashMLA): stage 1, grid
(B, cdiv(H, BLOCK_H), NUM_SPLITS): a program holds a [BLOCK_H, R] + [BLOCK_H, Dr] query tile (BLOCK_H >= 16 on
GPU, so all three products run on tensor cores); every latent row it loads serves all BLOCK_H heads, which is
what makes MLA decode compute- rather than bandwidth-bound at large H. Blocks of BLOCK_N positions are gathered
through the block table with an online base-2 softmax; each split writes a normalised partial and its
log-sum-exp. Stage 2 is decode_attention's merge kernel (the partial layout is the same with D = R). The split
count comes from shapes only (`decode_attention._num_splits`), so the launcher never syncs.
Not supported: sliding windows, more than one query token per request (astrai.ops.mla runs extend in torch),
quantised (fp8) latents, a separate value pool, tensor-parallel head sharding beyond passing fewer heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import cdiv, check_last_dim_contiguous, interpreting, next_power_of_2, prune_by, upcast
from ._launch import TunedKernel
from .decode_attention import _block_slots, _merge_splits, _num_splits, decode_attention_ref

__all__ = ["keep", "mla_decode", "mla_decode_ref"]

_LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_stage1_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    stride_q_b, stride_q_h, stride_c_s, stride_bt_b, stride_out_b, stride_out_h, stride_mid_b, stride_mid_h,
    scale_log2e,
    NUM_HEADS: tl.constexpr, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_PE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # q [B, H, R + Dr] -> tiles q_lat [BLOCK_H, BLOCK_R] and q_pe [BLOCK_H, BLOCK_PE]; pool rows [R + Dr] gathered
    # as c [BLOCK_N, BLOCK_R] and k_pe [BLOCK_N, BLOCK_PE]; out [B, H, R]; mid_o [B, H, NUM_SPLITS, R] fp32,
    # mid_lse [B, H, NUM_SPLITS] fp32 (log2).
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    mask_h = heads < NUM_HEADS
    r = tl.arange(0, BLOCK_R)
    mask_r = r < KV_LORA_RANK
    e = tl.arange(0, BLOCK_PE)
    mask_e = e < ROPE_DIM

    seq_len = tl.load(seq_lens_ptr + b)
    # Split `split` covers whole blocks [start, end) of [0, seq_len); surplus splits are empty (see decode_attention).
    per_split = tl.maximum(tl.cdiv(seq_len, NUM_SPLITS), 1)
    split_len = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q_row = q_ptr + b * stride_q_b + heads[:, None] * stride_q_h
    q_lat = tl.load(q_row + r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    q_pe = tl.load(q_row + KV_LORA_RANK + e[None, :], mask=mask_h[:, None] & mask_e[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    bt_row_ptr = block_table_ptr + b * stride_bt_b
    # Every visited block holds at least one position < end, so the running max is finite after the first one.
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        slots = _block_slots(bt_row_ptr, block_start, pos, mask_n, PAGE_SIZE, BLOCK_N)
        row = cache_ptr + slots[:, None] * stride_c_s
        c = tl.load(row + r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        k_pe = tl.load(row + KV_LORA_RANK + e[None, :], mask=mask_n[:, None] & mask_e[None, :], other=0.0)
        if UPCAST:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        qk = tl.dot(q_lat, tl.trans(c), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
        qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk, input_precision="ieee") * scale_log2e
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
        m_i = m_new

    has_keys = l_i > 0.0  # False for empty splits and padding rows
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # [BLOCK_H, BLOCK_R]
    mask_o = mask_h[:, None] & mask_r[None, :]
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + b * stride_out_b + heads[:, None] * stride_out_h + r[None, :]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_o)
    else:
        mid = b * stride_mid_b + heads * stride_mid_h + split * KV_LORA_RANK  # [BLOCK_H]
        tl.store(mid_o_ptr + mid[:, None] + r[None, :], o, mask=mask_o)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + mid // KV_LORA_RANK, lse, mask=mask_h)  # mid_lse is mid_o without the R axis


def keep(conf: triton.Config, block_r: int) -> bool:
    """Autotune prune: keep a [BLOCK_N, BLOCK_R] latent tile within 16K elements; 8 warps only for 32+ rows."""
    block_n = conf.kwargs["BLOCK_N"]
    return block_n * block_r <= 16384 and (conf.num_warps <= 4 or block_n >= 32)


_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s) for bn in (16, 32, 64) for w in (4, 8) for s in (1, 2)
]
_mla_stage1_tuned = TunedKernel(
    triton.autotune(
        configs=_CONFIGS,
        key=["BLOCK_R", "BLOCK_PE", "BLOCK_H", "PAGE_SIZE"],
        prune_configs_by={"early_config_prune": prune_by(keep, "BLOCK_R")},
    )(_mla_decode_stage1_kernel)
)


def mla_decode_ref(
    q: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, *, kv_lora_rank: int, page_size: int, scale: float
) -> Tensor:
    """Plain-torch fp32 specification of `mla_decode`, and the CPU path of `astrai.ops.mla` (same arguments).

    MQA over the pool: one shared head whose key is the whole row [c_kv ; k_pe] and whose value is the same row,
    run by `decode_attention_ref`; the Dr extra output dims (~11% for DeepSeek-V3) are computed and dropped.

    Returns:
        [B, H, R] in q's dtype; zeros for rows with seq_lens == 0.
    """
    kv = cache[:, None, :]  # [S, 1, R + Dr]
    out = decode_attention_ref(q, kv, kv, block_table, seq_lens, page_size=page_size, scale=scale)  # [B, H, R + Dr]
    return out[..., :kv_lora_rank]


def _check(q: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, kv_lora_rank: int) -> None:
    assert q.dim() == 3 and cache.dim() == 2 and q.shape[2] == cache.shape[1], f"q {q.shape} vs cache {cache.shape}"
    assert 0 < kv_lora_rank < q.shape[2], f"kv_lora_rank {kv_lora_rank} must leave rope dims in {q.shape[2]}"
    assert q.dtype == cache.dtype, "q and the cache must share a dtype"
    assert block_table.dtype == seq_lens.dtype == torch.int32, "block_table and seq_lens are int32"
    assert block_table.dim() == 2 and seq_lens.shape == (q.shape[0],) == block_table.shape[:1]
    assert seq_lens.is_contiguous()
    check_last_dim_contiguous(q=q, cache=cache, block_table=block_table)


def _mla_decode(
    q: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, kv_lora_rank: int, page_size: int, scale: float,
    num_splits: int,
) -> Tensor:  # fmt: skip
    """Launch both stages with an explicit split count (tests use it to force multi-split merges)."""
    batch, num_heads, width = q.shape
    out = torch.empty((batch, num_heads, kv_lora_rank), device=q.device, dtype=q.dtype)  # [B, H, R]
    if batch == 0:
        return out
    interp = interpreting()
    block_r = max(16, next_power_of_2(kv_lora_rank))
    block_pe = max(16, next_power_of_2(width - kv_lora_rank))
    # tl.dot needs M >= 16 on tensor cores; the interpreter has no minimum and pays for every padded row.
    block_h = min(16, next_power_of_2(num_heads)) if interp else 16
    mid_shape = (batch, num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    mid_o = torch.empty((*mid_shape, kv_lora_rank), device=q.device, dtype=torch.float32)  # [B, H, NS, R]
    mid_lse = torch.empty(mid_shape, device=q.device, dtype=torch.float32)  # [B, H, NS]
    args = (q, cache, block_table, seq_lens, out, mid_o, mid_lse, q.stride(0), q.stride(1), cache.stride(0),
            block_table.stride(0), out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1),
            scale * _LOG2E)  # fmt: skip
    meta = dict(NUM_HEADS=num_heads, KV_LORA_RANK=kv_lora_rank, ROPE_DIM=width - kv_lora_rank, BLOCK_H=block_h,
                BLOCK_R=block_r, BLOCK_PE=block_pe, PAGE_SIZE=page_size, NUM_SPLITS=num_splits, UPCAST=upcast(),
                enable_fp_fusion=True)  # fmt: skip
    grid = (batch, cdiv(num_heads, block_h), num_splits)
    if interp:  # autotuning is meaningless under the interpreter
        _mla_decode_stage1_kernel[grid](*args, **meta, BLOCK_N=16)
    else:
        _mla_stage1_tuned.launch(grid, args, meta)
    if num_splits > 1:
        _merge_splits(mid_o, mid_lse, out, head_dim=kv_lora_rank, block_d=block_r)
    return out


@torch.library.custom_op("astrai::mla_decode", mutates_args=())
def mla_decode(
    q: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, *, kv_lora_rank: int, page_size: int, scale: float
) -> Tensor:
    """Paged split-KV MLA decode over the latent pool (Triton; CUDA, or CPU under the interpreter). Never syncs.

    Args:
        q: [B, H, R + Dr] absorbed query [q_lat ; q_pe] (last dim contiguous).
        cache: [S, R + Dr] latent pool [c_kv ; k_pe] (last dim contiguous), same dtype as q.
        block_table: [B, P] int32 page ids of each request, in order.
        seq_lens: [B] int32 cached tokens per request including the current one, at most P * page_size.
        kv_lora_rank: R, the latent (value) width.
        page_size: N, slots per page.
        scale: softmax scale.

    Returns:
        [B, H, R] contiguous output in q's dtype; zeros for rows with seq_lens == 0.

    The first call per (R, Dr, page size, dtype) on a GPU autotunes stage 1: warm up before graph capture.
    """
    _check(q, cache, block_table, seq_lens, kv_lora_rank)
    head_blocks = cdiv(q.shape[1], 16)
    num_splits = _num_splits(q.shape[0], head_blocks, block_table.shape[1] * page_size, q.device)
    return _mla_decode(q, cache, block_table, seq_lens, kv_lora_rank, page_size, scale, num_splits)


@mla_decode.register_fake
def _(q, cache, block_table, seq_lens, *, kv_lora_rank, page_size, scale) -> Tensor:
    _check(q, cache, block_table, seq_lens, kv_lora_rank)
    return q.new_empty((q.shape[0], q.shape[1], kv_lora_rank))

"""Batched multi-LoRA update (Punica-style): each token row adds the low-rank update of its own adapter slot.

Layouts (docs/kernels.md, "Batched LoRA (multi-adapter)"; S slots, R max rank, adapters of rank r < R zero-padded):
    x:          [T, in]       any row stride, last dim contiguous
    a:          [S, R, in]    lora_A of the adapter in each slot; last dim contiguous; x's dtype
    b:          [out, S, R]   lora_B of each slot in b[:, s, :]; last dim contiguous; x's dtype
    scaling:    [S] float32   alpha / r of each slot (0 for an empty slot)
    slot_ids:   [T] int64     slot of each row; -1 = no adapter (base rows, padding rows)
    seg_starts: [G + 1] int64 segment form: token offsets, non-decreasing, seg_starts[G] <= T
    seg_slots:  [G] int64     segment form: the slot shared by the tokens of each segment; -1 = no adapter

    delta[t] = scaling[s] * (x[t] @ a[s].T) @ b[:, s, :].T   with s = slot_ids[t]; 0 where s < 0.
Accumulation in fp32, result [T, out] in x's dtype. Rows outside every segment (segment form) are zero.

Two kernels of the same contract:
- `lora_delta`, the gather form (BGMV) for decode rows: grid (T, column splits). A program reads its row's slot,
  shrinks x[t] against a[s] (fp32, over `in` in blocks, R padded to a power of two >= 16 by masking), then loops
  over its columns' blocks of b[:, s, :] for the expand. Rows with slot -1 write zeros without reading a or b.
- `lora_delta_segments`, the segment form (SGMV) for prefill: a prompt's tokens are contiguous and share a slot,
  so a program takes a BLOCK_M tile of one segment and runs the shrink [BLOCK_M, in] x [in, R] and the expand
  [BLOCK_M, R] x [R, BLOCK_N] as `tl.dot`s: the adapter's factors are read once per tile instead of once per row.
  Tiles are numbered on the device (`segment_tiles`: cdiv(T, BLOCK_M) + G tiles, the static worst case, each
  with its segment and first row; spare tiles exit at once), so the grid depends on shapes only.
Both recompute the (small, rank-R) shrink in each column split; the launcher picks few splits, enough to fill the
GPU. Neither syncs with the host, so they trace under `torch.compile` and replay in CUDA graphs (the slot ids are
tensor inputs). On a GPU the segment form rounds the scaled shrink to x's dtype before its 16-bit expand dot.
Not supported: a/b in another dtype than x (the caller casts), quantised factors, backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import cdiv, check_last_dim_contiguous, interpreting, next_power_of_2, num_sms, upcast

__all__ = ["lora_delta", "lora_delta_ref", "lora_delta_segments", "lora_delta_segments_ref", "segment_slot_ids",
           "segment_tiles"]  # fmt: skip


@triton.jit
def _lora_gather_kernel(
    x_ptr, a_ptr, b_ptr, scaling_ptr, slot_ids_ptr, out_ptr,
    in_features, out_features, cols_per_program, stride_x, stride_as, stride_ar, stride_bo, stride_bs, stride_out,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # grid (T, column splits); one program: row t, columns [col0, col0 + cols_per_program) in BLOCK_N blocks.
    t = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1).to(tl.int64) * cols_per_program
    slot = tl.load(slot_ids_ptr + t)
    out_row = out_ptr + t * stride_out
    if slot < 0:
        for n0 in range(0, cols_per_program, BLOCK_N):
            cols = col0 + n0 + tl.arange(0, BLOCK_N)
            tl.store(out_row + cols, tl.zeros([BLOCK_N], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=cols < out_features)  # fmt: skip
        return
    r = tl.arange(0, BLOCK_R)
    mask_r = r < RANK
    a_rows = a_ptr + slot * stride_as + r[:, None] * stride_ar
    h = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < in_features
        xv = tl.load(x_ptr + t * stride_x + ks, mask=mask_k, other=0.0).to(tl.float32)
        av = tl.load(a_rows + ks[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        h += tl.sum(av * xv[None, :], axis=1)
    h = h * tl.load(scaling_ptr + slot)
    b_cols = b_ptr + slot * stride_bs + r[None, :]
    for n0 in range(0, cols_per_program, BLOCK_N):
        cols = col0 + n0 + tl.arange(0, BLOCK_N)
        mask_n = cols < out_features
        bv = tl.load(b_cols + cols[:, None] * stride_bo, mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        y = tl.sum(bv.to(tl.float32) * h[None, :], axis=1)
        tl.store(out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _lora_segment_kernel(
    x_ptr, a_ptr, b_ptr, scaling_ptr, seg_starts_ptr, seg_slots_ptr, tile_seg_ptr, tile_row_ptr, out_ptr,
    num_segments, in_features, out_features, cols_per_program,
    stride_x, stride_as, stride_ar, stride_bo, stride_bs, stride_out,
    RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # grid (tiles, column splits); one program: BLOCK_M rows of one segment x its columns. The output starts
    # zeroed, so spare tiles and segments without an adapter write nothing.
    tile = tl.program_id(0)
    g = tl.load(tile_seg_ptr + tile)
    if g >= num_segments:
        return
    slot = tl.load(seg_slots_ptr + g)
    if slot < 0:
        return
    rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
    mask_m = rows < tl.load(seg_starts_ptr + g + 1)
    col0 = tl.program_id(1).to(tl.int64) * cols_per_program
    r = tl.arange(0, BLOCK_R)
    mask_r = r < RANK
    a_cols = a_ptr + slot * stride_as + r[None, :] * stride_ar  # a[s] read as [in, R]
    h = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < in_features
        xv = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)  # fmt: skip
        av = tl.load(a_cols + ks[:, None], mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        if UPCAST:  # the interpreter: no 16-bit arithmetic, wrong bf16 dots
            xv = xv.to(tl.float32)
            av = av.to(tl.float32)
        h = tl.dot(xv, av, acc=h, input_precision="ieee")
    h = h * tl.load(scaling_ptr + slot)
    if not UPCAST:
        h = h.to(x_ptr.dtype.element_ty)  # 16-bit operands for the expand dot (a no-op for fp32)
    b_rows = b_ptr + slot * stride_bs + r[:, None]  # b[:, s, :] read as [R, out]
    for n0 in range(0, cols_per_program, BLOCK_N):
        cols = col0 + n0 + tl.arange(0, BLOCK_N)
        mask_n = cols < out_features
        bv = tl.load(b_rows + cols[None, :] * stride_bo, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            bv = bv.to(tl.float32)
        y = tl.dot(h, bv, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


def lora_delta_ref(x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, slot_ids: Tensor) -> Tensor:
    """Plain-torch specification of `lora_delta` in gather form (same arguments; see the module for layouts).

    Each row gathers its slot's factors ([T, R, in] and [out, T, R], fp32), so memory grows with T; it is the spec
    for tests. The CPU path of `astrai.ops.lora` is the slot-masked form, two dense products over every slot.
    """
    valid = slot_ids >= 0  # [T]
    s = slot_ids.clamp(min=0)
    h = torch.einsum("ti,tri->tr", x.float(), a.index_select(0, s).float())  # [T, R] shrink
    h = h * scaling.float().index_select(0, s)[:, None]
    y = torch.einsum("tr,otr->to", h, b.index_select(1, s).float())  # [T, out] expand
    return torch.where(valid[:, None], y, 0.0).to(x.dtype)  # exact zeros, whatever slot 0 holds


def segment_slot_ids(seg_starts: Tensor, seg_slots: Tensor, num_tokens: int) -> Tensor:
    """[T] int64 slot of each token from segments (-1 outside every segment); no host sync."""
    num_segments = seg_slots.shape[0]
    t = torch.arange(num_tokens, device=seg_starts.device)
    if num_segments == 0:
        return torch.full_like(t, -1)
    g = torch.searchsorted(seg_starts, t, right=True) - 1  # the last segment starting at or before t
    inside = (g >= 0) & (g < num_segments)  # g == G past seg_starts[G]; empty segments are never the last
    return torch.where(inside, seg_slots.index_select(0, g.clamp(0, num_segments - 1)), -1)


def lora_delta_segments_ref(
    x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, seg_starts: Tensor, seg_slots: Tensor
) -> Tensor:
    """Plain-torch specification of `lora_delta_segments`: `lora_delta_ref` with each token given its segment's
    slot (`segment_slot_ids`)."""
    return lora_delta_ref(x, a, b, scaling, segment_slot_ids(seg_starts, seg_slots, x.shape[0]))


def segment_tiles(seg_starts: Tensor, num_tokens: int, block_m: int) -> tuple[Tensor, Tensor]:
    """The segment kernel's tiles, numbered on the device: each segment's rows cut into BLOCK_M tiles.

    Returns:
        tile_seg: [cdiv(T, block_m) + G] int64 segment of each tile; G for spare tiles past the last one.
        tile_row: same shape, the tile's first row (meaningless for spare tiles).
    """
    num_segments = seg_starts.shape[0] - 1
    lens = (seg_starts[1:] - seg_starts[:-1]).clamp(min=0)
    tiles = (lens + block_m - 1) // block_m  # [G]
    ends = tiles.cumsum(0)
    idx = torch.arange(cdiv(num_tokens, block_m) + num_segments, device=seg_starts.device)
    tile_seg = torch.searchsorted(ends, idx, right=True)  # sum over g of cdiv(len_g, BLOCK_M) <= that count
    g = tile_seg.clamp(max=num_segments - 1)
    tile_row = seg_starts.index_select(0, g) + (idx - ends.index_select(0, g) + tiles.index_select(0, g)) * block_m
    return tile_seg, tile_row


def _check(x: Tensor, a: Tensor, b: Tensor, scaling: Tensor) -> None:
    assert x.dim() == 2 and a.dim() == 3 and b.dim() == 3, f"x {x.shape} a {a.shape} b {b.shape}"
    assert a.shape[2] == x.shape[1] and b.shape[1:] == a.shape[:2], f"x {x.shape} a {a.shape} b {b.shape}"
    assert x.dtype == a.dtype == b.dtype, f"x, a and b must share a dtype: {x.dtype} {a.dtype} {b.dtype}"
    assert scaling.dtype == torch.float32 and scaling.shape == (a.shape[0],), "scaling: [S] float32"
    check_last_dim_contiguous(x=x, a=a, b=b)


def _splits(programs: int, out_features: int, block_n: int, device: torch.device) -> int:
    """Columns per program: all of them under the interpreter, else split until ~2 programs per SM."""
    blocks = cdiv(out_features, block_n)
    splits = 1 if interpreting() else max(1, min(blocks, cdiv(2 * num_sms(device), max(programs, 1))))
    return cdiv(blocks, splits) * block_n


@torch.library.custom_op("astrai::lora_delta", mutates_args=())
def lora_delta(x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, slot_ids: Tensor) -> Tensor:
    """Each row's adapter update, gather form (Triton; CUDA, or CPU under the interpreter): [T, out] in x's dtype.

    Args:
        x: [T, in]; a: [S, R, in]; b: [out, S, R] (x's dtype); scaling: [S] float32;
        slot_ids: [T] int64, -1 for rows without an adapter (their delta is zero).
    """
    _check(x, a, b, scaling)
    assert slot_ids.dtype == torch.int64 and slot_ids.shape == (x.shape[0],), "slot_ids: [T] int64"
    (num_tokens, in_features), (out_features, _, rank) = x.shape, b.shape
    out = torch.empty((num_tokens, out_features), device=x.device, dtype=x.dtype)
    if num_tokens == 0 or out_features == 0:
        return out
    block_r = max(16, next_power_of_2(rank))
    block_k = max(16, min(next_power_of_2(in_features), 4096 // block_r, 128 if interpreting() else 4096))
    block_n = max(16, min(next_power_of_2(out_features), 4096 // block_r, 128 if interpreting() else 4096))
    cols = _splits(num_tokens, out_features, block_n, x.device)
    _lora_gather_kernel[(num_tokens, cdiv(out_features, cols))](
        x, a, b, scaling, slot_ids, out,
        in_features, out_features, cols, x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0),
        RANK=rank, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n,
        num_warps=4, enable_fp_fusion=True,  # explicit so that Triton 3.9 does not warn it is unset
    )  # fmt: skip
    return out


@lora_delta.register_fake
def _(x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, slot_ids: Tensor) -> Tensor:
    _check(x, a, b, scaling)
    return x.new_empty((x.shape[0], b.shape[0]))


@torch.library.custom_op("astrai::lora_delta_segments", mutates_args=())
def lora_delta_segments(
    x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, seg_starts: Tensor, seg_slots: Tensor
) -> Tensor:
    """Each token's adapter update, segment form (Triton; CUDA, or CPU under the interpreter): [T, out] in x's
    dtype. Same as `lora_delta` with each token given its segment's slot; rows outside every segment are zero.

    Args:
        x, a, b, scaling: as `lora_delta`.
        seg_starts: [G + 1] int64 token offsets (non-decreasing, last <= T); seg_slots: [G] int64 (-1: none).
    """
    _check(x, a, b, scaling)
    num_segments = seg_slots.shape[0]
    assert seg_slots.dtype == seg_starts.dtype == torch.int64, "seg_starts and seg_slots: int64"
    assert seg_starts.shape == (num_segments + 1,), f"seg_starts {seg_starts.shape} for {num_segments} segments"
    (num_tokens, in_features), (out_features, _, rank) = x.shape, b.shape
    out = torch.zeros((num_tokens, out_features), device=x.device, dtype=x.dtype)
    if num_tokens == 0 or out_features == 0 or num_segments == 0:
        return out
    block_m = 16 if interpreting() or num_tokens <= 256 else 64
    block_r = max(16, next_power_of_2(rank))
    block_k = max(16, min(next_power_of_2(in_features), 32 if interpreting() else 64))
    block_n = max(16, min(next_power_of_2(out_features), 64 if interpreting() else 128))
    tile_seg, tile_row = segment_tiles(seg_starts, num_tokens, block_m)
    cols = _splits(tile_seg.shape[0], out_features, block_n, x.device)
    _lora_segment_kernel[(tile_seg.shape[0], cdiv(out_features, cols))](
        x, a, b, scaling, seg_starts, seg_slots, tile_seg, tile_row, out,
        num_segments, in_features, out_features, cols,
        x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
        RANK=rank, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n, UPCAST=upcast(),
        num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip
    return out


@lora_delta_segments.register_fake
def _(x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, seg_starts: Tensor, seg_slots: Tensor) -> Tensor:
    _check(x, a, b, scaling)
    return x.new_empty((x.shape[0], b.shape[0]))

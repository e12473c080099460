"""Rotary position embedding (RoPE, arXiv 2104.09864) on q and k in one Triton launch.

Math (fp32), with `c = cos[r]`, `s = sin[r]` for the table row `r` of a token:
- half-rotation (HF / NeoX) layout, `x1 = x[:D/2]`, `x2 = x[D/2:]`: `out1 = x1 c - x2 s`, `out2 = x2 c + x1 s`;
- interleaved (GPT-J / DeepSeek) layout: the same on the pairs `(x[2i], x[2i+1])` with `c[i], s[i]`.
The row is `r = t` (a per-token table, `positions=None`) or `r = positions[t]` (a cached table).

Layouts: `q: [T, H, D]`, `k: [T, K, D]` with a contiguous last dim and arbitrary token/head strides (views of a
fused qkv projection work); `cos, sin: [R, D/2]` with a contiguous last dim. Outputs are new contiguous tensors
in the input dtypes; inputs are never written.

Kernel: grid `(cdiv(T, BLOCK_T), cdiv(H, BLOCK_H) + cdiv(K, BLOCK_H))`; the first head blocks rotate q, the
rest k, so both tensors take one launch. A program owns `BLOCK_T` tokens x `BLOCK_H` heads flattened into rows
and loads each row's cos/sin (repeats hit L1). The interleaved layout loads whole rows as `[rows, D]`, splits
the pairs in registers and rejoins them, keeping loads and stores contiguous. It is a pure streaming kernel:
bytes moved are `2 * (H + K) * D * elem` per token (plus the cos/sin rows), the target is HBM bandwidth. Token
offsets are int64. A position outside `[0, R)` turns that token's outputs into NaN: reporting it would need a
host sync, and reading outside the table would be worse.

Autograd: the rotation is orthogonal, so the backward pass is the same kernel rotating by `-sin` (the op's
`inverse` flag). Gradients flow to q and k; cos, sin and positions get none.
Not supported: partial rotary (rotary dim < head dim), in-place rotation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import cdiv, check_last_dim_contiguous, next_power_of_2

__all__ = ["block_sizes", "rotary", "rotary_ref", "rotate_block"]


@triton.jit
def rotate_block(
    x_ptr, o_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, t0, h0, num_tokens, num_heads, num_rows,
    stride_x_t, stride_x_h, stride_o_t, stride_o_h, stride_cos_r, stride_sin_r, stride_pos_t,
    HAS_POSITIONS: tl.constexpr, HAS_SLOTS: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    w_ptr=None, eps=0.0, HAS_NORM: tl.constexpr = False, ROUND_NORM: tl.constexpr = False,
):  # fmt: skip
    # Rotate rows (t0 + r // BLOCK_H, h0 + r % BLOCK_H) of x [T, heads, D] into o [T, heads, D], or with
    # HAS_SLOTS into o [S, heads, D] at row slot[t] (a paged KV pool; a negative slot writes nothing).
    # HAS_NORM first RMS-normalises each row with the gain w [D] (qwen3's per-head q/k norm), rounding as
    # `nn.norm.rms_norm` does: the normalised row to x's dtype, and the gain's product too when ROUND_NORM (the
    # gain in x's dtype) -- products of two 16-bit values are exact in fp32, so fp32 math then one rounding is
    # the 16-bit multiply.
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = t0 + rows // BLOCK_H  # [ROWS] int64
    head = h0 + rows % BLOCK_H
    tok_ok = tok < num_tokens
    row_ok = tok_ok & (head < num_heads)
    if HAS_SLOTS:
        out_tok = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
        row_ok = row_ok & (out_tok >= 0)
    else:
        out_tok = tok
    if HAS_POSITIONS:
        table_row = tl.load(pos_ptr + tok * stride_pos_t, mask=tok_ok, other=0).to(tl.int64)
    else:
        table_row = tok
    i = tl.arange(0, HALF_PAD)
    cs_mask = row_ok[:, None]
    if HALF != HALF_PAD:
        cs_mask = cs_mask & (i[None, :] < HALF)
    # A position outside the table cannot be reported without a host sync: it yields NaN, not a wild read.
    in_table = cs_mask & ((table_row >= 0) & (table_row < num_rows))[:, None]
    c_ptrs = cos_ptr + table_row[:, None] * stride_cos_r + i[None, :]
    s_ptrs = sin_ptr + table_row[:, None] * stride_sin_r + i[None, :]
    c = tl.load(c_ptrs, mask=in_table, other=float("nan")).to(tl.float32)
    s = tl.load(s_ptrs, mask=in_table, other=float("nan")).to(tl.float32)
    if INVERSE:
        s = -s
    x_row = x_ptr + tok * stride_x_t + head * stride_x_h  # [ROWS] row starts
    o_row = o_ptr + out_tok * stride_o_t + head * stride_o_h
    if INTERLEAVED:
        # Whole rows load and store as contiguous vectors; pairs are split and rejoined in registers.
        d = tl.arange(0, 2 * HALF_PAD)
        mask = row_ok[:, None]
        if HALF != HALF_PAD:
            mask = mask & (d[None, :] < 2 * HALF)
        x = tl.load(x_row[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)  # [ROWS, 2 * HALF_PAD]
        if HAS_NORM:
            w = tl.load(w_ptr + d, mask=d < 2 * HALF, other=0.0).to(tl.float32)
            x = _rms_normed(x, tl.sum(x * x, 1), w, eps, 2 * HALF, x_ptr.dtype.element_ty, ROUND_NORM)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_T * BLOCK_H, HALF_PAD, 2]))  # even, odd: [ROWS, HALF_PAD]
        out = tl.reshape(tl.join(x1 * c - x2 * s, x2 * c + x1 * s), [BLOCK_T * BLOCK_H, 2 * HALF_PAD])
        tl.store(o_row[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=mask)
    else:
        x1 = tl.load(x_row[:, None] + i[None, :], mask=cs_mask, other=0.0).to(tl.float32)  # [ROWS, HALF_PAD]
        x2 = tl.load(x_row[:, None] + HALF + i[None, :], mask=cs_mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
            w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
            x1 = _rms_normed(x1, squares, w1, eps, 2 * HALF, x_ptr.dtype.element_ty, ROUND_NORM)
            x2 = _rms_normed(x2, squares, w2, eps, 2 * HALF, x_ptr.dtype.element_ty, ROUND_NORM)
        tl.store(o_row[:, None] + i[None, :], (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=cs_mask)
        tl.store(o_row[:, None] + HALF + i[None, :], (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=cs_mask)


@triton.jit
def _rms_normed(x, squares, w, eps, DIM: tl.constexpr, X_DTYPE: tl.constexpr, ROUND_NORM: tl.constexpr):
    # x [ROWS, N] fp32 (part of rows whose squares sum to `squares` [ROWS]), w [N] fp32 -> fp32 values of
    # `w * (x * rsqrt(mean(x^2) + eps)).to(X_DTYPE)`, rounded to X_DTYPE when ROUND_NORM.
    normed = (x * tl.math.rsqrt(squares / DIM + eps)[:, None]).to(X_DTYPE).to(tl.float32)
    out = normed * w[None, :]
    if ROUND_NORM:
        out = out.to(X_DTYPE).to(tl.float32)
    return out


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr,
    num_tokens, num_q_heads, num_k_heads, num_rows,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h,
    stride_qo_t, stride_qo_h, stride_ko_t, stride_ko_h,
    stride_cos_r, stride_sin_r, stride_pos_t,
    HAS_POSITIONS: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # q/qo: [T, H, D]; k/ko: [T, K, D]; cos/sin: [R, D/2]; positions: [T] int64 (when HAS_POSITIONS).
    # Program (i, j): tokens i*BLOCK_T.., head block j of q (j < cdiv(H, BLOCK_H)) or else of k.
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    pid_h = tl.program_id(1)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if pid_h < num_q_blocks:
        rotate_block(
            q_ptr, qo_ptr, cos_ptr, sin_ptr, pos_ptr, pos_ptr, t0, pid_h * BLOCK_H, num_tokens, num_q_heads,
            num_rows, stride_q_t, stride_q_h, stride_qo_t, stride_qo_h, stride_cos_r, stride_sin_r, stride_pos_t,
            HAS_POSITIONS, False, INTERLEAVED, INVERSE, HALF, HALF_PAD, BLOCK_T, BLOCK_H,
        )  # fmt: skip
    else:
        rotate_block(
            k_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, pos_ptr, t0, (pid_h - num_q_blocks) * BLOCK_H, num_tokens,
            num_k_heads, num_rows, stride_k_t, stride_k_h, stride_ko_t, stride_ko_h, stride_cos_r, stride_sin_r,
            stride_pos_t, HAS_POSITIONS, False, INTERLEAVED, INVERSE, HALF, HALF_PAD, BLOCK_T, BLOCK_H,
        )  # fmt: skip


def rotary_ref(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None, *, interleaved: bool = False
) -> tuple[Tensor, Tensor]:
    """The specification: plain torch, math in fp32 (fp64 inputs stay fp64, for gradcheck).

    Args:
        q: [T, H, D] queries; k: [T, K, D] keys.
        cos, sin: [R, D/2] tables; row t is used for token t when positions is None (R == T).
        positions: optional [T] int64 rows of the tables.
        interleaved: rotate adjacent pairs instead of halves.

    Returns:
        (q_out, k_out) rotated, new tensors in the dtypes of q and k.
    """
    if positions is not None:
        cos, sin = cos[positions], sin[positions]  # [R, D/2] -> [T, D/2]
    return _rotate_ref(q, cos, sin, interleaved), _rotate_ref(k, cos, sin, interleaved)


def _rotate_ref(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    c, s = cos.to(xf.dtype)[:, None, :], sin.to(xf.dtype)[:, None, :]  # [T, 1, D/2] broadcast over heads
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)  # [T, h, D/2, 2] -> [T, h, D]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(x.dtype)


def block_sizes(num_tokens: int, num_q_heads: int, num_k_heads: int, head_dim: int) -> tuple[int, int]:
    # BLOCK_H is the largest power of two (<= 16) dividing both head counts, so no head block is partly masked;
    # BLOCK_T brings a program to ~4K elements so tiny head counts (K = 1, 2) still move enough bytes.
    common = math.gcd(num_q_heads, num_k_heads)
    block_h = min(common & -common, 16)
    rows = max(1, 4096 // (block_h * next_power_of_2(head_dim)))
    block_t = min(next_power_of_2(rows), next_power_of_2(max(num_tokens, 1)), 64)
    return block_t, block_h


@torch.library.custom_op("astrai::rotary", mutates_args=())
def _rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, interleaved: bool, inverse: bool
) -> tuple[Tensor, Tensor]:
    # The op behind `rotary`; `inverse` rotates by -sin (the backward pass). Shapes as in `rotary`.
    _check_args(q, k, cos, sin, positions)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    block_t, block_h = block_sizes(num_tokens, num_q_heads, num_k_heads, head_dim)
    grid = (cdiv(num_tokens, block_t), cdiv(num_q_heads, block_h) + cdiv(num_k_heads, block_h))
    pos = positions if positions is not None else cos  # never read without HAS_POSITIONS
    _rotary_kernel[grid](
        q, k, q_out, k_out, cos, sin, pos, num_tokens, num_q_heads, num_k_heads, cos.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0), pos.stride(0),
        HAS_POSITIONS=positions is not None, INTERLEAVED=interleaved, INVERSE=inverse,
        HALF=head_dim // 2, HALF_PAD=next_power_of_2(head_dim // 2), BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=4, enable_fp_fusion=True,  # explicit: triton 3.9 warns when FMA fusion is left to the default
    )  # fmt: skip
    return q_out, k_out


@_rotary.register_fake
def _(q, k, cos, sin, positions, interleaved, inverse):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup_context(ctx, inputs, output) -> None:
    _, _, cos, sin, positions, interleaved, inverse = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.interleaved, ctx.inverse = interleaved, inverse


def _backward(ctx, grad_q: Tensor, grad_k: Tensor):
    # The rotation is orthogonal: its transpose rotates by -sin. Grads of broadcasts may have a zero last stride.
    cos, sin, positions = ctx.saved_tensors
    grad_q = grad_q if grad_q.stride(-1) == 1 else grad_q.contiguous()
    grad_k = grad_k if grad_k.stride(-1) == 1 else grad_k.contiguous()
    dq, dk = _rotary(grad_q, grad_k, cos, sin, positions, ctx.interleaved, not ctx.inverse)
    return dq, dk, None, None, None, None, None


_rotary.register_autograd(_backward, setup_context=_setup_context)


def rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None, *, interleaved: bool = False
) -> tuple[Tensor, Tensor]:
    """Rotate q and k by their tokens' angles in one kernel launch (op `astrai::rotary`, differentiable).

    Args:
        q: [T, H, D] queries; k: [T, K, D] keys (last dim contiguous, other strides arbitrary; D even).
        cos, sin: [R, D/2] tables (fp32; last dim contiguous); row t serves token t when positions is None
            (then R == T).
        positions: optional [T] int64 table rows; a row outside [0, R) makes that token's outputs NaN.
        interleaved: rotate adjacent pairs (x[2i], x[2i+1]) instead of halves.

    Returns:
        (q_out [T, H, D], k_out [T, K, D]): new contiguous tensors in the dtypes of q and k.
    """
    return _rotary(q, k, cos, sin, positions, interleaved, False)


def _check_args(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None) -> None:
    assert q.dim() == 3 and k.dim() == 3, f"q [T,H,D] and k [T,K,D] expected, got {q.shape}, {k.shape}"
    assert q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], f"q {q.shape} and k {k.shape} disagree"
    assert q.shape[2] % 2 == 0, f"head dim must be even, got {q.shape[2]}"
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == q.shape[2] // 2, (
        f"cos/sin must be [R, D/2] = [R, {q.shape[2] // 2}], got {cos.shape}, {sin.shape}"
    )
    if positions is None:
        assert cos.shape[0] == q.shape[0], f"per-token tables need R == T, got R={cos.shape[0]}, T={q.shape[0]}"
    else:
        assert positions.shape == (q.shape[0],) and positions.dtype == torch.int64, "positions must be [T] int64"
    check_last_dim_contiguous(q=q, k=k, cos=cos, sin=sin)

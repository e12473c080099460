"""Routed SwiGLU experts without a host sync: device-side block alignment and a gathered grouped GEMM.

Math (x [N, D], idx/weights [N, k]; expert e has gate/up [I, D] and down [D, I]; P = N * k (token, slot) pairs):
    out[t] = sum_j weights[t, j] * down_e (silu(gate_e x[t]) * up_e x[t])      with e = idx[t, j]
An id equal to the number of experts E marks a pair this rank does not own (expert parallel): it adds nothing.

Why: `astrai.nn.moe.grouped_experts` loops over experts with segment sizes read on the host (`.tolist()`), so a
MoE step syncs once per layer and cannot be captured in a CUDA graph. Here (as vLLM's `fused_moe` and its
`moe_align_block_size`) the segment bookkeeping stays on the device:
1. `moe_align` sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M, in a buffer sized
   for the worst case (cdiv(P, BLOCK_M) + E blocks), so every shape depends on N, k and E only; each block gets
   its expert id (E for blocks past the end).
2. `_moe_gemm_kernel`, grid (blocks, cdiv(out width, BLOCK_N)): a program loads its block's expert id (empty
   blocks return at once), gathers its BLOCK_M input rows (the token of each pair for gate/up, the pair's own
   row of the hidden activations for down) and multiplies them by that expert's weight tile, applying int8
   per-row scales and, for down, the routing weight; it writes each pair's row.
3. gate and up run as two launches, silu(g) * u in torch, then down; the k rows of each token are summed.
Accumulation is fp32; gate/up/hidden rows are stored in x's dtype, as the reference's separate products are.
`fused_experts_ref` is the plain-torch specification (dense over the pairs, no sync either, for small tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ._common import autotune_configs, cdiv, interpreting, upcast
from ._launch import TunedKernel

__all__ = ["fused_experts", "fused_experts_ref", "moe_align"]


def moe_align(idx: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Pairs grouped by expert, each expert's run padded to a multiple of `block_m`; no host sync.

    Args:
        idx: [N, k] expert ids in [0, num_experts]; num_experts marks a pair that is not ours.

    Returns:
        sorted_pairs: [num_blocks * block_m] int64 pair ids (t * k + j); padding holds N * k.
        block_expert: [num_blocks] int64 expert of each block; num_experts for blocks past the last run.
        num_blocks = cdiv(N * k, block_m) + num_experts is the static worst case.
    """
    flat = idx.reshape(-1).long()
    pairs = flat.numel()
    num_blocks = cdiv(pairs, block_m) + num_experts
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # pairs by expert; foreign pairs (id E) last
    expert = flat[order]
    ours = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    rank = torch.arange(pairs, device=idx.device) - (counts.cumsum(0) - counts)[e]  # position within its run
    dest = torch.where(ours, ends[e] - padded[e] + rank, num_blocks * block_m)  # foreign: the spare slot
    sorted_pairs = torch.full((num_blocks * block_m + 1,), pairs, dtype=torch.int64, device=idx.device)
    sorted_pairs = sorted_pairs.scatter(0, dest, order)[:-1]
    starts = torch.arange(num_blocks, device=idx.device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)  # == num_experts past the last run
    return sorted_pairs, block_expert


@triton.jit
def _moe_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, route_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, out_features, in_features, stride_x, stride_we, stride_wn, stride_out,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, ROWS_BY_TOKEN: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_ROUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    # x [rows, in] (rows: tokens when ROWS_BY_TOKEN, else pairs); w [E, out, in] (int8 with HAS_SCALE, scale
    # [E, out]); route [P] routing weights; out [P, out]; one program: BLOCK_M pairs of one expert x BLOCK_N cols.
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block)
    if e >= NUM_EXPERTS:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs // TOP_K if ROWS_BY_TOKEN else pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < out_features
    w_base = w_ptr + e * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < in_features
        a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_base + ks[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:  # the interpreter (no 16-bit arithmetic): fp32 tiles, int8 weights straight to fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        elif HAS_SCALE:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc=acc, input_precision="ieee")
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + e * out_features + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_ROUTE:
        acc = acc * tl.load(route_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn in (64, 128) for bk in (64, 128) for w in (4, 8) for s in (3, 4)
]  # fmt: skip


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    return autotune_configs(configs)


_moe_gemm_tuned = TunedKernel(triton.autotune(
    configs=_CONFIGS, key=["out_features", "in_features", "BLOCK_M", "HAS_SCALE"],
    prune_configs_by={"early_config_prune": _prune},
)(_moe_gemm_kernel))  # fmt: skip


def _block_m(pairs: int) -> int:
    # tl.dot needs M >= 16; decode batches (few pairs per expert) waste least at 16, prefill fills 64-row tiles
    return 16 if interpreting() or pairs <= 1024 else 64


def _gemm(x, w, scale, route, sorted_pairs, block_expert, *, num_pairs, top_k, rows_by_token, block_m) -> Tensor:
    scale = scale.contiguous() if scale is not None else None  # read as [E, out] rows
    out = torch.zeros((num_pairs, w.shape[1]), device=x.device, dtype=x.dtype)  # foreign pairs stay zero
    if num_pairs == 0:
        return out
    args = (
        x,
        w,
        scale if scale is not None else w,
        route if route is not None else x,
        out,
        sorted_pairs,
        block_expert,
        num_pairs,
        w.shape[1],
        w.shape[2],
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
    )
    meta = dict(NUM_EXPERTS=w.shape[0], TOP_K=top_k, ROWS_BY_TOKEN=rows_by_token, HAS_SCALE=scale is not None,
                HAS_ROUTE=route is not None, BLOCK_M=block_m, UPCAST=upcast())  # fmt: skip
    if interpreting():
        grid = (block_expert.shape[0], cdiv(w.shape[1], 16))
        _moe_gemm_kernel[grid](*args, **meta, BLOCK_N=16, BLOCK_K=16)
    else:
        _moe_gemm_tuned.launch(lambda m: (block_expert.shape[0], cdiv(w.shape[1], m["BLOCK_N"])), args, meta)
    return out


def _check(x: Tensor, idx: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> None:
    assert x.dim() == 2 and idx.shape == weights.shape and idx.shape[0] == x.shape[0], (x.shape, idx.shape)
    assert gate.shape == up.shape and gate.shape[2] == x.shape[1] == down.shape[1], (gate.shape, down.shape)
    assert down.shape[2] == gate.shape[1] and down.shape[0] == gate.shape[0]
    for name, t in (("x", x), ("gate", gate), ("up", up), ("down", down)):
        assert t.stride(-1) == 1, f"{name} needs a contiguous last dim"


@torch.library.custom_op("astrai::fused_experts", mutates_args=())
def fused_experts(
    x: Tensor,
    idx: Tensor,
    weights: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    gate_scale: Tensor | None = None,
    up_scale: Tensor | None = None,
    down_scale: Tensor | None = None,
) -> Tensor:
    """Routed SwiGLU experts (see the module): [N, D] in x's dtype. Triton (CUDA, or CPU under the interpreter);
    never syncs, so a decode step holding it can be captured in a CUDA graph. Inference only (no backward).

    Args:
        x: [N, D]; idx: [N, k] expert ids (E = not ours); weights: [N, k] routing weights.
        gate, up: [E, I, D]; down: [E, D, I]; in x's dtype, or int8 with per-row `*_scale` [E, I] / [E, D].
    """
    _check(x, idx, weights, gate, up, down)
    n, k = idx.shape
    if n == 0:
        return torch.zeros_like(x)
    block_m = _block_m(n * k)
    sorted_pairs, block_expert = moe_align(idx, gate.shape[0], block_m)
    kw = dict(num_pairs=n * k, top_k=k, block_m=block_m)
    g = _gemm(x, gate, gate_scale, None, sorted_pairs, block_expert, rows_by_token=True, **kw)
    u = _gemm(x, up, up_scale, None, sorted_pairs, block_expert, rows_by_token=True, **kw)
    h = F.silu(g) * u  # [P, I]
    route = weights.reshape(-1).to(x.dtype).contiguous()
    y = _gemm(h, down, down_scale, route, sorted_pairs, block_expert, rows_by_token=False, **kw)  # [P, D]
    return y.view(n, k, -1).sum(1)


@fused_experts.register_fake
def _(x, idx, weights, gate, up, down, gate_scale=None, up_scale=None, down_scale=None) -> Tensor:
    _check(x, idx, weights, gate, up, down)
    return torch.empty_like(x)


def fused_experts_ref(
    x: Tensor,
    idx: Tensor,
    weights: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    gate_scale: Tensor | None = None,
    up_scale: Tensor | None = None,
    down_scale: Tensor | None = None,
) -> Tensor:
    """Plain-torch specification of `fused_experts` (same arguments): each pair gathers its expert's weights,
    so memory grows with N * k * I * D; for tests on small shapes. Products in fp32, rows rounded to x's dtype
    where the kernel stores them."""
    n, k = idx.shape
    num_experts = gate.shape[0]
    ours = (idx < num_experts).reshape(-1)
    e = idx.reshape(-1).clamp(max=num_experts - 1)
    xs = x.float().repeat_interleave(k, 0)  # [P, D]

    def product(rows: Tensor, w: Tensor, scale: Tensor | None) -> Tensor:
        out = torch.einsum("pd,pod->po", rows, w[e].float())
        return out * scale[e].float() if scale is not None else out

    g = product(xs, gate, gate_scale).to(x.dtype)
    u = product(xs, up, up_scale).to(x.dtype)
    h = (F.silu(g) * u).float()
    y = product(h, down, down_scale) * weights.reshape(-1, 1).to(x.dtype).float()
    y = torch.where(ours[:, None], y, 0.0).to(x.dtype)
    return y.view(n, k, -1).sum(1)

"""Routed experts without a host sync (inference): the Triton `fused_experts` kernel, where the backend allows.

`astrai.nn.moe.experts` runs it when no gradient is needed and the attention backend is Triton (CUDA tensors by
default; `ASTRAI_ATTN_BACKEND=triton` under the interpreter on CPU): its expert bookkeeping stays on the device,
so a MoE decode step can be captured in a CUDA graph and overlapped with the host. Elsewhere (CPU, training,
`ASTRAI_ATTN_BACKEND=torch`) the grouped expert loop runs, which reads the per-expert counts on the host.
"""

from __future__ import annotations

import os

from torch import Tensor

from astrai.ops.backend import attn_backend


def fused_experts_enabled() -> bool:
    """Whether CUDA tensors take the sync-free kernel (`ASTRAI_ATTN_BACKEND` is auto or triton)."""
    return os.environ.get("ASTRAI_ATTN_BACKEND", "auto") in ("auto", "triton")


def use_fused_experts(x: Tensor) -> bool:
    """Whether `x`'s experts run through `fused_experts` (the backend of `x` is Triton)."""
    return attn_backend(x) == "triton"


def fused_experts(
    x: Tensor,
    idx: Tensor,
    weights: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    scales: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """sum_j weights[:, j] * expert_{idx[:, j]}(x) for x [N, D] (`astrai.triton_kernels.fused_moe`; no backward).

    Args:
        idx: [N, k] expert ids; the number of experts marks a pair another rank owns (it adds nothing).
        gate, up: [E, I, D]; down: [E, D, I]; `scales` (gate, up, down) per-row scales of int8 stacks.
    """
    from astrai.triton_kernels.fused_moe import fused_experts as kernel

    return kernel(x, idx, weights, gate, up, down, *(scales or (None, None, None)))

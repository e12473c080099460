"""RMSNorm: `RMSNormParams` (weight [E]) and `rms_norm()`.

Computes in fp32 and casts back before the weight multiply, in the same order as HF's LlamaRMSNorm, so
bf16 outputs match transformers bit for bit (the engine's eager CPU steps run a one-pass kernel that sums the squares
in another order: `astrai.ops.pointwise`).
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from astrai.ops import pointwise
from astrai.tree import pytree


@pytree
@attrs.frozen(eq=False)
class RMSNormParams:
    """Learnable per-channel gain."""

    weight: Tensor  # [E]


def init_rms_norm(dim: int, *, dtype: torch.dtype = torch.float32) -> RMSNormParams:
    """Unit gains."""
    return RMSNormParams(weight=torch.ones(dim, dtype=dtype))


def rms_norm(p: RMSNormParams, x: Tensor, *, eps: float) -> Tensor:
    """x: [..., E] -> [..., E], normalised over the last dim (`astrai.ops.pointwise.rms_norm`: in fp32, rounded to x's
    dtype, times the gain; one CPU kernel pass in the engine's eager steps)."""
    return pointwise.rms_norm(x, p.weight, eps)

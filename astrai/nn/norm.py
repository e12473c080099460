"""RMSNorm: `RMSNormParams` (weight [E]) and `rms_norm()`.

Computes in fp32 and casts back before the weight multiply, in the same order as HF's LlamaRMSNorm, so
bf16 outputs match transformers bit for bit.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

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
    """x: [..., E] -> [..., E], normalised over the last dim."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return p.weight * h.to(x.dtype)

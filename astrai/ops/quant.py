"""int8 weight-only quantization of one tensor: per-row symmetric scales, and the inverse.

A weight [out, in] becomes int8 q [out, in] and a scale [out] with w ≈ q * scale[:, None], scale = max|row| / 127
(the row's largest magnitude maps to ±127; -128 is never used, so the grid is symmetric). Rows are output
channels of a linear layer, so the scale multiplies the product's output column: x @ w.T = (x @ q.T) * scale.
A stacked weight [E, out, in] (MoE experts) gets a scale [E, out] the same way.

The scale keeps the tensor's float dtype: it is also the dtype the dequantized product comes back in.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8_MAX = 127


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(q int8, scale) with weight ≈ q * scale[..., None]; all-zero rows get scale 1 (q = 0, exact).

    The rounding is computed in fp32 whatever the weight's dtype, so a bf16 weight whose rows are integers
    times a power of two quantizes exactly.
    """
    if not weight.is_floating_point():
        raise TypeError(f"only floating-point weights are quantized, got {weight.dtype}")
    w = weight.float()
    amax = w.abs().amax(dim=-1)
    if not torch.isfinite(amax).all():
        raise ValueError("the weight holds NaN or infinite values: it cannot be quantized")
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.to(weight.dtype)


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """q * scale[..., None] in the scale's dtype: the float weight the quantized one stands for."""
    return (q.float() * scale.float().unsqueeze(-1)).to(scale.dtype)

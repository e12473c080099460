"""Linear projection: `LinearParams` (weight [out, in], optional bias) and `linear()`.

Weights keep the `nn.Linear` / HF layout [out, in] and are applied with `F.linear` (via `astrai.ops.linear`),
so HF checkpoints load without a transpose (zero-copy from mmap) and both CPU and CUDA GEMMs run their tuned
transposed-B path.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from astrai.ops.linear import linear as linear_op
from astrai.tree import pytree


@pytree
@attrs.frozen(eq=False)
class LinearParams:
    """A dense projection from `in` to `out` features."""

    weight: Tensor  # [out, in]
    bias: Tensor | None = None  # [out]


def init_linear(
    in_features: int,
    out_features: int,
    *,
    bias: bool = False,
    std: float = 0.02,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> LinearParams:
    """Normal(0, std) weights and zero bias, built on the CPU (move the whole tree afterwards)."""
    weight = torch.empty(out_features, in_features, dtype=torch.float32).normal_(0.0, std, generator=generator)
    b = torch.zeros(out_features, dtype=dtype) if bias else None
    return LinearParams(weight=weight.to(dtype), bias=b)


def linear(p: LinearParams, x: Tensor) -> Tensor:
    """x: [..., in] -> [..., out]."""
    return linear_op(x, p.weight, p.bias)

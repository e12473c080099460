"""Linear projection: `LinearParams` (weight [out, in], optional bias) and `linear()`.

Weights keep the `nn.Linear` / HF layout [out, in] and are applied with `F.linear` (via `astrai.ops.linear`),
so HF checkpoints load without a transpose (zero-copy from mmap) and both CPU and CUDA GEMMs run their tuned
transposed-B path. A weight-only quantized projection (`astrai.models.quantize`) holds an int8 weight and its
per-output-row `scale`; `linear()` hands both to the op.

`LoRALinearParams` (a LinearParams plus low-rank adapters, see `astrai.nn.lora`) is defined here rather than
in `lora.py` because `linear()` dispatches on it and `lora.py` builds on this module: keeping the class here
avoids an import cycle.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from astrai.ops.linear import linear as linear_op
from astrai.ops.linear import linears
from astrai.tree import pytree, static


@pytree
@attrs.frozen(eq=False)
class LinearParams:
    """A dense projection from `in` to `out` features."""

    weight: Tensor  # [out, in]; int8 when `scale` is set
    bias: Tensor | None = None  # [out]
    scale: Tensor | None = None  # [out]: int8 weight-only quantization, weight * scale[:, None] is the real one


@pytree
@attrs.frozen(eq=False)
class LoRALinearParams(LinearParams):
    """A frozen base projection plus a LoRA update: y = x W^T + b + scaling * (x A^T) B^T (`astrai.nn.lora`)."""

    lora_a: Tensor = attrs.field(kw_only=True)  # [r, in]
    lora_b: Tensor = attrs.field(kw_only=True)  # [out, r]
    scaling: float = static(kw_only=True)  # alpha / r


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
    """x: [..., in] -> [..., out]; a `LoRALinearParams` adds its low-rank update."""
    out = linear_op(x, p.weight, p.bias, p.scale)
    if isinstance(p, LoRALinearParams):
        # two thin products through the rank-r bottleneck; B @ A [out, in] is never materialised
        out = out + linear_op(linear_op(x, p.lora_a.to(x.dtype)), p.lora_b.to(x.dtype)) * p.scaling
    return out


def plain(p: LinearParams) -> bool:
    """A projection with a float weight and no adapter: one that may be packed with others (`linear_group`)."""
    return type(p) is LinearParams and p.scale is None


def linear_group(ps: tuple[LinearParams, ...], x: Tensor) -> list[Tensor]:
    """[linear(p, x) for p in ps]: projections of one input (q/k/v, gate/up). Plain ones go through
    `ops.linear.linears`, which runs them as one product when the CPU engine packed them together."""
    if all(plain(p) for p in ps):
        return linears(x, [p.weight for p in ps], [p.bias for p in ps])
    return [linear(p, x) for p in ps]

"""Linear projection: `LinearParams` (weight [out, in], optional bias) and `linear()`.

Weights keep the `nn.Linear` / HF layout [out, in] and are applied with `F.linear` (via `astrai.ops.linear`),
so HF checkpoints load without a transpose (zero-copy from mmap) and both CPU and CUDA GEMMs run their tuned
transposed-B path. A weight-only quantized projection (`astrai.models.quantize`) holds an int8 weight and its
per-output-row `scale`; `linear()` hands both to the op.

`LoRALinearParams` (a LinearParams plus low-rank adapters, see `astrai.nn.lora`) and `SlotLoRALinearParams` (a
LinearParams plus the engine's adapter slots, see `astrai.nn.lora_slots`) are defined here rather than beside
their helpers because `linear()` dispatches on them and those modules build on this one: keeping the classes here
avoids an import cycle.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from astrai.ops.linear import linear as linear_op
from astrai.ops.linear import linears
from astrai.ops.lora import lora_delta
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


@pytree
@attrs.frozen(eq=False)
class SlotLoRALinearParams(LinearParams):
    """A frozen base projection plus `max_loras` adapter slots; each row adds the update of its own slot's adapter
    (`astrai.nn.lora_slots`, `astrai.ops.lora.lora_delta`). `slot_ids` is bound per step (None: base only)."""

    lora_a: Tensor = attrs.field(kw_only=True)  # [S, R, in]: slot s holds its adapter's A, zero-padded to R rows
    lora_b: Tensor = attrs.field(kw_only=True)  # [out, S, R]: slot s holds its adapter's B in b[:, s, :r]
    scaling: Tensor = attrs.field(kw_only=True)  # [S] float32: alpha / r of each slot's adapter (0: empty)
    slot_ids: Tensor | None = attrs.field(default=None, kw_only=True)  # [rows] int64, -1: no adapter
    seg_starts: Tensor | None = attrs.field(default=None, kw_only=True)  # [G + 1]: prefill segments (GPU kernel)
    seg_slots: Tensor | None = attrs.field(default=None, kw_only=True)  # [G]: each segment's slot


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
    elif isinstance(p, SlotLoRALinearParams) and p.slot_ids is not None:
        out = out + lora_delta(x, p.lora_a, p.lora_b, p.scaling, p.slot_ids, p.seg_starts, p.seg_slots)
    return out


def plain(p: LinearParams) -> bool:
    """A projection with a float weight and no adapter: one that may be packed with others (`linear_group`)."""
    return type(p) is LinearParams and p.scale is None


def stackable(ps: tuple[LinearParams, ...]) -> bool:
    """Whether `concat_linears` can stack `ps`: plain projections (no adapter) that are all float or all int8, of
    one dtype, device and input size."""
    kinds = {(type(p), p.scale is None, p.weight.dtype, p.weight.device, p.weight.shape[1:]) for p in ps}
    return len(kinds) == 1 and type(ps[0]) is LinearParams and ps[0].weight.dim() == 2


def concat_linears(ps: tuple[LinearParams, ...]) -> LinearParams | None:
    """One projection computing every one of `ps` (their outputs side by side, in order), or None when they do not
    stack: an adapter (LoRA), a mix of float and int8 weights, or weights of different dtype, device or input
    size. Weights, biases (zeros for a missing one) and int8 scales are concatenated along the output rows: a copy.
    """
    if not stackable(ps):
        return None
    first = ps[0].weight
    weight = torch.cat([p.weight for p in ps])
    scale = None if ps[0].scale is None else torch.cat([p.scale for p in ps])
    bias = None
    if any(p.bias is not None for p in ps):
        bias_dtype = next(p.bias.dtype for p in ps if p.bias is not None)
        zeros = [torch.zeros(p.weight.shape[0], dtype=bias_dtype, device=first.device) for p in ps]
        bias = torch.cat([z if p.bias is None else p.bias for p, z in zip(ps, zeros, strict=True)])
    return LinearParams(weight=weight, bias=bias, scale=scale)


def copy_concat_(fused: LinearParams, ps: tuple[LinearParams, ...]) -> None:
    """Write the current values of `ps` into `fused` (made by `concat_linears`) in place: the served tensors keep
    their storage, so compiled steps and CUDA graphs that hold them see the new values."""
    rows = [p.weight.shape[0] for p in ps]
    for out, p in zip(fused.weight.split(rows), ps, strict=True):
        out.copy_(p.weight)
    if fused.scale is not None:
        for out, p in zip(fused.scale.split(rows), ps, strict=True):
            out.copy_(p.scale)
    if fused.bias is not None:
        for out, p in zip(fused.bias.split(rows), ps, strict=True):
            out.copy_(p.bias) if p.bias is not None else out.zero_()


def linear_group(ps: tuple[LinearParams, ...], x: Tensor) -> list[Tensor]:
    """[linear(p, x) for p in ps]: projections of one input (q/k/v, gate/up). Plain ones go through
    `ops.linear.linears`, which runs them as one product when the CPU engine packed them together; so do the base
    products of slot-adapted ones (the served multi-LoRA tree), each then adding its rows' adapter updates."""
    if all(plain(p) for p in ps):
        return linears(x, [p.weight for p in ps], [p.bias for p in ps])
    if all(type(p) is SlotLoRALinearParams and p.scale is None for p in ps):
        outs = linears(x, [p.weight for p in ps], [p.bias for p in ps])
        if ps[0].slot_ids is None:
            return outs
        return [out + lora_delta(x, p.lora_a, p.lora_b, p.scaling, p.slot_ids, p.seg_starts, p.seg_slots)
                for out, p in zip(outs, ps, strict=True)]  # fmt: skip
    return [linear(p, x) for p in ps]

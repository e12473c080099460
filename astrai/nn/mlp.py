"""SwiGLU feed-forward: `MLPParams` (or `FusedMLPParams`) and `mlp()` = down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from astrai.nn.linear import LinearParams, init_linear, linear, linear_group
from astrai.ops.pointwise import silu_mul
from astrai.tree import pytree


@pytree
@attrs.frozen(eq=False)
class MLPParams:
    """Gate, up and down projections of a SwiGLU MLP."""

    gate_proj: LinearParams  # [F, E]
    up_proj: LinearParams  # [F, E]
    down_proj: LinearParams  # [E, F]


@pytree
@attrs.frozen(eq=False)
class FusedMLPParams:
    """A SwiGLU MLP for serving, with gate and up as one projection (`astrai.models.fuse`): one GEMM per step
    instead of two, as vLLM's MergedColumnParallelLinear. `gate_up_proj` holds the gate rows, then the up rows."""

    gate_up_proj: LinearParams  # [2F, E]
    down_proj: LinearParams  # [E, F]


def init_mlp(
    dim: int,
    hidden: int,
    *,
    bias: bool = False,
    std: float = 0.02,
    out_std: float | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> MLPParams:
    """Normal init; `out_std` (default `std`) is used for the residual-output projection."""
    kw = dict(bias=bias, generator=generator, dtype=dtype)
    return MLPParams(
        gate_proj=init_linear(dim, hidden, std=std, **kw),
        up_proj=init_linear(dim, hidden, std=std, **kw),
        down_proj=init_linear(hidden, dim, std=out_std if out_std is not None else std, **kw),
    )


def mlp(p: MLPParams | FusedMLPParams, x: Tensor) -> Tensor:
    """x: [..., E] -> [..., E]."""
    if isinstance(p, FusedMLPParams):
        gate, up = linear(p.gate_up_proj, x).chunk(2, dim=-1)
    else:
        gate, up = linear_group((p.gate_proj, p.up_proj), x)
    return linear(p.down_proj, silu_mul(gate, up))

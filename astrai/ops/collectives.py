"""Tensor-parallel collectives with the right autograd: `TensorParallel`, `tp_copy`, `tp_reduce`, `tp_gather`.

Megatron's two conjugate operators bracket every parallel region (a column-parallel projection ... a
row-parallel projection):
- `tp_copy` (Megatron's f): identity forward, all-reduce of the gradient backward. Placed where a replicated
  activation enters the region, so the replicated parameters upstream get the full gradient on every rank.
- `tp_reduce` (Megatron's g): all-reduce forward, identity backward. Placed where the region's partial sums
  leave it (after the row-parallel projection), so every rank continues with the same activation.
- `tp_gather`: all-gather along the last dim (vocab-parallel logits), backward takes this rank's slice.

Plain collectives (`torch.distributed`'s functional ops, so the calls return new tensors and stay traceable)
rather than DTensor: the model is a pure function of a tree of ordinary tensors, and three operators at known
places are simpler to read than placement propagation through every op (docs/distributed.md).

A `TensorParallel` of size 1 makes every operator the identity, so single-device code pays nothing.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor


@attrs.frozen(eq=False)
class TensorParallel:
    """This process's place in a tensor-parallel group: its rank, the group size and the process group."""

    rank: int
    size: int
    group: Any = None
    """A `torch.distributed.ProcessGroup`; None means the default (world) group."""

    def __attrs_post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in a group of size {self.size}")


def _all_reduce(x: Tensor, tp: TensorParallel) -> Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=tp.group)
    return out


def _all_gather_last(x: Tensor, tp: TensorParallel) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.tp), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:
        ctx.tp, ctx.width = tp, x.shape[-1]
        return _all_gather_last(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        start = ctx.tp.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


def tp_copy(x: Tensor, tp: TensorParallel | None) -> Tensor:
    """Enter a parallel region: identity forward, gradient all-reduced backward (identity without TP)."""
    return x if tp is None or tp.size == 1 else _Copy.apply(x, tp)


def tp_reduce(x: Tensor, tp: TensorParallel | None) -> Tensor:
    """Leave a parallel region: sum the ranks' partial results (identity without TP)."""
    return x if tp is None or tp.size == 1 else _Reduce.apply(x, tp)


def tp_gather(x: Tensor, tp: TensorParallel | None) -> Tensor:
    """Concatenate the ranks' slices along the last dim, rank order (identity without TP)."""
    return x if tp is None or tp.size == 1 else _Gather.apply(x, tp)


def all_reduce_(tensors: list[Tensor], tp: TensorParallel | None) -> None:
    """Sum each tensor over the group in place (e.g. the gradients of replicated parameters inside a region)."""
    if tp is None or tp.size == 1:
        return
    for t in tensors:
        dist.all_reduce(t, group=tp.group)

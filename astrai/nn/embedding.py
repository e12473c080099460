"""Token embedding: `EmbeddingParams` (weight [V, E]) and `embed()`.

A quantized table (`astrai.models.quantize`) is int8 with a per-row `scale` [V]: each looked-up row is widened
and scaled, and a tied LM head reads the same int8 table with the same scale (rows are its output channels).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.ops.collectives import TensorParallel, tp_reduce
from astrai.tree import pytree


@pytree
@attrs.frozen(eq=False)
class EmbeddingParams:
    """A lookup table of token vectors."""

    weight: Tensor  # [V, E]; int8 when `scale` is set
    scale: Tensor | None = None  # [V]: int8 weight-only quantization, row v is weight[v] * scale[v]


def init_embedding(
    vocab_size: int,
    dim: int,
    *,
    std: float = 0.02,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> EmbeddingParams:
    """Normal(0, std) table, built on the CPU."""
    weight = torch.empty(vocab_size, dim, dtype=torch.float32).normal_(0.0, std, generator=generator)
    return EmbeddingParams(weight=weight.to(dtype))


def embed(p: EmbeddingParams, tokens: Tensor, tp: TensorParallel | None = None) -> Tensor:
    """tokens: [...] int -> [..., E].

    Under tensor parallelism `p.weight` holds this rank's vocab rows [rank * V_r, (rank + 1) * V_r): tokens
    outside it look up zeros and the ranks' partial results are summed (vocab-parallel embedding).
    """
    if tp is None or tp.size == 1:
        return _lookup(p, tokens)
    rows = p.weight.shape[0]
    local = tokens - tp.rank * rows
    inside = (local >= 0) & (local < rows)
    out = _lookup(p, torch.where(inside, local, 0))
    return tp_reduce(out * inside.unsqueeze(-1).to(out.dtype), tp)


def _lookup(p: EmbeddingParams, tokens: Tensor) -> Tensor:
    if p.scale is None:
        return F.embedding(tokens, p.weight)
    return F.embedding(tokens, p.weight).to(p.scale.dtype) * F.embedding(tokens, p.scale.unsqueeze(-1))

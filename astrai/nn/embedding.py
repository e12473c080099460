"""Token embedding: `EmbeddingParams` (weight [V, E]) and `embed()`."""

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

    weight: Tensor  # [V, E]


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
        return F.embedding(tokens, p.weight)
    rows = p.weight.shape[0]
    local = tokens - tp.rank * rows
    inside = (local >= 0) & (local < rows)
    out = F.embedding(torch.where(inside, local, 0), p.weight) * inside.unsqueeze(-1).to(p.weight.dtype)
    return tp_reduce(out, tp)

"""Token embedding: `EmbeddingParams` (weight [V, E]) and `embed()`."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

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


def embed(p: EmbeddingParams, tokens: Tensor) -> Tensor:
    """tokens: [...] int -> [..., E]."""
    return F.embedding(tokens, p.weight)

"""Vectorised per-request sampling without host syncs: greedy, temperature, top-k, top-p.

Order (as vLLM and HF): temperature scales the logits, then top-k, then top-p filter, then a categorical
draw by the exponential trick `argmax(p / E)`, E ~ Exp(1) (gpt-fast's sync-free multinomial). Rows with
temperature 0 take the argmax of the raw logits. The noise is an explicit input, so results are reproducible
from a seeded generator and the function has no hidden RNG state.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from astrai.tree import pytree


@pytree
@attrs.frozen(eq=False)
class SamplingTensors:
    """Per-request sampling settings, one row per request.

    Attributes:
        temperature: [B] float; 0 means greedy.
        top_k: [B] int; 0 means no top-k filter.
        top_p: [B] float in (0, 1]; 1 means no nucleus filter.
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor


def sampling_tensors(
    batch: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, device: torch.device | str = "cpu"
) -> SamplingTensors:
    """The same settings for `batch` requests (validated on the host)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return SamplingTensors(
        temperature=torch.full((batch,), float(temperature), device=device),
        top_k=torch.full((batch,), int(top_k), dtype=torch.int64, device=device),
        top_p=torch.full((batch,), float(top_p), device=device),
    )


def filter_logits(logits: Tensor, s: SamplingTensors) -> Tensor:
    """Temperature-scaled logits with everything outside top-k / top-p set to -inf.

    Args:
        logits: [B, V] float32.
        s: settings (greedy rows are scaled by 1 and filtered like the others; `sample` ignores them).
    """
    temp = torch.where(s.temperature > 0, s.temperature, torch.ones_like(s.temperature))
    scaled = logits / temp[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(s.top_k > 0, s.top_k, torch.full_like(s.top_k, logits.shape[-1]))
    drop = rank >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does
    drop |= (probs.cumsum(dim=-1) - probs) >= s.top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def sample(logits: Tensor, s: SamplingTensors, noise: Tensor) -> Tensor:
    """Next token per row.

    Args:
        logits: [B, V] float32.
        s: per-request settings.
        noise: [B, V] Exp(1) samples (e.g. `torch.empty_like(logits).exponential_(generator=g)`).

    Returns:
        [B] int64 token ids.
    """
    probs = filter_logits(logits, s).softmax(dim=-1)
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(s.temperature > 0, drawn, logits.argmax(dim=-1))

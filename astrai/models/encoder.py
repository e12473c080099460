"""Embedding encoder: the decoder's blocks run bidirectionally over padded rows, then pooled into one vector.

`encode` reuses `DecoderParams` as they are (the LM head is simply not used), so every decoder checkpoint that
`astrai.load` reads is also an encoder; there is no separate checkpoint format. How a vector is made from the
per-token states is chosen at call time with `EncoderConfig` (pooling and normalisation), never stored:

- attention is bidirectional (no causal mask); padded keys are never attended (`attention_mask`, rows padded on
  the right, positions 0..len-1 for the real tokens);
- the final RMSNorm runs on every token, then pooling: `mean` (masked mean, denominator clamped to >= 1),
  `cls` (position 0) or `last` (the last real token of each row);
- `normalize` divides each vector by its L2 norm (cosine similarity becomes a dot product).

Pooling and normalisation run in float32 and the result is float32 whatever the parameter dtype.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams, hidden_states
from astrai.nn.norm import rms_norm

Pooling = Literal["mean", "cls", "last"]
POOLINGS: tuple[str, ...] = ("mean", "cls", "last")


def _check_pooling(_inst: object, _attr: object, value: str) -> None:
    if value not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}; got {value!r}")


@attrs.frozen(kw_only=True)
class EncoderConfig:
    """How an encoder turns per-token states into one vector per row."""

    pooling: Pooling = attrs.field(default="mean", validator=_check_pooling)
    """mean: masked mean over real tokens; cls: the first token; last: the last real token of each row."""
    normalize: bool = True
    """Divide each vector by its L2 norm."""


def _mask(tokens: Tensor, attention_mask: Tensor | None) -> Tensor:
    """[B, T] bool mask of real tokens, validated (right padding only)."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
    if attention_mask is None:
        return torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    if attention_mask.shape != tokens.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != tokens shape {tuple(tokens.shape)}")
    mask = attention_mask.to(device=tokens.device).bool()
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("attention_mask must pad on the right (each row: ones, then zeros)")
    return mask


def token_states(params: DecoderParams, cfg: ModelConfig, tokens: Tensor, attention_mask: Tensor | None = None,
                 *, causal: bool = False) -> Tensor:  # fmt: skip
    """[B, T, E] final-normed per-token states, bidirectional by default (padded positions hold junk)."""
    mask = _mask(tokens, attention_mask)
    pad = None if bool(mask.all()) else mask  # no mask: the fast SDPA path
    x = hidden_states(params, cfg, tokens, causal=causal, key_padding_mask=pad)
    return rms_norm(params.norm, x, eps=cfg.rms_norm_eps)


def pool(states: Tensor, attention_mask: Tensor | None, enc: EncoderConfig) -> Tensor:
    """[B, T, E] states -> [B, E] float32 vectors by `enc.pooling`, L2-normalised when `enc.normalize`."""
    h = states.float()
    mask = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device) if attention_mask is None else attention_mask
    m = mask.to(h.device, torch.float32)  # [B, T]
    if enc.pooling == "mean":
        out = (h * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1.0)
    elif enc.pooling == "cls":
        out = h[:, 0]
    else:  # last real token (right padding); an empty row falls back to position 0
        last = (m.sum(1).long() - 1).clamp(min=0)
        out = h[torch.arange(h.shape[0], device=h.device), last]
    return F.normalize(out, dim=-1) if enc.normalize else out


def encode(params: DecoderParams, cfg: ModelConfig, tokens: Tensor, attention_mask: Tensor | None = None, *,
           enc: EncoderConfig = EncoderConfig()) -> Tensor:  # fmt: skip
    """Embed each row of `tokens` ([B, T], right-padded; `attention_mask` [B, T], 1 for real tokens) -> [B, E].

    The decoder blocks run bidirectionally with padded keys hidden, then the final norm and `enc`'s pooling.
    """
    mask = _mask(tokens, attention_mask)
    return pool(token_states(params, cfg, tokens, mask), mask, enc)

"""Rotary position embedding: `RopeConfig`, frequency schedules and per-token cos/sin.

Schedules (same formulas as transformers' `modeling_rope_utils`): default, linear (position interpolation),
dynamic (NTK-aware base growth past the trained context), llama3 (wavelength-banded scaling) and yarn
(NTK-by-parts ramp + attention temperature). Rotation itself (half or interleaved layout) is applied by
`astrai.ops.rotary` so CUDA can use the Triton kernel.

Frequencies are computed with the same float32 torch ops as HF (so logits match), from config constants only:
compiled graphs fold them. The dynamic schedule depends on the longest position in the call and is computed
in-graph without a host sync. Not supported: longrope, partial rotary (rotary dim < head dim).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import attrs
import torch
from torch import Tensor

RopeType = Literal["default", "linear", "dynamic", "llama3", "yarn"]
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")


@attrs.frozen(kw_only=True)
class RopeConfig:
    """Rotary position embedding parameters (HF `rope_parameters` / `rope_scaling` semantics)."""

    rope_type: RopeType = "default"
    """Frequency schedule: default, linear (position interpolation), dynamic (NTK), llama3, yarn."""
    theta: float = 10000.0
    """Base wavelength."""
    factor: float = 1.0
    """Context-extension factor (linear, dynamic, llama3, yarn)."""
    original_max_position_embeddings: int | None = None
    """Pretraining context length (llama3, yarn); None means max_position_embeddings."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original/low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original/high_freq_factor are untouched."""
    beta_fast: float = 32.0
    """yarn: extrapolation boundary (rotations)."""
    beta_slow: float = 1.0
    """yarn: interpolation boundary (rotations)."""
    mscale: float | None = None
    """yarn: attention-temperature numerator scale (DeepSeek)."""
    mscale_all_dim: float | None = None
    """yarn: attention-temperature denominator scale (DeepSeek)."""
    attention_factor: float | None = None
    """yarn: explicit cos/sin scale; None derives it from factor and mscale."""
    truncate: bool = True
    """yarn: round the correction range to whole dimensions."""
    interleaved: bool = False
    """Rotate adjacent pairs (GPT-J/DeepSeek layout) instead of halves (HF/NeoX layout)."""


def _base_inv_freq(theta: float | Tensor, dim: int) -> Tensor:
    # float32 exponent as HF computes it: theta ** (arange(0, dim, 2) / dim)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponent)


def _llama3_inv_freq(rope: RopeConfig, dim: int, max_pos: int) -> Tensor:
    inv_freq = _base_inv_freq(rope.theta, dim)
    old_ctx = rope.original_max_position_embeddings or max_pos
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, max_pos: int) -> tuple[Tensor, float]:
    factor, base = rope.factor, rope.theta
    orig = rope.original_max_position_embeddings or max_pos
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency per dimension
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_pos: int) -> tuple[Tensor, float]:
    """Inverse frequencies [D/2] (float32, CPU) and the cos/sin scale of a static schedule.

    Pure torch ops on constants, so compiled graphs fold them; the dynamic schedule returns its unscaled
    (short-context) frequencies here and grows them in `rope_cos_sin`.
    """
    if rope.rope_type in ("default", "dynamic"):
        return _base_inv_freq(rope.theta, head_dim), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(rope.theta, head_dim) / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, head_dim, max_pos), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, max_pos)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}; supported: {ROPE_TYPES}")


@functools.lru_cache(maxsize=64)
def _device_inv_freq(rope: RopeConfig, head_dim: int, max_pos: int, device: torch.device) -> tuple[Tensor, float]:
    """`rope_inv_freq` moved to `device`, memoised: computed on the CPU like transformers, copied once."""
    inv_freq, scale = rope_inv_freq(rope, head_dim, max_pos)
    return inv_freq.to(device), scale


def _dynamic_inv_freq(rope: RopeConfig, dim: int, max_pos: int, positions: Tensor) -> Tensor:
    # NTK base growth from the longest position of this call; below max_pos the base is unchanged.
    seq_len = torch.clamp(positions.max() + 1, min=max_pos).to(torch.float32)
    base = rope.theta * ((rope.factor * seq_len / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).to(torch.float32) / dim
    return 1.0 / (base**exponent)


def rope_cos_sin(
    positions: Tensor, *, rope: RopeConfig, head_dim: int, max_position_embeddings: int
) -> tuple[Tensor, Tensor]:
    """Per-token rotation tables.

    Args:
        positions: [N] int positions of the tokens.
        rope: the schedule.
        head_dim: D, the rotary dimension.
        max_position_embeddings: the model's context length (dynamic-NTK threshold, default original length).

    Returns:
        (cos, sin): [N, D/2] float32, already multiplied by the schedule's attention scale.
    """
    if rope.rope_type == "dynamic":
        inv_freq, scale = _dynamic_inv_freq(rope, head_dim, max_position_embeddings, positions), 1.0
    elif torch.compiler.is_compiling():  # traced: constants the graph folds
        inv_freq, scale = rope_inv_freq(rope, head_dim, max_position_embeddings)
        inv_freq = inv_freq.to(positions.device)
    else:  # eager: no host-to-device copy per call (a CUDA graph capture forbids one)
        inv_freq, scale = _device_inv_freq(rope, head_dim, max_position_embeddings, positions.device)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin

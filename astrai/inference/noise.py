"""Sampling noise: Exp(1) draws from a counter-based integer hash of (seed, step, token index).

A row's noise depends only on its own seed and step, never on the other rows, their order, the batch size or
the device: a seeded request samples the same tokens whatever else shares its batch. No `torch.Generator`, no
host sync; it compiles with `fullgraph=True`.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """`x * c mod 2^32` for x in [0, 2^32), as 16-bit halves so no int64 product overflows (which is UB in C)."""
    lo = (x & 0xFFFF) * c  # < 2^48
    hi = ((x >> 16) * (c & 0xFFFF)) & 0xFFFF  # only the low 16 bits of the high half survive the shift
    return (lo + (hi << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """The "lowbias32" hash from Chris Wellons' hash-prospector: a 32-bit bijection with strong avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def exponential_noise(seed: Tensor, step: Tensor, vocab_size: int) -> Tensor:
    """Exp(1) noise from a counter-based hash of (seed, step, token index).

    Integer ops only until the final log, all values kept in [0, 2^32) inside int64 tensors, so eager, compiled,
    CPU and CUDA produce the same bits up to the float `log`. A row depends only on its own seed and step.

    Args:
        seed: [B] i64 (any value; both 32-bit halves are used).
        step: [B] i64 draw counter.
        vocab_size: V.

    Returns:
        [B, V] f32 samples in [6e-8, 16.7]: no zeros, no infinities (the uniform has 23 bits plus a half).
    """
    seed, step = seed.to(torch.int64), step.to(torch.int64)
    key = _mix32((seed & _MASK32) ^ 0x9E3779B9)
    key = _mix32(key ^ ((seed >> 32) & _MASK32))
    key = _mix32(key ^ (step & _MASK32))
    key = _mix32(key ^ ((step >> 32) & _MASK32))  # [B]
    key2 = _mix32(key ^ 0x85EBCA6B)
    index = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    bits = _mix32(_mix32(index[None, :] ^ key2[:, None]) ^ key[:, None])  # [B, V] in [0, 2^32)
    # the top 23 bits + 0.5 are exact in f32 and give u in (0, 1) strictly: u = 1 would make E = 0 and p / E = inf
    u = ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(u)

"""Step functions: one prefill/extend step and one decode step over ragged batches, plus `compile_step`.

Pure functions of (params, tokens, metadata, cache); the only side effect is the in-place KV write. `cfg` is
bound with `functools.partial` before compiling. On CUDA decode compiles with `mode="reduce-overhead"` (CUDA
graphs) for fixed batch buckets; on CPU the default inductor mode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams, forward
from astrai.ops.attention import AttnMeta, KVCache, LatentCache
from astrai.ops.collectives import TensorParallel


def prefill_step(
    params: DecoderParams,
    tokens: Tensor,
    meta: AttnMeta,
    cache: KVCache | LatentCache,
    logits_positions: Tensor,
    *,
    cfg: ModelConfig,
    tp: TensorParallel | None = None,
) -> Tensor:
    """Write the new tokens' K/V and return logits of the rows to sample.

    Args:
        tokens: [T] flattened new tokens of all requests.
        meta: step metadata (cached prefix + new tokens per request).
        cache: the KV pool (written in place).
        logits_positions: [M] rows of `tokens` to compute logits for (usually each request's last token).
        tp: this rank's tensor-parallel group when `params` is its shard and `cfg` its local config.

    Returns:
        [M, V] float32 logits.
    """
    return forward(params, cfg, tokens, meta=meta, cache=cache, logits_positions=logits_positions, tp=tp)


def decode_step(
    params: DecoderParams,
    tokens: Tensor,
    meta: AttnMeta,
    cache: KVCache | LatentCache,
    *,
    cfg: ModelConfig,
    tp: TensorParallel | None = None,
) -> Tensor:
    """One token per request: tokens [B] -> logits [B, V] (float32)."""
    return forward(params, cfg, tokens, meta=meta, cache=cache, tp=tp)


def compile_step(fn: Callable[..., Any], *, cfg: ModelConfig, mode: str | None = None, **kwargs: Any) -> Callable:
    """`torch.compile(partial(fn, cfg=cfg), fullgraph=True)`; `mode` e.g. "reduce-overhead" for CUDA graphs."""
    return torch.compile(functools.partial(fn, cfg=cfg), fullgraph=True, mode=mode, **kwargs)

"""Step functions: one prefill/extend step and one decode step over ragged batches, plus `compile_step`.

Pure functions of (params, tokens, metadata, cache); the only side effect is the in-place KV write. `cfg` is
bound before compiling (`compile_step`). On CUDA decode compiles with `mode="reduce-overhead"` (CUDA
graphs) for fixed batch buckets; on CPU the default inductor mode.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams, forward
from astrai.nn.lora_slots import bind_slots
from astrai.ops.attention import AttnMeta, KVCache, LatentCache
from astrai.ops.collectives import TensorParallel


class LoRARows(NamedTuple):
    """Which adapter slot each row of a step uses (multi-LoRA serving, `astrai.nn.lora_slots`): `slot_ids` [rows]
    (-1: none); for a prefill step also its segments (a request's tokens share a slot) for the GPU kernel."""

    slot_ids: Tensor
    seg_starts: Tensor | None = None
    seg_slots: Tensor | None = None


def prefill_step(
    params: DecoderParams,
    tokens: Tensor,
    meta: AttnMeta,
    cache: KVCache | LatentCache,
    logits_positions: Tensor,
    *,
    cfg: ModelConfig,
    tp: TensorParallel | None = None,
    lora: LoRARows | None = None,
) -> Tensor:
    """Write the new tokens' K/V and return logits of the rows to sample.

    Args:
        tokens: [T] flattened new tokens of all requests.
        meta: step metadata (cached prefix + new tokens per request).
        cache: the KV pool (written in place).
        logits_positions: [M] rows of `tokens` to compute logits for (usually each request's last token).
        tp: this rank's tensor-parallel group when `params` is its shard and `cfg` its local config.
        lora: multi-LoRA serving (`params` holds adapter slots): each token's slot, and the prefill segments.

    Returns:
        [M, V] float32 logits.
    """
    if lora is not None:
        params = bind_slots(params, *lora)
    return forward(params, cfg, tokens, meta=meta, cache=cache, logits_positions=logits_positions, tp=tp)


def decode_step(
    params: DecoderParams,
    tokens: Tensor,
    meta: AttnMeta,
    cache: KVCache | LatentCache,
    *,
    cfg: ModelConfig,
    tp: TensorParallel | None = None,
    lora: LoRARows | None = None,
) -> Tensor:
    """One token per request: tokens [B] -> logits [B, V] (float32); `lora`: each row's adapter slot."""
    if lora is not None:
        params = bind_slots(params, *lora)
    return forward(params, cfg, tokens, meta=meta, cache=cache, tp=tp)


_PARAM_SOURCE = re.compile(r"(type\()?params\b")  # guards on the `params` argument or its node types


def without_param_guards(entries: Sequence[Any]) -> list[bool]:
    """A Dynamo guard filter (`torch.compile(options={"guard_filter_fn": ...})`) that drops every guard on the
    `params` argument: its tensors' dtype/shape/stride, its node types and static fields. Evaluating them cost
    ~0.6 ms per call for a 30-layer model (~1,240 of a decode step's ~1,720 guards; docs/benchmarks.md), paid by
    every CPU decode step and every compiled prefill step. Only for callers that check a new tree themselves
    before passing it: the engine (`layout.layout_difference`, from `Engine.update_params` and
    `ModelRunner.set_model`)."""
    return [not _PARAM_SOURCE.match(entry.name) for entry in entries]


# The `torch.compile` options of the engine's compiled steps. Besides the parameters' guards, they drop the
# size/stride/alignment asserts inductor's Python wrapper makes on every graph input and opaque op output each
# call (~370 asserts for a 30-layer decode step, ~0.25 ms on the CPU; docs/benchmarks.md). They re-check what is
# already checked: the parameters by the engine's layout check, every other input by Dynamo's guards, and the
# custom ops' outputs by their fakes, which `opcheck` holds against the real kernels.
SERVED_STEP_OPTIONS: dict[str, Any] = {
    "guard_filter_fn": without_param_guards,
    "size_asserts": False,
    "alignment_asserts": False,
}


def compile_step(fn: Callable[..., Any], *, cfg: ModelConfig, mode: str | None = None, **kwargs: Any) -> Callable:
    """`fn` with `cfg` bound, under `torch.compile(fullgraph=True)`; `mode` e.g. "reduce-overhead" for CUDA graphs.

    `fn` runs from a private copy of its code object. Dynamo keeps compiled graphs, and counts recompiles
    against `recompile_limit` (8), per code object: with the shared one, every engine in the process (each
    model config, each shape specialisation) would draw on the same 8, and with `fullgraph=True` the ninth
    compile raises `FailOnRecompileLimitHit`. A copy gives each compiled step its own cache and limit.
    """
    private = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    # `cfg` bound as a keyword default rather than by `functools.partial`: Dynamo runs every partial through one
    # shared wrapper function, whose code object would again hold every step's graphs
    private.__kwdefaults__, private.__qualname__ = {**(fn.__kwdefaults__ or {}), "cfg": cfg}, fn.__qualname__
    if "options" in kwargs:  # a copy: torch.compile pops "guard_filter_fn" from the dict it is given, so a shared
        kwargs["options"] = dict(kwargs["options"])  # one (SERVED_STEP_OPTIONS) lost it after its first compile
    return torch.compile(private, fullgraph=True, mode=mode, **kwargs)

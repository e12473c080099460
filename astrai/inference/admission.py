"""What `Engine.submit` checks before a request is queued: its prompt as token ids, and every bound the engine can
test without running a step (vocabulary, sampling values, context length, KV pool size, queue size, policy).

Each failure is an `EngineInputError` naming the request field at fault, raised on the submitting thread, so a
bad request never reaches the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from astrai.inference.engine_config import EngineConfig
from astrai.inference.errors import EngineInputError
from astrai.inference.params import SamplingParams
from astrai.io.model import Model
from astrai.ops.attention import pages_needed


def encode_prompt(model: Model, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a text prompt (the tokenizer's `encode_prompt`: special tokens added, one BOS) or of ids."""
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise EngineInputError("this model has no tokenizer: pass token ids", param="prompt")
        return model.tokenizer.encode_prompt(prompt)  # rendered template text keeps one BOS
    return [int(t) for t in prompt]


def check_request(ids: list[int], params: SamplingParams, config: EngineConfig, *, max_model_len: int,
                  num_pages: int, vocab_size: int) -> None:  # fmt: skip
    """Raise `EngineInputError` for a request this engine cannot serve (see the module docstring)."""
    params.check(vocab_size)
    if not ids:
        raise EngineInputError("the prompt is empty", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise EngineInputError(f"prompt token ids outside [0, {vocab_size}): {bad[:5]}", param="prompt")
    if params.priority and (policy := config.scheduling_policy) != "priority":
        raise EngineInputError("priority needs the priority scheduling policy (astrai serve --scheduling-policy "
                               f"priority); this engine's is {policy!r}", param="priority")  # fmt: skip
    if params.n > config.max_waiting:
        raise EngineInputError(f"n={params.n} is more sequences than the engine's whole waiting queue "
                               f"(max_waiting={config.max_waiting})", param="n")  # fmt: skip
    total = len(ids) + params.max_tokens
    if total > max_model_len:
        raise EngineInputError(f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: {total} "
                               f"tokens, more than the model's context of {max_model_len} tokens",
                               param="max_tokens")  # fmt: skip
    pages = pages_needed(total, config.page_size)
    if pages > num_pages - 1:
        raise EngineInputError(f"the request needs {pages} KV pages but the pool has {num_pages - 1}; "
                               "raise kv_budget_tokens", param="max_tokens")  # fmt: skip

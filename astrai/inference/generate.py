"""`astrai.generate`: batch generation on the model's cached `Engine` (`engine_cache`: one per live model, compiled
on the first call behind a spinner, reused after; `release_engines` frees it).

For serving or streaming, keep your own `Engine` (background thread, shared KV across requests).
Prompts are never truncated: a prompt plus `max_tokens` beyond the model's context is rejected with both numbers.

Text prompts are encoded by `Tokenizer.encode_prompt`: the tokenizer's post-processor runs (a leading BOS where the
model has one), except that a prompt whose text already opens with the BOS token (chat-template output of Llama-3-style
templates, which render `<|begin_of_text|>` themselves) does not get a second one. transformers
(`tokenizer(text)`) and vLLM's completions (`add_special_tokens` true by default) would add it; a doubled BOS is
never what was meant, and it changes the model's output. `astrai.chat` (`astrai.inference.chat`) renders the
template and encodes it without the post-processor, as transformers' `apply_chat_template(tokenize=True)` and
vLLM's chat route do.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from astrai.inference import engine_cache
from astrai.inference.outputs import Completion
from astrai.inference.params import SamplingParams
from astrai.inference.speculative import SpeculativeConfig
from astrai.io.model import Model


def _prompt_ids(
    model: Model, prompts: str | Sequence[str | Sequence[int]], add_special_tokens: bool
) -> list[list[int]]:
    """Token ids per prompt; a ValueError names the prompt that is neither text nor a list of integer ids."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a string, a list of strings or a list of token-id lists, got "
                         f"{type(prompts).__name__}")  # fmt: skip
    if not prompts:
        raise ValueError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            out.append(model.tokenizer.encode_prompt(p, add_special_tokens=add_special_tokens))
            continue
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if not isinstance(p, Sequence) or isinstance(p, bytes):
            hint = " (one prompt's ids go in a list of their own: [[1, 2, 3]], not [1, 2, 3])" if _is_id(p) else ""
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}{hint}")
        bad = next((t for t in p if not _is_id(t)), None)
        if bad is not None:
            raise ValueError(f"prompts[{i}] holds {bad!r}, not an integer token id")
        out.append([operator.index(t) for t in p])
    return out


def _is_id(value: object) -> bool:
    """An int (or numpy integer), not a bool: `int()` would turn "5" and 5.7 into ids silently."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _run(model: Model, prompts: Sequence[Sequence[int]], params: SamplingParams, speculative: Any = None,
         lora: Any = None) -> list[Completion]:  # fmt: skip
    return engine_cache.run(model, prompts, params, speculative=speculative, lora=_adapter_folders(lora, len(prompts)))


def _adapter_folders(lora: Any, count: int) -> list[str | None] | None:
    """`lora` as one resolved adapter folder (or None) per prompt; a ValueError names a bad entry."""
    if lora is None:
        return None
    entries = [lora] * count if isinstance(lora, str | os.PathLike) else lora
    if not isinstance(entries, Sequence) or len(entries) != count:
        raise ValueError(f"lora must be an adapter folder, or a list of one folder (or None) per prompt: "
                         f"{count} prompt(s), got {lora!r}")  # fmt: skip
    out = []
    for i, entry in enumerate(entries):
        if entry is not None and not isinstance(entry, str | os.PathLike):
            raise ValueError(f"lora[{i}] must be a PEFT adapter folder or None, got {type(entry).__name__}")
        out.append(None if entry is None else str(Path(entry).resolve()))
    return out


def generate(
    model: Model,
    prompts: str | Sequence[str] | Sequence[Sequence[int]],
    *,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: str | Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
    add_special_tokens: bool = True,
    speculative: SpeculativeConfig | Mapping[str, Any] | str | None = None,
    lora: str | os.PathLike | Sequence[str | os.PathLike | None] | None = None,
) -> list[str]:
    """Complete each prompt (text or token ids); returns the generated text per prompt.

    For a conversation, `astrai.chat` applies the model's chat template; passing template text rendered by hand
    (`model.tokenizer.apply_chat_template(messages)`) here gives the same ids: see `Tokenizer.encode_prompt`.

    The first call on a model builds an engine for it and compiles its decode step (seconds, behind a spinner on
    stderr); later calls on the same `Model` object reuse that engine, sized up when a call needs more, and read
    the model's current weights (changed in place or not). `astrai.release_engines` frees it before the model
    is garbage-collected.

    Args:
        model: a loaded model with a tokenizer.
        prompts: a string, a list of strings, or a list of token-id lists.
        max_tokens: most new tokens per prompt.
        temperature: 0 for greedy decoding; otherwise the softmax temperature.
        top_k: keep the k most likely tokens (0: off).
        top_p: nucleus mass (1: off).
        seed: seed of the sampling noise (reproducible output).
        stop: a stop string or several (the text ends before them).
        stop_token_ids: ids that end a completion; None means the model's eos ids.
        add_special_tokens: text prompts: run the tokenizer's post-processor (a leading BOS), never doubling a
            BOS the text already starts with (`Tokenizer.encode_prompt`); False: encode the text as it is.
        speculative: speculative decoding (`SpeculativeConfig`, or vLLM's `--speculative-config` JSON as a dict or
            string, e.g. `{"method": "ngram", "num_speculative_tokens": 4}`): the same text, fewer forwards when
            the output repeats its prompt (the engine is rebuilt when this changes between calls).
        lora: a LoRA adapter folder (PEFT format, as `astrai train --lora` saves it) for every prompt, or a list
            of one folder or None (the base model) per prompt: one batch mixes them (multi-LoRA serving,
            docs/inference.md). Each folder is read once per engine, again when its weights file changes.

    Returns:
        the completion text per prompt (special tokens left out), in prompt order; a single string prompt gives
        a one-element list.

    Raises:
        ValueError: a prompt that is neither text nor a list of integer ids (named by its index; a flat list of
            ids is one prompt too few brackets), ids outside the vocabulary, or a prompt plus `max_tokens` longer
            than the model's context.
    """
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer: use generate_ids with token-id prompts")
    params = _params(max_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids)
    ids = _prompt_ids(model, prompts, add_special_tokens)
    return [c.outputs[0].text for c in _run(model, ids, params, speculative, lora)]


def generate_ids(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    lora: str | os.PathLike | Sequence[str | os.PathLike | None] | None = None,
) -> list[list[int]]:
    """Generated token ids per prompt, the final stop token excluded; arguments and engine reuse as `generate`.

    Args:
        model: a loaded model (no tokenizer needed).
        prompts: token-id lists.
        max_tokens, temperature, top_k, top_p, seed, stop_token_ids, lora: as `generate`.

    Returns:
        the new ids per prompt, in prompt order.
    """
    params = _params(max_tokens, temperature, top_k, top_p, seed, (), stop_token_ids)
    out = []
    for completion in _run(model, _prompt_ids(model, prompts, True), params, lora=lora):
        result = completion.outputs[0]
        ids = list(result.token_ids)
        if result.finish_reason == "stop" and ids:
            ids = ids[:-1]
        out.append(ids)
    return out


def _params(max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None, stop: str | Sequence[str],
            stop_token_ids: Sequence[int] | None) -> SamplingParams:  # fmt: skip
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
        stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=stop_token_ids is not None,
    )  # fmt: skip

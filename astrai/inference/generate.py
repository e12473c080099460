"""Batch generation over the paged KV cache: one ragged prefill, then decode steps until every request stops.

This is the simple, static-batch loop behind `astrai.generate` (all requests start together; finished rows
leave the batch). The continuous-batching engine replaces it for serving. Prompts are never truncated: a
prompt plus `max_tokens` beyond the model's context is rejected with both numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from astrai.inference.cache import init_kv_cache, logits_rows, make_attn_meta, pages_needed
from astrai.inference.sampling import SamplingTensors, sample, sampling_tensors
from astrai.inference.step import decode_step, prefill_step
from astrai.io.model import Model
from astrai.tree import tree_map


def _check_prompts(model: Model, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not prompts:
        raise ValueError("no prompts given")
    limit = model.config.max_position_embeddings
    vocab = model.config.vocab_size
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens + max_tokens {max_tokens} = {len(ids) + max_tokens}, "
                f"more than the model's context of {limit} tokens"
            )
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")


def stream_ids(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    page_size: int = 16,
) -> Iterator[tuple[int, int, bool]]:
    """Generate and yield `(request_index, token_id, finished)` as tokens are sampled.

    A stop token is yielded (with finished=True) but is not part of the text. `stop_token_ids` defaults to the
    model's eos ids.
    """
    _check_prompts(model, prompts, max_tokens)
    cfg, device = model.config, model.device
    stops = set(model.eos_token_ids if stop_token_ids is None else stop_token_ids)
    pages, next_page = [], 1  # page 0 is the null page
    for ids in prompts:
        count = pages_needed(len(ids) + max_tokens, page_size)
        pages.append(list(range(next_page, next_page + count)))
        next_page += count
    cache = init_kv_cache(cfg, next_page, page_size, dtype=model.dtype, device=device)
    settings = sampling_tensors(len(prompts), temperature=temperature, top_k=top_k, top_p=top_p, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed())
    lens = [len(ids) for ids in prompts]
    with torch.inference_mode():
        meta = make_attn_meta(pages, [0] * len(prompts), lens, page_size=page_size, device=device)
        tokens = torch.tensor([t for ids in prompts for t in ids], device=device)
        logits = prefill_step(model.params, tokens, meta, cache, logits_rows(meta), cfg=cfg)
        active, produced = list(range(len(prompts))), [0] * len(prompts)
        while True:
            rows = torch.tensor(active, device=device)
            noise = torch.empty_like(logits).exponential_(generator=gen)
            chosen = sample(logits, _select(settings, rows), noise).tolist()
            still = []
            for row, token in zip(active, chosen, strict=True):
                produced[row] += 1
                done = token in stops or produced[row] == max_tokens
                yield row, token, done
                if not done:
                    still.append((row, token))
            if not still:
                return
            active = [row for row, _ in still]
            cached = [lens[row] + produced[row] - 1 for row in active]
            meta = make_attn_meta(
                [pages[row] for row in active],
                cached,
                [1] * len(active),
                page_size=page_size,
                device=device,
                decode=True,
            )
            tokens = torch.tensor([token for _, token in still], device=device)
            logits = decode_step(model.params, tokens, meta, cache, cfg=cfg)


def _select(settings: SamplingTensors, rows: torch.Tensor) -> SamplingTensors:
    return tree_map(lambda t: t[rows], settings)


def generate_ids(model: Model, prompts: Sequence[Sequence[int]], **kwargs) -> list[list[int]]:
    """Generated token ids per prompt (stop tokens excluded). Keyword arguments as `stream_ids`."""
    stops = set(model.eos_token_ids if kwargs.get("stop_token_ids") is None else kwargs["stop_token_ids"])
    out: list[list[int]] = [[] for _ in prompts]
    for row, token, done in stream_ids(model, prompts, **kwargs):
        if not (done and token in stops):
            out[row].append(token)
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
    stop_token_ids: Sequence[int] | None = None,
) -> list[str]:
    """Complete each prompt (text or token ids) and return the generated text per prompt.

    Args:
        model: a loaded model with a tokenizer.
        prompts: a string, a list of strings, or a list of token-id lists.
        max_tokens: most new tokens per prompt.
        temperature: 0 for greedy; otherwise the softmax temperature.
        top_k: keep the k most likely tokens (0: off).
        top_p: nucleus mass (1: off).
        seed: seed of the sampling noise (reproducible output).
        stop_token_ids: ids that end a completion (default: the model's eos ids).
    """
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer: pass token ids to generate_ids instead")
    if isinstance(prompts, str):
        prompts = [prompts]
    ids = [model.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    outs = generate_ids(
        model,
        ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_token_ids=stop_token_ids,
    )
    return [model.tokenizer.decode(o) for o in outs]

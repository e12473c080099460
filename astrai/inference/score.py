"""Prompt log-probs: log p(token_t | tokens_<t) for every token of a prompt, with the top alternatives.

What `/v1/completions` returns for `echo: true` + `logprobs: N` (lm-eval's `local-completions` loglikelihood
requests, vLLM's `prompt_logprobs`), and what evaluation scores with. One causal forward per prompt (no KV cache,
no prefix sharing: the engine's pool stays free for generation), then the final norm, the LM head and the
log-softmax walk the positions `chunk_size` at a time, so at most one fp32 [chunk_size, V] block exists however
long the prompt is (a 32k-token prompt at a 150k vocabulary would otherwise need 19 GB).

The first token has no log-prob (nothing predicts it): its entries are None, as in OpenAI's legacy shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from astrai.io.model import Model
from astrai.models.decoder import head_logits, hidden_states
from astrai.nn.norm import rms_norm


@attrs.frozen
class PromptLogprobs:
    """Per-token scores of one prompt (position t scores token t given the tokens before it).

    Attributes:
        token_ids: the prompt.
        logprobs: None for the first token, then log p(token_t | tokens_<t) as floats.
        top_logprobs: None for the first token, then the `top` most likely `(id, logprob)` at each position,
            best first (empty tuples when `top` is 0).
        ranks: None for the first token, then token_t's rank in the vocabulary at its position (1: the most
            likely; tokens of equal log-prob share the better rank), as vLLM's `Logprob.rank`.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...]
    ranks: tuple[int | None, ...] = ()


@torch.inference_mode()
def prompt_logprobs(model: Model, prompts: Sequence[Sequence[int]], *, top: int = 0,
                    chunk_size: int = 1024) -> list[PromptLogprobs]:  # fmt: skip
    """Score every token of each prompt under `model` (causal, fp32 log-softmax).

    Args:
        model: a loaded model.
        prompts: token-id lists (each at least one token, ids below the vocabulary size).
        top: alternatives per position (0: none).
        chunk_size: positions per LM-head block (bounds the fp32 logits held at once).

    Raises:
        ValueError: an empty prompt, an id outside the vocabulary, or a prompt longer than the model's context.
    """
    cfg, params = model.config, model.params
    if top < 0 or top > cfg.vocab_size:
        raise ValueError(f"top must be in [0, {cfg.vocab_size}], got {top}")
    out = []
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if min(ids) < 0 or max(ids) >= cfg.vocab_size:
            raise ValueError(f"prompt {i} holds a token id outside [0, {cfg.vocab_size})")
        if len(ids) > cfg.max_position_embeddings:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than the model's context "
                             f"({cfg.max_position_embeddings})")  # fmt: skip
        tokens = torch.tensor([ids], dtype=torch.long, device=model.device)
        h = hidden_states(params, cfg, tokens)[0, :-1]  # position t predicts token t + 1
        targets = tokens[0, 1:]
        lps, ranks, tops = [], [], []
        for start in range(0, h.shape[0], chunk_size):
            x = rms_norm(params.norm, h[start : start + chunk_size], eps=cfg.rms_norm_eps)
            logp = torch.log_softmax(head_logits(params, x), dim=-1)
            picked = logp.gather(1, targets[start : start + chunk_size, None])
            lps.append(picked[:, 0].cpu())
            ranks.append((logp > picked).sum(dim=-1).add_(1).cpu())
            if top:
                values, indices = logp.topk(top, dim=-1)
                tops.append((indices.cpu(), values.cpu()))
        chosen = torch.cat(lps).tolist() if lps else []
        rank = torch.cat(ranks).tolist() if ranks else []
        alternatives: list = []
        for indices, values in tops:
            alternatives += [tuple(zip(r, v, strict=True)) for r, v in zip(indices.tolist(), values.tolist(),
                                                                            strict=True)]  # fmt: skip
        if not top:
            alternatives = [()] * len(chosen)
        out.append(PromptLogprobs(tuple(ids), (None, *chosen), (None, *alternatives), (None, *rank)))
    return out

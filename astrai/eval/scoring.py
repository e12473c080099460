"""Batched causal scoring: the log-probability of chosen tokens of many sequences, padding-safe and memory-bounded.

A `Request` is a token sequence and the index of its first scored token: `score` returns
log p(tokens[i] | tokens[:i]) for every i >= start (and whether tokens[i] is the argmax there). This is what
perplexity (the new tokens of a window), multiple choice (the answer letter after the prompt) and IFD (the
answer after the instruction) need.

How:
- Rows are sorted longest first (the first batch shows an out-of-memory error at once, and rows of similar
  length share a batch) and right-padded. The forward is the dense causal decoder (`hidden_states` with positions
  0..T-1 per row), so a real token never attends to the padding after it and a row's scores do not depend on
  what it is batched with (the reference's §11b defect was a padding mask that replaced the causal mask).
- The model sees tokens[:-1]: the last token is only a target, so a sequence of max_position_embeddings + 1
  tokens still fits.
- Only the hidden states of scored positions go through the final norm and the LM head, `chunk_size` rows at a
  time, so at most one fp32 [chunk_size, V] block exists, never [B, T, V] (152k vocab x 8 x 2048 tokens would be
  10 GB). The chunk loop is the forward of `astrai.nn.chunked_loss.token_logprobs` plus the argmax of each row
  (whether the scored token is the greedy choice, lm-eval's `is_greedy`), which that op does not return.
- `candidates`: the log-probs of a few other ids at the first scored position (the answer letters of a multiple
  choice question) from the same forward, so a 4-way question costs one row instead of four.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
from torch import Tensor

from astrai.io.model import Model
from astrai.models.decoder import head_logits, hidden_states
from astrai.nn.norm import rms_norm


@attrs.frozen
class Request:
    """A sequence to score.

    Attributes:
        tokens: the whole sequence (context, then the scored tokens).
        start: index of the first scored token, >= 1 (token 0 has no context).
        candidates: optional token ids whose log-probs at position `start` are returned too.
    """

    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    start: int
    candidates: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.start < len(self.tokens):
            raise ValueError(
                f"start must be in [1, {len(self.tokens)}) for {len(self.tokens)} tokens, got {self.start}"
            )


@attrs.frozen(eq=False)
class Scores:
    """The scores of one request (CPU tensors).

    Attributes:
        logprobs: [N] fp32 log p(tokens[start + i] | tokens[:start + i]).
        greedy: [N] bool, whether each scored token is the argmax of its distribution.
        candidates: [K] fp32 log-probs of the request's candidate ids at position `start` (empty when none).
    """

    logprobs: Tensor
    greedy: Tensor
    candidates: Tensor

    @property
    def total(self) -> float:
        """Sum of the scored log-probs (float64 accumulation)."""
        return float(self.logprobs.double().sum())

    @property
    def count(self) -> int:
        """Number of scored tokens."""
        return int(self.logprobs.numel())


def score(
    model: Model,
    requests: Sequence[Request],
    *,
    batch_size: int = 8,
    chunk_size: int = 512,
    advance: Callable[[int], None] | None = None,
) -> list[Scores]:
    """Score `requests` in batches of `batch_size` rows; results in request order.

    Args:
        model: a loaded model.
        requests: the sequences; each must fit the model's context (len(tokens) - 1 positions).
        batch_size: rows per forward pass.
        chunk_size: rows of the LM head computed at once (peak extra memory about chunk_size * V * 4 bytes).
        advance: called with the number of requests done after each batch (a progress bar).

    Raises:
        ValueError: a request is longer than the model's context (its index and length given).
    """
    limit = model.config.max_position_embeddings
    for i, r in enumerate(requests):
        if len(r.tokens) - 1 > limit:
            raise ValueError(f"request {i} has {len(r.tokens)} tokens: more than the model's context of {limit} + 1")
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    out: list[Scores | None] = [None] * len(requests)
    for begin in range(0, len(order), batch_size):
        batch = order[begin : begin + batch_size]
        for i, result in zip(batch, _score_batch(model, [requests[i] for i in batch], chunk_size), strict=True):
            out[i] = result
        if advance is not None:
            advance(len(batch))
    return out  # type: ignore[return-value]


@torch.inference_mode()
def _score_batch(model: Model, batch: Sequence[Request], chunk_size: int) -> list[Scores]:
    params, cfg, device = model.params, model.config, model.device
    width = max(len(r.tokens) for r in batch) - 1
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    rows, targets, sizes, firsts = [], [], [], []
    for b, r in enumerate(batch):
        n = len(r.tokens) - 1
        ids[b, :n] = torch.tensor(r.tokens[:-1])
        if r.candidates:
            firsts.append(len(targets))  # the row of x (below) that predicts tokens[start]
        rows.append(torch.arange(r.start - 1, n) + b * width)  # flat positions predicting tokens[start:]
        targets.extend(r.tokens[r.start :])
        sizes.append(n + 1 - r.start)
    x = hidden_states(params, cfg, ids.to(device))  # [B, T, E]
    x = x.reshape(-1, x.shape[-1])[torch.cat(rows).to(device)]  # [N, E]
    x = rms_norm(params.norm, x, eps=cfg.rms_norm_eps)
    target = torch.tensor(targets, device=device)
    logp, greedy = _logprobs(x, params, target, chunk_size)
    cand = _candidates(
        params, x[torch.tensor(firsts, dtype=torch.long, device=device)], [r.candidates for r in batch if r.candidates]
    )
    out, offset, k = [], 0, 0
    for r, n in zip(batch, sizes, strict=True):
        c = torch.empty(0)
        if r.candidates:
            c, k = cand[k], k + 1
        out.append(Scores(logp[offset : offset + n], greedy[offset : offset + n], c))
        offset += n
    return out


def _head(params, x: Tensor) -> Tensor:
    """[C, E] normed hidden rows -> [C, V] fp32 logits, as `astrai.models.decoder.forward` computes them."""
    return head_logits(params, x)


def _logprobs(x: Tensor, params, target: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """([N] log p(target), [N] target is argmax), one [chunk_size, V] fp32 block at a time; on the CPU."""
    logp = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    greedy = torch.empty(x.shape[0], dtype=torch.bool, device=x.device)
    for s in range(0, x.shape[0], chunk_size):
        z = _head(params, x[s : s + chunk_size])  # [C, V]
        t = target[s : s + chunk_size, None]  # [C, 1]
        picked = z.gather(1, t)  # [C, 1]
        logp[s : s + chunk_size] = (picked - torch.logsumexp(z, dim=-1, keepdim=True)).squeeze(1)
        greedy[s : s + chunk_size] = (z.argmax(dim=-1, keepdim=True) == t).squeeze(1)
    return logp.cpu(), greedy.cpu()


def _candidates(params, x: Tensor, ids: list[tuple[int, ...]]) -> list[Tensor]:
    """Log-probs of `ids[m]` under the distribution of normed hidden row `x[m]` ([M, E], M = requests with
    candidates: at most one row per request, so the [M, V] block is small)."""
    if not ids:
        return []
    z = _head(params, x)  # [M, V]
    z = z - torch.logsumexp(z, dim=-1, keepdim=True)
    return [z[m, torch.tensor(c, device=z.device)].cpu() for m, c in enumerate(ids)]

"""The engine's sampler (device side): per-row penalties, filters and a seeded, sync-free categorical draw.

Every setting is a per-row tensor of a `SamplingBatch` (one row per request, built on the host by
`sampling_batch.make_sampling_batch`), so requests with different
settings share one call. `sample` has no `.item()`, no Python branch on tensor values, no `torch.multinomial`
and no `torch.Generator`; it compiles with `fullgraph=True`. Python branches only on structure: which optional
fields are present and two static flags (`needs_sort`, `all_greedy`) that `make_sampling_batch` derives, so
batches that don't use a feature don't pay for it (each combination is a separate compiled variant).

Processing order (`process_logits`), on float32 logits [B, V]:
0. Grammar: where `grammar_bitmask` is present, tokens its row does not allow are set to -inf (unconstrained rows
   carry all bits set; no bitmask at all when no row is constrained), before anything else.
1. `logit_bias` is added (OpenAI).
2. `min_tokens`: the row's stop ids are set to -inf while it has generated fewer than `min_tokens` tokens.
3. Repetition penalty (HF): logits of tokens seen in the prompt or the output are divided by r when positive,
   multiplied by r otherwise.
4. Frequency / presence penalties (OpenAI), over generated tokens: `logit -= f * count + p * (count > 0)`.
5. Greedy rows (temperature < `SAMPLING_EPS`, 0 included) take the argmax of *these* logits; filters below
   don't apply to them.
6. Temperature divides the logits.
7. Top-k keeps logits >= the k-th largest (ties at the boundary are kept, as transformers does).
8. Top-p keeps the most likely tokens until their mass reaches p (the smallest such set; >= 1 token).
9. Min-p keeps tokens with p >= min_p * p_max. Its result does not depend on its place after 7-8: the ratio
   p / p_max is unchanged by renormalisation.
Filtered entries are -inf. This is vLLM's and transformers' order; upstream AstrAI applied the frequency
penalty after top-k/top-p (features §11b.11).

The draw uses the exponential trick: `argmax(p / E)` with E ~ Exp(1) i.i.d. picks token i with probability p_i
(gpt-fast's `multinomial_sample_one_no_sync`). E comes from `noise.exponential_noise`, a counter-based integer hash
of (seed, step, token index), so a request's tokens depend only on its own seed and step: not on the other
rows, their order, the batch size or the device.

NaN policy: a row whose processed logits give no valid choice (NaN anywhere, from the model or from a value
that overflowed; a penalised logit that overflowed to +inf; or every logit -inf) takes the argmax of its *raw*
logits instead, NaN read as -inf (token 0 only if every raw logit is NaN or -inf), with the grammar mask applied,
so a constrained row still draws an allowed token. `SamplingParams.check`
refuses the float32 underflows that used to cause this (and treats temperatures below `SAMPLING_EPS` as greedy);
the fallback keeps a bad row from silently drawing token 0 forever. It costs a few [B, V] reductions and a
`where`: no host sync, still `fullgraph=True`.

Logprobs are `log_softmax` of the *raw* model logits (before the grammar mask, bias, penalties, temperature and
filters), as vLLM's default `logprobs_mode="raw_logprobs"`; they describe the model, not the processed distribution.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.inference.noise import exponential_noise
from astrai.inference.params import SAMPLING_EPS
from astrai.inference.sampling_batch import SamplingBatch
from astrai.tree import pytree, replace

_NEG_INF = float("-inf")


@pytree
@attrs.frozen(eq=False)
class SampleOutput:
    """What `sample` returns.

    Attributes:
        tokens: [B] i64 chosen ids.
        logprobs: [B] f32 raw-logit logprobs of `tokens`; None unless requested.
        top_ids: [B, k] i64 most likely ids under the raw logits, most likely first; None unless requested.
        top_logprobs: [B, k] f32 their logprobs; None unless requested.
    """

    tokens: Tensor
    logprobs: Tensor | None = None
    top_ids: Tensor | None = None
    top_logprobs: Tensor | None = None


# Dynamo cannot run attrs' generated __init__ (DESIGN fact F2): compiled code builds outputs with tree.replace
_OUTPUT_TEMPLATE = SampleOutput(tokens=None)  # type: ignore[arg-type]


# ---- logits processing -------------------------------------------------------------------------------------


def grammar_allowed(batch: SamplingBatch, vocab_size: int) -> Tensor | None:
    """[B, V] bool unpacked from `batch.grammar_bitmask` (True = allowed), or None without one."""
    if batch.grammar_bitmask is None:
        return None
    bits = torch.arange(32, dtype=torch.int32, device=batch.grammar_bitmask.device)
    allowed = (batch.grammar_bitmask.unsqueeze(-1) >> bits) & 1  # [B, W, 32]
    return allowed.flatten(-2)[:, :vocab_size].bool()


def penalize_logits(logits: Tensor, batch: SamplingBatch, allowed: Tensor | None = None) -> Tensor:
    """Steps 0-4 of the module docstring: grammar mask, bias, min_tokens mask, repetition, frequency/presence.

    `allowed` is `grammar_allowed(batch, V)` when the caller already has it. Returns [B, V] f32.
    """
    x = logits.float()
    if allowed is None:
        allowed = grammar_allowed(batch, x.shape[-1])
    if allowed is not None:
        x = x.masked_fill(~allowed, _NEG_INF)
    if batch.logit_bias is not None:
        x = x + batch.logit_bias
    if batch.min_tokens_mask is not None:
        x = x.masked_fill(batch.min_tokens_mask, _NEG_INF)
    seen = batch.prompt_mask
    if batch.output_counts is not None:
        generated = batch.output_counts > 0
        seen = generated if seen is None else seen | generated
    if seen is not None:
        r = batch.repetition_penalty[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if batch.output_counts is not None:
        counts = batch.output_counts.to(torch.float32)
        x = x - batch.frequency_penalty[:, None] * counts - batch.presence_penalty[:, None] * (counts > 0)
    return x


def _top_k_top_p(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf (one sort, no scatter)."""
    vocab = x.shape[-1]
    sorted_x = x.sort(dim=-1, descending=True).values  # [B, V]
    rank = torch.arange(vocab, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [B]
    in_k = rank < k[:, None]
    probs = sorted_x.masked_fill(~in_k, _NEG_INF).softmax(dim=-1)
    # mass of the strictly more likely tokens; an exclusive cumsum is monotone, so `keep` is a prefix
    before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
    # p = 1 keeps everything: the float mass can reach 1.0 before the last token and would drop the tail
    keep = in_k & ((before < top_p[:, None]) | (top_p[:, None] >= 1))
    n_keep = keep.sum(dim=-1).clamp(min=1)  # [B]
    threshold = sorted_x.gather(-1, (n_keep - 1)[:, None])  # [B, 1] smallest kept logit
    return x.masked_fill(x < threshold, _NEG_INF)


def greedy_rows(batch: SamplingBatch) -> Tensor:
    """[B] bool: rows with temperature below `SAMPLING_EPS` (greedy; a NaN temperature is not, and falls back)."""
    return batch.temperature < SAMPLING_EPS


def filter_logits(x: Tensor, batch: SamplingBatch) -> Tensor:
    """Steps 6-9: temperature, top-k, top-p, min-p on penalised logits [B, V]. Greedy rows use temperature 1."""
    temperature = torch.where(greedy_rows(batch), 1.0, batch.temperature)
    x = x / temperature[:, None]
    if batch.needs_sort:
        x = _top_k_top_p(x, batch.top_k, batch.top_p)
    # p_i >= min_p * p_max  <=>  x_i - x_max >= log(min_p); log(0) = -inf keeps everything
    x_max = x.amax(dim=-1, keepdim=True)
    return x.masked_fill(x - x_max < torch.log(batch.min_p)[:, None], _NEG_INF)


def process_logits(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The processed logits whose softmax each row samples from (order in the module docstring).

    Args:
        logits: [B, V] raw model logits (any float dtype).
        batch: per-row settings.

    Returns:
        [B, V] f32 logits, -inf where filtered. Greedy rows keep only their argmax (a point mass).
    """
    x = penalize_logits(logits, batch)
    best = x.argmax(dim=-1)  # [B]
    out = filter_logits(x, batch)
    not_best = torch.arange(x.shape[-1], device=x.device)[None, :] != best[:, None]
    return out.masked_fill(greedy_rows(batch)[:, None] & not_best, _NEG_INF)


def _raw_argmax(logits: Tensor, allowed: Tensor | None = None) -> Tensor:
    """[B] the NaN policy's fallback: argmax of the raw logits with NaN (and grammar-forbidden ids) read as -inf."""
    x = logits.float()
    bad = x.isnan() if allowed is None else x.isnan() | ~allowed
    return x.masked_fill(bad, _NEG_INF).argmax(dim=-1)


def sample(logits: Tensor, batch: SamplingBatch, *, top_logprobs: int = 0, want_logprobs: bool = False) -> SampleOutput:
    """Draw one token per row.

    Greedy rows (temperature < SAMPLING_EPS) take the argmax of the penalised logits (step 5); other rows draw
    `argmax(softmax(process_logits) / E)` with E = `exponential_noise(batch.seed, batch.step, V)`. A row left
    with no valid choice (NaN, +inf, or all -inf) takes the argmax of its raw logits (the NaN policy above).

    Args:
        logits: [B, V] raw model logits.
        batch: per-row settings (see `make_sampling_batch`).
        top_logprobs: static k: also return the k most likely ids and their logprobs (0: don't).
        want_logprobs: static: also return the chosen tokens' logprobs (implied by top_logprobs > 0).

    Returns:
        `SampleOutput`; logprobs are log_softmax of the raw `logits` (see the module docstring).
    """
    allowed = grammar_allowed(batch, logits.shape[-1])
    x = penalize_logits(logits, batch, allowed)
    best = x.argmax(dim=-1)  # [B]
    # amax propagates NaN: False for a row with any NaN, every logit -inf, or an overflow to +inf
    ok = x.amax(dim=-1).isfinite()  # [B]
    if batch.all_greedy:
        tokens = best
    else:
        greedy = greedy_rows(batch)
        probs = filter_logits(x, batch).softmax(dim=-1)  # [B, V]; NaN in a row whose filtering overflowed
        noise = exponential_noise(batch.seed, batch.step, logits.shape[-1])  # [B, V]
        tokens = torch.where(greedy, best, (probs / noise).argmax(dim=-1))
        ok = ok & (greedy | ~probs.isnan().any(dim=-1))
    tokens = torch.where(ok, tokens, _raw_argmax(logits, allowed))
    if not (want_logprobs or top_logprobs > 0):
        return replace(_OUTPUT_TEMPLATE, tokens=tokens)
    return raw_logprobs(logits, tokens, top_logprobs)


def raw_logprobs(logits: Tensor, tokens: Tensor, top_logprobs: int = 0) -> SampleOutput:
    """`tokens` [B] with their raw-logit logprobs, and the `top_logprobs` most likely ids and logprobs if > 0.

    Part of `sample`; the engine calls it eagerly after its compiled draw (`sampler_variants`), so that no
    compiled variant depends on the logprob arguments."""
    raw = logits.float().log_softmax(dim=-1)  # [B, V]
    chosen = raw.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    if top_logprobs == 0:
        return replace(_OUTPUT_TEMPLATE, tokens=tokens, logprobs=chosen)
    values, ids = raw.topk(top_logprobs, dim=-1)  # [B, k], sorted descending
    return replace(_OUTPUT_TEMPLATE, tokens=tokens, logprobs=chosen, top_ids=ids, top_logprobs=values)

"""The engine's sampler: per-row penalties, filters and a seeded, sync-free categorical draw over a batch.

Every setting is a per-row tensor of a `SamplingBatch` (one row per request), so requests with different
settings share one call. `sample` has no `.item()`, no Python branch on tensor values, no `torch.multinomial`
and no `torch.Generator`; it compiles with `fullgraph=True`. Python branches only on structure: which optional
fields are present and two static flags (`needs_sort`, `all_greedy`) that `make_sampling_batch` derives, so
batches that don't use a feature don't pay for it (each combination is a separate compiled variant).

Processing order (`process_logits`), on float32 logits [B, V]:
1. `logit_bias` is added (OpenAI).
2. `min_tokens`: the row's stop ids are set to -inf while it has generated fewer than `min_tokens` tokens.
3. Repetition penalty (HF): logits of tokens seen in the prompt or the output are divided by r when positive,
   multiplied by r otherwise.
4. Frequency / presence penalties (OpenAI), over generated tokens: `logit -= f * count + p * (count > 0)`.
5. Greedy rows (temperature == 0) take the argmax of *these* logits; filters below don't apply to them.
6. Temperature divides the logits.
7. Top-k keeps logits >= the k-th largest (ties at the boundary are kept, as transformers does).
8. Top-p keeps the most likely tokens until their mass reaches p (the smallest such set; >= 1 token).
9. Min-p keeps tokens with p >= min_p * p_max. Its result does not depend on its place after 7-8: the ratio
   p / p_max is unchanged by renormalisation.
Filtered entries are -inf. This is vLLM's and transformers' order; upstream AstrAI applied the frequency
penalty after top-k/top-p (features §11b.11).

The draw uses the exponential trick: `argmax(p / E)` with E ~ Exp(1) i.i.d. picks token i with probability p_i
(gpt-fast's `multinomial_sample_one_no_sync`). E comes from `exponential_noise`, a counter-based integer hash
of (seed, step, token index), so a request's tokens depend only on its own seed and step: not on the other
rows, their order, the batch size or the device.

Logprobs are `log_softmax` of the *raw* model logits (before bias, penalties, temperature and filters), as
vLLM's default `logprobs_mode="raw_logprobs"`; they describe the model, not the processed distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.inference.params import SamplingParams
from astrai.tree import pytree, replace, static

_MASK32 = 0xFFFFFFFF
_NEG_INF = float("-inf")


@pytree
@attrs.frozen(eq=False)
class SamplingBatch:
    """Per-row sampling settings and history, on the logits' device.

    Attributes:
        temperature: [B] f32; 0 = greedy.
        top_k: [B] i64; 0 = off.
        top_p: [B] f32 in (0, 1]; 1 = off.
        min_p: [B] f32 in [0, 1]; 0 = off.
        frequency_penalty: [B] f32 (OpenAI, over generated tokens).
        presence_penalty: [B] f32 (OpenAI, over generated tokens).
        repetition_penalty: [B] f32 > 0 (HF, over prompt and generated tokens); 1 = off.
        seed: [B] i64 per-request seed of the noise.
        step: [B] i64 per-request draw counter (the number of tokens the request has generated so far).
        logit_bias: [B, V] f32 added to the logits; None when no row uses one.
        output_counts: [B, V] i32 counts of generated tokens; None when no row uses a penalty.
        prompt_mask: [B, V] bool, tokens seen in the prompt; None when no row uses a repetition penalty.
            Repetition uses `prompt_mask | output_counts > 0` (whichever are present).
        min_tokens_mask: [B, V] bool, ids forbidden now (the stop ids of rows still under `min_tokens`); None
            when no row needs one.
        needs_sort: static; False promises that no sampled row uses top-k or top-p (skips the [B, V] sort).
        all_greedy: static; True promises that every row is greedy (skips filters and noise).
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    frequency_penalty: Tensor
    presence_penalty: Tensor
    repetition_penalty: Tensor
    seed: Tensor
    step: Tensor
    logit_bias: Tensor | None = None
    output_counts: Tensor | None = None
    prompt_mask: Tensor | None = None
    min_tokens_mask: Tensor | None = None
    needs_sort: bool = static(default=True)
    all_greedy: bool = static(default=False)


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


# ---- noise -------------------------------------------------------------------------------------------------


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


# ---- logits processing -------------------------------------------------------------------------------------


def penalize_logits(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Steps 1-4 of the module docstring: bias, min_tokens mask, repetition, frequency/presence. [B, V] f32."""
    x = logits.float()
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


def filter_logits(x: Tensor, batch: SamplingBatch) -> Tensor:
    """Steps 6-9: temperature, top-k, top-p, min-p on penalised logits [B, V]. Greedy rows use temperature 1."""
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
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
    return out.masked_fill((batch.temperature == 0)[:, None] & not_best, _NEG_INF)


def sample(logits: Tensor, batch: SamplingBatch, *, top_logprobs: int = 0, want_logprobs: bool = False) -> SampleOutput:
    """Draw one token per row.

    Greedy rows (temperature 0) take the argmax of the penalised logits (step 5); other rows draw
    `argmax(softmax(process_logits) / E)` with E = `exponential_noise(batch.seed, batch.step, V)`.

    Args:
        logits: [B, V] raw model logits.
        batch: per-row settings (see `make_sampling_batch`).
        top_logprobs: static k: also return the k most likely ids and their logprobs (0: don't).
        want_logprobs: static: also return the chosen tokens' logprobs (implied by top_logprobs > 0).

    Returns:
        `SampleOutput`; logprobs are log_softmax of the raw `logits` (see the module docstring).
    """
    x = penalize_logits(logits, batch)
    best = x.argmax(dim=-1)  # [B]
    if batch.all_greedy:
        tokens = best
    else:
        probs = filter_logits(x, batch).softmax(dim=-1)  # [B, V]
        noise = exponential_noise(batch.seed, batch.step, logits.shape[-1])  # [B, V]
        tokens = torch.where(batch.temperature == 0, best, (probs / noise).argmax(dim=-1))
    if not (want_logprobs or top_logprobs > 0):
        return replace(_OUTPUT_TEMPLATE, tokens=tokens)
    raw = logits.float().log_softmax(dim=-1)  # [B, V]
    chosen = raw.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    if top_logprobs == 0:
        return replace(_OUTPUT_TEMPLATE, tokens=tokens, logprobs=chosen)
    values, ids = raw.topk(top_logprobs, dim=-1)  # [B, k], sorted descending
    return replace(_OUTPUT_TEMPLATE, tokens=tokens, logprobs=chosen, top_ids=ids, top_logprobs=values)


# ---- host helper -------------------------------------------------------------------------------------------


def _dense(rows: Sequence[Sequence[int] | np.ndarray], vocab_size: int, dtype: torch.dtype,
           device: torch.device | str, what: str, values: Sequence[float] | None = None) -> Tensor:  # fmt: skip
    """[B, V] tensor: counts of `rows`' ids (int), their presence (bool), or `values` at them (float).

    Rows may be lists or int arrays (the engine passes `Request.prompt_array()` / `output_array()`, so the
    per-step cost is one concatenation in C, not a Python loop over every generated token).
    """
    out = torch.zeros(len(rows), vocab_size, dtype=dtype, device=device)
    lengths = [len(ids) for ids in rows]
    if not sum(lengths):
        return out
    c = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in rows])
    if c.min() < 0 or c.max() >= vocab_size:
        raise ValueError(f"{what} has token ids outside [0, {vocab_size}): min {c.min()}, max {c.max()}")
    r = np.repeat(np.arange(len(rows)), lengths)
    index = (torch.from_numpy(r).to(device), torch.from_numpy(c).to(device))
    if values is not None:
        return out.index_put_(index, torch.tensor(values, dtype=dtype, device=device))
    return out.index_put_(index, torch.ones(len(c), dtype=dtype, device=device), accumulate=dtype != torch.bool)


def _int64(value: int) -> int:
    """Wrap any Python int into the int64 range (seeds may be arbitrary ints)."""
    return (int(value) + 2**63) % 2**64 - 2**63


def make_sampling_batch(
    params: Sequence[SamplingParams],
    *,
    seeds: Sequence[int],
    steps: Sequence[int],
    vocab_size: int,
    device: torch.device | str,
    prompts: Sequence[Sequence[int] | np.ndarray] | None = None,
    outputs: Sequence[Sequence[int] | np.ndarray] | None = None,
    stop_ids: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    """Build the device tensors for one sampling call (host code; params are assumed `check`ed).

    Args:
        params: one `SamplingParams` per row.
        seeds: per-row noise seed (the engine's choice: params.seed, offset per completion when n > 1).
        steps: per-row number of tokens generated so far (the draw counter, also compared to min_tokens).
        vocab_size: V of the logits.
        device: where the tensors go.
        prompts: per-row prompt ids (needed for the repetition penalty; None = empty).
        outputs: per-row generated ids (needed for penalties; None = empty).
        stop_ids: per-row ids that end the row (the model's eos unless ignore_eos, plus stop_token_ids);
            `params.stop_token_ids` are always added. Masked while steps < min_tokens.

    Returns:
        A `SamplingBatch` whose optional fields and static flags are set only as needed.
    """
    n = len(params)
    for name, seq in (("seeds", seeds), ("steps", steps), ("prompts", prompts), ("outputs", outputs),
                      ("stop_ids", stop_ids)):  # fmt: skip
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} rows for {n} params")
    empty: list[Sequence[int]] = [()] * n
    prompts, outputs, stop_ids = prompts or empty, outputs or empty, stop_ids or empty

    def f32(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    def i64(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    greedy = [p.temperature == 0 for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    use_rep = any(p.repetition_penalty != 1 for p in params)
    use_counts = use_rep or any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params)
    biases = [p.logit_bias for p in params]
    logit_bias = None
    if any(biases):
        ids, values = [[t for t, _ in b] for b in biases], [v for b in biases for _, v in b]
        logit_bias = _dense(ids, vocab_size, torch.float32, device, "logit_bias", values=values)
    forbid = [
        sorted({*stop, *p.stop_token_ids}) if step < p.min_tokens else []
        for p, step, stop in zip(params, steps, stop_ids, strict=True)
    ]
    return SamplingBatch(
        temperature=f32([p.temperature for p in params]),
        top_k=i64(top_k),
        top_p=f32([p.top_p for p in params]),
        min_p=f32([p.min_p for p in params]),
        frequency_penalty=f32([p.frequency_penalty for p in params]),
        presence_penalty=f32([p.presence_penalty for p in params]),
        repetition_penalty=f32([p.repetition_penalty for p in params]),
        seed=i64([_int64(s) for s in seeds]),
        step=i64([int(s) for s in steps]),
        logit_bias=logit_bias,
        output_counts=_dense(outputs, vocab_size, torch.int32, device, "outputs") if use_counts else None,
        prompt_mask=_dense(prompts, vocab_size, torch.bool, device, "prompts") if use_rep else None,
        min_tokens_mask=_dense(forbid, vocab_size, torch.bool, device, "stop ids") if any(forbid) else None,
        needs_sort=any(not g and (k > 0 or p.top_p < 1) for g, k, p in zip(greedy, top_k, params, strict=True)),
        all_greedy=all(greedy),
    )

"""`SamplingBatch`: the per-row sampling settings and history of one sampler call, built on the host.

`make_sampling_batch` turns each row's `SamplingParams` (and its prompt/output ids, for penalties) into the
device tensors `sampler.sample` reads. Optional [B, V] fields and the static flags are set only when some row
needs them, so batches that don't use a feature don't pay for it. A grammar bitmask (`grammar_bitmask`, filled on
the host by the runner from the constrained rows' matchers) is passed through as it is; a constrained row's
`min_tokens` does not mask its stop ids (the grammar decides where the output ends).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch
from torch import Tensor

from astrai.inference.params import SamplingParams
from astrai.tree import pytree, replace, static, tree_map


@pytree
@attrs.frozen(eq=False)
class SamplingBatch:
    """Per-row sampling settings and history, on the logits' device.

    Attributes:
        temperature: [B] f32; 0 = greedy (rows whose `SamplingParams.greedy` holds get exactly 0).
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
        grammar_bitmask: [B, ceil(V / 32)] i32, token v allowed iff bit v % 32 of word v // 32 is set (all bits set
            on unconstrained rows); None when no row is constrained.
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
    grammar_bitmask: Tensor | None = None
    needs_sort: bool = static(default=True)
    all_greedy: bool = static(default=False)


def upload(t: Tensor, device: torch.device | str) -> Tensor:
    """`t` on `device` without a host sync: a CPU tensor bound for CUDA goes through pinned memory, non_blocking
    (a pageable copy waits for every kernel already queued: with the overlap schedule, the step in flight)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _dense(rows: Sequence[Sequence[int] | np.ndarray], vocab_size: int, dtype: torch.dtype,
           device: torch.device | str, what: str, values: Sequence[float] | None = None) -> Tensor:  # fmt: skip
    """[B, V] tensor: counts of `rows`' ids (int), their presence (bool), or `values` at them (float).

    Rows may be lists or int arrays (the engine passes `Seq.prompt_array()` / `output_array()`, so the
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
    index = (upload(torch.from_numpy(r), device), upload(torch.from_numpy(c), device))
    if values is not None:
        return out.index_put_(index, upload(torch.tensor(values, dtype=dtype), device))
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
    grammar_bitmask: Tensor | None = None,
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
            `params.stop_token_ids` are always added. Masked while steps < min_tokens (not on rows whose params
            have a grammar: its mask decides when EOS may come).
        grammar_bitmask: [B, ceil(V / 32)] int32 already on `device` (see `SamplingBatch`), or None.

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
        return upload(torch.tensor(values, dtype=torch.float32), device)

    def i64(values: list[int]) -> Tensor:
        return upload(torch.tensor(values, dtype=torch.int64), device)

    greedy = [p.greedy for p in params]  # temperature below SAMPLING_EPS: sent as 0
    top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    use_rep = any(p.repetition_penalty != 1 for p in params)
    use_counts = use_rep or any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params)
    biases = [p.logit_bias for p in params]
    logit_bias = None
    if any(biases):
        ids, values = [[t for t, _ in b] for b in biases], [v for b in biases for _, v in b]
        logit_bias = _dense(ids, vocab_size, torch.float32, device, "logit_bias", values=values)
    forbid = [
        sorted({*stop, *p.stop_token_ids}) if step < p.min_tokens and p.grammar is None else []
        for p, step, stop in zip(params, steps, stop_ids, strict=True)
    ]
    return SamplingBatch(
        temperature=f32([0.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]),
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
        grammar_bitmask=grammar_bitmask,
        needs_sort=any(not g and (k > 0 or p.top_p < 1) for g, k, p in zip(greedy, top_k, params, strict=True)),
        all_greedy=all(greedy),
    )


def general_batch(batch: SamplingBatch, vocab_size: int) -> SamplingBatch:
    """`batch` with every optional field present and both static flags at their general setting, drawing the
    same tokens: absent fields get neutral values (an all-ones grammar mask, zero bias and counts, an empty prompt
    mask, no forbidden ids), `needs_sort` True (top-k 0 and top-p 1 keep every logit) and `all_greedy` False
    (greedy rows still take their argmax). One compiled sampler variant then serves every combination of
    features (`sampler_variants`)."""
    rows, device = batch.temperature.shape[0], batch.temperature.device

    def full(t: Tensor | None, dtype: torch.dtype, width: int = vocab_size, value: int = 0) -> Tensor:
        return torch.full((rows, width), value, dtype=dtype, device=device) if t is None else t

    return replace(
        batch,
        logit_bias=full(batch.logit_bias, torch.float32),
        output_counts=full(batch.output_counts, torch.int32),
        prompt_mask=full(batch.prompt_mask, torch.bool),
        min_tokens_mask=full(batch.min_tokens_mask, torch.bool),
        grammar_bitmask=full(batch.grammar_bitmask, torch.int32, -(-vocab_size // 32), -1),
        needs_sort=True,
        all_greedy=False,
    )


def pad_rows(batch: SamplingBatch, rows: int) -> SamplingBatch:
    """`batch` with copies of row 0 appended up to `rows` rows (rows are independent: the copies change no other
    row's draw)."""
    extra = rows - batch.temperature.shape[0]
    return tree_map(lambda t: torch.cat([t, t[:1].expand(extra, *t.shape[1:])]), batch)

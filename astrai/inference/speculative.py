"""Speculative decoding's host and device pieces: the config, the n-gram proposer, adaptive draft lengths and the
two lossless verifiers.

Decode reads every weight once per token, so one stream cannot pass the weight-read roofline; checking k proposed
tokens in one target forward can. A *proposer* guesses up to k next tokens per sequence from host state; the
target runs once over the k+1 positions (the last accepted token and the k guesses) and a *verifier* keeps the
longest prefix the target agrees with, plus one token of its own, so each round emits 1..k+1 tokens.

Two verifiers, both lossless (the output has exactly the target's distribution):

- `coupled_accept`: the target draws each of the k+1 positions with the engine's own seeded sampler (noise keyed
  by (seed, output index), `astrai.inference.noise`) and a guess is accepted while it equals that draw. Because
  the draws use the same noise a run without speculation would use at the same output index, and every earlier
  guess matched, the emitted tokens are *the very tokens* a run without speculation emits: greedy and seeded
  sampling alike. For a deterministic proposal (n-gram, a greedy draft) a guess d is accepted with probability
  p(d), as in Leviathan et al.'s rule with q one-hot, and a rejected position keeps the target's draw, which is p
  conditioned on not being d, as their residual norm(max(0, p - q)) is.
- `rejection_sample`: Leviathan et al. (2023) / Chen et al. (2023) for a draft that *samples* from its own
  distribution q: accept guess d_i with probability min(1, p_i(d_i) / q_i(d_i)), on the first rejection draw from
  norm(max(0, p_i - q_i)), and draw a bonus token from p_k when all k pass. Sync-free, batched, seeded by the same
  counter-based noise (uniforms and draws from separate streams).

Rejected guesses leave no trace: the caller rolls their KV slots back and never offers them to the prefix cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch
from torch import Tensor

from astrai.inference.noise import exponential_noise

if TYPE_CHECKING:
    from astrai.inference.seq import Seq

METHODS = ("ngram", "draft")
_ALIASES = {"draft_model": "draft", "ngram": "ngram", "draft": "draft"}
# vLLM's --speculative-config keys this engine reads ("model" is vLLM's name for the draft model's folder)
_KEYS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                   "draft_model", "disable_by_batch_size"})  # fmt: skip


def _positive(_instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative config: {attribute.name} must be an integer >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """How the engine speculates (`EngineConfig.speculative`; vLLM's `--speculative-config` JSON, `parse`).

    Attributes:
        method: "ngram" (prompt lookup) or "draft" (a smaller model sharing the tokenizer).
        num_speculative_tokens: k, the most tokens proposed per sequence and round.
        prompt_lookup_min / prompt_lookup_max: n-gram lengths tried, longest first (ngram; vLLM's defaults, 5).
        draft_model: the draft model's folder or id (draft).
        disable_by_batch_size: vLLM's key: no guesses in a step while at least this many requests run (>= 2; None:
            always). Where verifying k + 1 rows per request costs more than the guesses save at larger batches
            (small models on CPU, compute-bound batches), speculation then serves only the small ones.
    """

    method: str = attrs.field(validator=attrs.validators.in_(METHODS))
    num_speculative_tokens: int = attrs.field(validator=_positive)
    prompt_lookup_min: int = attrs.field(default=5, validator=_positive)
    prompt_lookup_max: int = attrs.field(default=5, validator=_positive)
    draft_model: str | None = None
    disable_by_batch_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))

    def __attrs_post_init__(self) -> None:
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError(f"speculative config: disable_by_batch_size must be >= 2 (or absent), got "
                             f"{self.disable_by_batch_size}")  # fmt: skip
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) is greater than "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")  # fmt: skip
        if self.method == "draft" and not self.draft_model:
            raise ValueError('speculative config: method "draft" needs "model" (the draft model\'s folder)')
        if self.method == "ngram" and self.draft_model:
            raise ValueError('speculative config: "model" is for method "draft"; ngram needs no model')

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """A config from vLLM's JSON (a string or a dict): `{"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4}` or `{"model": "path/to/draft", "num_speculative_tokens": 4}` (method "draft",
        also spelt "draft_model"). None or an empty string: no speculation.

        Raises:
            ValueError: not JSON, not an object, an unknown key, a bad method or value (the message names it).
        """
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative config is not valid JSON: {err}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        model = value.get("model") or value.get("draft_model")
        method = value.get("method", "draft" if model else None)
        if method not in _ALIASES:
            raise ValueError(f"speculative config: method must be one of {sorted(_ALIASES)}, got {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative config: num_speculative_tokens is required")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        extra = {}  # vLLM's defaults: 5 and 5; one given, the other takes its value
        if low is not None or high is not None:
            extra = {"prompt_lookup_min": low if low is not None else high,
                     "prompt_lookup_max": high if high is not None else low}  # fmt: skip
        return cls(method=_ALIASES[method], num_speculative_tokens=value["num_speculative_tokens"],
                   draft_model=model, disable_by_batch_size=value.get("disable_by_batch_size"), **extra)  # fmt: skip


# ---- the n-gram proposer ------------------------------------------------------------------------------------------


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: up to `k` tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    n is tried from `n_max` down to `n_min`; the first n with a match wins. Among its matches the latest one with
    k tokens after it is taken (the freshest context), else the one with the most tokens after it (the earliest):
    in a repeating output the latest match ends one token before the end and would propose one token where an
    earlier one proposes k. `tokens` is the prompt followed by the output. Empty when nothing matches (the
    sequence then decodes plainly this round). Numpy, one pass over the tokens (below).
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    n_max = min(n_max, length - 1)
    if k <= 0 or n_max < max(n_min, 1):
        return []
    n_min = max(n_min, 1)
    # One pass instead of one per n: the windows of the shortest n that match end at `ends` (each before the last
    # token); then grow the matches backwards one token at a time, keeping those that still agree, up to n_max.
    # The longest n any of them reaches wins, with its matches: O(length * n_min + matches * n_max) where trying
    # each n from n_max down cost O(length * n) per n (0.7 ms a round on a 500-token sequence at n = 16..2).
    ends = np.arange(n_min - 1, length - 1)
    for j in range(n_min):
        ends = ends[arr[ends - j] == arr[length - 1 - j]]
    if not ends.size:
        return []
    n = n_min
    while n < n_max:
        ok = ends >= n  # room for one more token before the match
        longer = ends[ok][arr[ends[ok] - n] == arr[length - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    hits = ends - n + 1  # the starts of the longest matches, ascending
    full = hits[hits + n + k <= length]  # matches followed by k tokens
    start = int(full[-1] if full.size else hits[0]) + n  # the token after the chosen match
    return arr[start : start + k].tolist()


PENDING = -1  # draft method: a guess the draft model makes after scheduling (`astrai.inference.draft.fill`)


def proposer(config: SpeculativeConfig) -> Callable[[Seq, int], list[int]]:
    """The scheduler's `propose(seq, k)` for `config`: ngram, prompt lookup over the prompt and the output;
    draft, k `PENDING` slots (the scheduler plans their budget and pages; the draft model fills them, batched)."""
    if config.method == "draft":
        return lambda seq, k: [PENDING] * k
    low, high = config.prompt_lookup_min, config.prompt_lookup_max

    def ngram(seq: Seq, k: int) -> list[int]:
        return propose_ngram(np.concatenate([seq.prompt_array(), seq.output_array()]), k, low, high)

    return ngram


def attach(seqs: Sequence[Seq], config: SpeculativeConfig) -> None:
    """Give each new sequence its adaptive draft length (the scheduler proposes only for sequences that have one)."""
    for seq in seqs:
        seq.spec = AdaptiveK(k_max=config.num_speculative_tokens)


# ---- adaptive draft length ----------------------------------------------------------------------------------------


@attrs.define
class AdaptiveK:
    """A sequence's draft length: shrinks towards 0 while its guesses are rejected, grows back when they pass.

    Keeps an exponential moving average of the accepted fraction; the next k is `ceil(k_max * rate)`, 0 below
    `floor`. At 0 the sequence still probes with one guess now and then, so a workload that starts copying later is
    noticed: first after `probe_every` rounds, then twice as long after each failed probe (up to `max_interval`),
    so a sequence with nothing to copy pays for a verify round ever more rarely; a probe that passes resets it.
    """

    k_max: int
    rate: float = 1.0
    floor: float = 0.2
    decay: float = 0.5
    probe_every: int = 8
    max_interval: int = 128
    _idle: int = 0
    _interval: int = 0

    def next_k(self) -> int:
        """The number of tokens to propose this round."""
        if self.rate >= self.floor:
            return max(1, min(self.k_max, int(np.ceil(self.k_max * self.rate))))
        self._idle += 1
        if self._idle >= (self._interval or self.probe_every):
            self._idle = 0
            return 1
        return 0

    def update(self, proposed: int, accepted: int) -> None:
        """Record a round: `accepted` of `proposed` guesses passed (rounds without guesses change nothing)."""
        if proposed <= 0:
            return
        probing = self.rate < self.floor
        self.rate = self.decay * self.rate + (1 - self.decay) * accepted / proposed
        if probing and accepted == 0:  # a failed probe: wait twice as long for the next
            self._interval = min(2 * (self._interval or self.probe_every), self.max_interval)
        elif accepted:
            self._interval = 0


@attrs.define
class SpecStats:
    """Counters since start (vLLM's spec-decode metrics): rounds with guesses (`drafts`), guesses, accepted
    guesses, and `accepted_hist[a]`: the rounds that accepted exactly a guesses (the acceptance-length histogram;
    a round emits a + 1 tokens)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_hist: list[int] = attrs.Factory(list)

    def record(self, proposed: int, accepted: int) -> None:
        """Count one verified round."""
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_hist) <= accepted:
            self.accepted_hist.extend([0] * (accepted + 1 - len(self.accepted_hist)))
        self.accepted_hist[accepted] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified round (accepted guesses + the target's own draw); 0 before any round."""
        return (self.accepted_tokens + self.drafts) / self.drafts if self.drafts else 0.0


# ---- verification --------------------------------------------------------------------------------------------------


def coupled_accept(draft: Tensor, sampled: Tensor, num_draft: Tensor) -> Tensor:
    """How many guesses pass exact-match verification against the target's own draws.

    Args:
        draft: [B, k] i64 guesses (rows with fewer than k guesses padded with anything).
        sampled: [B, k + 1] i64 the target's draws at the k + 1 positions (the engine's seeded sampler, fed the
            guesses as context).
        num_draft: [B] i64 guesses per row (0..k).

    Returns:
        [B] i64 accepted guesses a (0..num_draft): the row emits `sampled[:, : a + 1]`.
    """
    k = draft.shape[1]
    match = (draft == sampled[:, :k]) & (torch.arange(k, device=draft.device)[None, :] < num_draft[:, None])
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # the length of the all-True prefix


_UNIFORM_STREAM = 0x5EC0 << 40  # the acceptance uniforms' step tag: never a step the token draws use


def rejection_sample(target_probs: Tensor, draft_probs: Tensor, draft: Tensor, seed: Tensor, step: Tensor
                     ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Leviathan et al. / Chen et al. verification of sampled guesses, for every row at once (no host sync).

    Args:
        target_probs: [B, k + 1, V] the target's (processed) distributions at the k + 1 positions.
        draft_probs: [B, k, V] the draft's distributions its guesses were drawn from.
        draft: [B, k] i64 the guesses.
        seed: [B] i64 the rows' seeds.
        step: [B] i64 the output index of the first position (position i draws with step + i).

    Returns:
        (accepted [B] i64 in 0..k, tokens [B, k + 1] i64): the row emits `tokens[:, : accepted + 1]`; tokens[:, i]
        for i < accepted is the guess, tokens[:, accepted] the residual draw (or the bonus when all k pass).
    """
    batch, k1, vocab = target_probs.shape
    k = k1 - 1
    positions = torch.arange(k1, device=draft.device)
    steps = (step[:, None] + positions[None, :]).reshape(-1)  # [B * (k + 1)]
    seeds = seed[:, None].expand(batch, k1).reshape(-1)
    p_guess = target_probs[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, k]
    q_guess = draft_probs.gather(-1, draft[..., None]).squeeze(-1)
    uniform = torch.exp(-exponential_noise(seeds, steps ^ _UNIFORM_STREAM, 1)).view(batch, k1)[:, :k]
    # u < p / q  <=>  u * q < p (q > 0 for a guess the draft drew); min(1, .) is implied by u < 1
    passed = uniform * q_guess < p_guess
    accepted = passed.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    residual = torch.cat([(target_probs[:, :k] - draft_probs).clamp(min=0), target_probs[:, k:]], dim=1)
    # a residual that is all zero (p == q exactly) cannot be reached by a rejection; fall back to p to stay finite
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    noise = exponential_noise(seeds, steps, vocab).view(batch, k1, vocab)
    draws = (residual / noise).argmax(dim=-1)  # [B, k + 1]: the residual draw at each position, the bonus at k
    keep = positions[None, :] < accepted[:, None]
    guesses = torch.cat([draft, draft[:, :1]], dim=1)
    return accepted, torch.where(keep, guesses, draws)

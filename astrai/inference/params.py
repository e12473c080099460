"""`SamplingParams`: the per-request, user-facing generation settings, validated on the host.

The field names and ranges follow the OpenAI API and vLLM's `SamplingParams`, so the server can map request
fields one to one. Device-side per-row tensors are built from these by `sampler.make_sampling_batch`; stop
strings are matched by `stop.StopStringMatcher`.

Deliberately fixed relative to the upstream AstrAI sampler (features §11b.11):
- greedy is `temperature < SAMPLING_EPS` (0 included) of *this* request, never inferred from the batch;
- `top_k` 0 or -1 disables top-k (upstream's API could not disable it);
- penalties run before temperature and the top-k/top-p/min-p filters, never after them.

Float32 limits (the sampler computes in float32; a value that is fine as a Python float can underflow there to 0
or a subnormal and turn the logits into NaN): a temperature below `SAMPLING_EPS` (1e-5, vLLM's `_SAMPLING_EPS`)
is greedy, as 0 is, since dividing logits by it would overflow; `repetition_penalty` must lie in
[`MIN_REPETITION_PENALTY`, `MAX_REPETITION_PENALTY`] (1e-6 .. 1e6); `top_p`, `min_p`, the frequency/presence
penalties and logit_bias values must be 0 or normal float32 numbers (magnitude >= 2**-126, about 1.2e-38). Every
refused value raises `EngineInputError` (a ValueError) whose `param` names the field.

Structured output: `grammar` holds a `GrammarSpec` (kind + source, frozen and hashable). `check` validates only its
shape; the engine compiles it at submit time (`astrai.inference.grammar`), where a grammar that does not compile is
an `EngineInputError` whose `param` is the spec's `param` (the request field it came from).

Not here: `best_of`, beam search, `allowed_token_ids`, bad words.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from astrai.inference.errors import EngineInputError

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_CACHE_SALT = 1024  # characters of a cache_salt
MAX_LOGIT_BIAS = 100.0
SAMPLING_EPS = 1e-5  # temperatures below this are greedy: logits / t would overflow float32
MIN_REPETITION_PENALTY = 1e-6  # positive logits / r stay finite in float32 (|logit| < 3e32)
MAX_REPETITION_PENALTY = 1e6
_F32_TINY = 2.0**-126  # the smallest normal float32; nonzero values below it flush to 0 or a subnormal
_F32_MAX = (2 - 2**-23) * 2.0**127  # the largest finite float32


def _str_tuple(value: str | Iterable[str]) -> tuple[str, ...]:
    # OpenAI accepts `stop` as one string or a list; a bare str must not become a tuple of its characters
    return (value,) if isinstance(value, str) else tuple(value)


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


def _choice_source(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@attrs.frozen(kw_only=True)
class GrammarSpec:
    """A constraint on the generated text (what to compile; `astrai.inference.grammar.grammar_source` turns it
    into llguidance's grammar text).

    Attributes:
        kind: "json_schema" (source: the schema as JSON text), "json_object" (any JSON object; source ""),
            "regex" (source: a Rust-`regex` pattern, matched in full), "choice" (source: a tuple of strings, one of
            which is the whole output) or "lark" (source: a Lark grammar, or GBNF as llama.cpp writes it).
        source: see kind.
        param: the request field the constraint came from, named in errors (not part of equality).
        closers: strings that end the grammar's free-text regions (a qwen3_coder tool call's text value ends at
            `\n</parameter>`): budget-aware closing (`astrai.inference.closing`) writes them to leave such a region.
    """

    kind: str
    source: str | tuple[str, ...] = attrs.field(default="", converter=_choice_source)
    param: str = attrs.field(default="grammar", eq=False)
    closers: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def check(self) -> None:
        """Validate the shape (compilation is the engine's). Raises EngineInputError naming `param`."""
        if self.kind not in GRAMMAR_KINDS:
            raise EngineInputError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}",
                                   param=self.param)  # fmt: skip
        if self.kind == "choice":
            ok = isinstance(self.source, tuple) and self.source and all(isinstance(c, str) for c in self.source)
            if not ok:
                raise EngineInputError(f"a choice grammar needs a non-empty list of strings, got {self.source!r}",
                                       param=self.param)  # fmt: skip
        elif not isinstance(self.source, str) or (self.kind != "json_object" and not self.source):
            raise EngineInputError(f"a {self.kind} grammar needs its source text, got {self.source!r}",
                                   param=self.param)  # fmt: skip


def _bias_tuple(value: Mapping[Any, float] | Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    # OpenAI sends logit_bias as a {"token id": bias} mapping with string keys
    items = value.items() if isinstance(value, Mapping) else value
    try:
        return tuple((int(k), float(v)) for k, v in items)
    except (TypeError, ValueError) as e:
        raise EngineInputError(f"logit_bias must map token ids to numbers, got {value!r}", param="logit_bias") from e


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Generation settings of one request (immutable; call `check` before use).

    Penalty and filter order, and what `logprobs` report, are documented in `astrai.inference.sampler`.
    `stop` accepts a single string and `logit_bias` a `{token id: bias}` mapping; both are stored as tuples.
    """

    max_tokens: int = 16  # tokens to generate at most (>= 1)
    temperature: float = 1.0  # >= 0; 0 (or below SAMPLING_EPS) = greedy for this request
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # [0, 1]: keep tokens with p >= min_p * p_max (after temperature)
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI: logit -= f * count over generated tokens
    presence_penalty: float = 0.0  # [-2, 2], OpenAI: logit -= p * (count > 0) over generated tokens
    repetition_penalty: float = 1.0  # [1e-6, 1e6], HF over prompt + generated: positive logits / r, negative * r
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias_tuple)  # (id, [-100, 100])
    seed: int | None = None  # reproducible sampling for this request (None: the engine picks one)
    n: int = 1  # completions sharing the prompt (1..16)
    logprobs: bool = False  # return the chosen token's logprob
    top_logprobs: int = 0  # 0..20 most likely alternatives per position (implies logprobs)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)  # stop strings (<= 16, non-empty)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)  # extra ids that end generation
    ignore_eos: bool = False  # keep generating past the model's eos ids
    min_tokens: int = 0  # eos / stop ids are masked until this many tokens were generated (<= max_tokens)
    skip_special_tokens: bool = True  # drop special tokens from the decoded text
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    grammar: GrammarSpec | None = None  # constrain the output (compiled by the engine at submit)
    # scheduling priority under EngineConfig.scheduling_policy "priority": lower values are admitted first and
    # preempted last (vLLM's meaning); must stay 0 under "fcfs"
    priority: int = 0
    # vLLM's cache_salt: the prefix cache shares pages only between requests of the same salt (None: the unsalted
    # space), so one client cannot learn from cache hits what another sent (radix.RadixCache)
    cache_salt: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        """Whether the chosen token's logprob must be computed (`top_logprobs > 0` implies it)."""
        return self.logprobs or self.top_logprobs > 0

    @property
    def greedy(self) -> bool:
        """Temperature below `SAMPLING_EPS` (0 included): the request takes the argmax of its penalised logits."""
        return self.temperature < SAMPLING_EPS

    def check(self, vocab_size: int | None = None) -> None:
        """Validate every field; token ids are checked against `vocab_size` when given.

        Raises:
            EngineInputError: a ValueError naming the first offending field (message and `param`) and its value.
        """
        _int_in("max_tokens", self.max_tokens, 1, None)
        _float_in("temperature", self.temperature, 0.0, _F32_MAX)  # below SAMPLING_EPS: greedy, not an error
        if not (0.0 < _finite("top_p", self.top_p) <= 1.0):
            raise EngineInputError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        _normal_f32("top_p", self.top_p)
        if self.top_k != -1:
            _int_in("top_k", self.top_k, 0, None, hint=" (0 or -1 disables it)")
        _normal_f32("min_p", _float_in("min_p", self.min_p, 0.0, 1.0))
        _normal_f32("frequency_penalty", _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        _normal_f32("presence_penalty", _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0))
        _float_in("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        self._check_logit_bias(vocab_size)
        _int_in("priority", self.priority, -(1 << 63), (1 << 63) - 1)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT):  # fmt: skip
            raise EngineInputError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters, "
                                   f"got {self.cache_salt!r:.80}", param="cache_salt")  # fmt: skip
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise EngineInputError(f"seed must be an int or None, got {self.seed!r}", param="seed")
        _int_in("n", self.n, 1, MAX_N)
        _int_in("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if vocab_size is not None and self.top_logprobs > vocab_size:
            raise EngineInputError(f"top_logprobs must be <= vocab_size {vocab_size}, got {self.top_logprobs!r}",
                                   param="top_logprobs")  # fmt: skip
        if len(self.stop) > MAX_STOP_STRINGS:
            raise EngineInputError(f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
                                   param="stop")  # fmt: skip
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise EngineInputError(f"stop strings must be non-empty str, got {s!r} in stop={self.stop!r}",
                                       param="stop")  # fmt: skip
        for i in self.stop_token_ids:
            _token_id("stop_token_ids", i, vocab_size)
        _int_in("min_tokens", self.min_tokens, 0, self.max_tokens, hint=" (at most max_tokens)")
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise EngineInputError(f"grammar must be a GrammarSpec, got {self.grammar!r}", param="grammar")
            self.grammar.check()

    def _check_logit_bias(self, vocab_size: int | None) -> None:
        seen: set[int] = set()
        for token, bias in self.logit_bias:
            _token_id("logit_bias", token, vocab_size)
            if token in seen:
                raise EngineInputError(f"logit_bias lists token {token} twice", param="logit_bias")
            seen.add(token)
            if not (-MAX_LOGIT_BIAS <= _finite("logit_bias", bias) <= MAX_LOGIT_BIAS):
                raise EngineInputError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}",
                                       param="logit_bias")  # fmt: skip
            _normal_f32("logit_bias", bias)


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise EngineInputError(f"{name} must be a finite number, got {value!r}", param=name)
    return float(value)


def _normal_f32(name: str, value: float) -> None:
    """0 or a normal float32 magnitude: smaller values become 0 or subnormal on the device (see the docstring)."""
    if value != 0 and abs(value) < _F32_TINY:
        raise EngineInputError(f"{name} must be 0 or at least {_F32_TINY:.4g} in magnitude (a normal float32 "
                               f"number), got {value!r}", param=name)  # fmt: skip


def _float_in(name: str, value: Any, lo: float, hi: float) -> float:
    v = _finite(name, value)
    if not lo <= v <= hi:
        bounds = f">= {lo} (and a finite float32, <= {_F32_MAX:.4g})" if hi == _F32_MAX else f"[{lo}, {hi}]"
        raise EngineInputError(f"{name} must be {bounds}, got {value!r}", param=name)
    return v


def _int_in(name: str, value: Any, lo: int, hi: int | None, *, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineInputError(f"{name} must be an int, got {value!r}", param=name)
    if value < lo or (hi is not None and value > hi):
        bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise EngineInputError(f"{name} must be {bounds}{hint}, got {value!r}", param=name)


def _token_id(name: str, token: Any, vocab_size: int | None) -> None:
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise EngineInputError(f"{name} token ids must be ints >= 0, got {token!r}", param=name)
    if vocab_size is not None and token >= vocab_size:
        raise EngineInputError(f"{name} token id {token} is out of range for vocab_size {vocab_size}", param=name)

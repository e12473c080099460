"""Grammar-constrained decoding on the host: the llguidance view of our tokenizer, grammars, matchers, bitmasks.

llguidance was chosen over xgrammar by measurement (benchmarks/bench_grammar.py; the numbers are in
docs/serving.md): at a 150k vocabulary it compiles a JSON schema to its first mask in 1-2 ms where xgrammar takes
0.1-0.4 s (a per-request cost on the serving path), its per-token mask is 10-20 us (xgrammar's 7 us; both far under
a decode step), and it has no Python dependencies (xgrammar requires torch, transformers, triton, pydantic and
tvm-ffi, and takes seconds to import). llguidance's mask can be narrower than what `accept` takes: under forced
text it allows only the canonical tokens of that text; sample from the mask and it never rejects.

The view is built from each token's bytes (`astrai.io.token_bytes.TokenBytes`), so byte-level BPE (GPT-2 alphabet),
sentencepiece-style ``▁`` pieces and ``<0xNN>`` byte-fallback vocabularies all work; special tokens match no text,
and the model's EOS ids end an accepting grammar. Rows past the tokenizer (a padded embedding) are never allowed.

Use, on the host, one matcher per sequence:
    view = build_view(tokenizer, vocab_size=cfg.vocab_size)      # once per served model
    grammar = compile_grammar(view, json_schema_grammar(schema))  # validated; cached on the view; GrammarError
    matcher = new_matcher(grammar)                                # per sequence (a copy of the compiled matcher)
    bitmask = allocate_bitmask(rows, view.vocab_size)             # int32 [R, ceil(V/32)], bit v of word v // 32
    fill_bitmask(matcher, bitmask[r])  or  fill_bitmask_batch(view, [(matcher, r), ...], bitmask)  # GIL released
    accept(matcher, token)   # False (and the matcher unchanged) for a token outside the mask
    is_finished(matcher)     # nothing but EOS can follow (or EOS was accepted)
The engine (docs/inference.md, "Structured output"): `SamplingParams.grammar` is a `GrammarSpec`; `Engine.submit`
compiles it (`grammar_source` + `compile_grammar`, on the caller's thread) against one view built lazily per engine,
each sequence gets its own matcher, `ModelRunner` fills the constrained rows' bitmask for the sampler
(`SamplingBatch.grammar_bitmask`), and `Scheduler.update` advances the matcher with the accepted token and ends the
sequence ("stop") when the grammar is finished.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from astrai.inference.params import GrammarSpec
from astrai.inference.schema_rewrite import ecma_regex, rewrite_schema
from astrai.io.token_bytes import TokenBytes
from astrai.io.tokenizer import Tokenizer

# JSON output without free whitespace: a weak model cannot pad forever between tokens (issue 14, item 6)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# Compile time grows with the grammar's size (measured on a 2-core box: a 188 KiB schema of 3,000 patterned
# properties 0.18 s to its first mask, 632 KiB 1.1 s; llguidance's own limits stop a 2 MiB one after 0.3-0.5 s).
# Past this size a grammar is refused at once, so compiling one stays well under a second.
MAX_GRAMMAR_BYTES = 256 << 10


class GrammarError(ValueError):
    """A grammar (schema, regex, choice list, Lark/GBNF text) that cannot be compiled; the message names why."""


class _Wrapped:
    """What `llguidance.TokenizerWrapper` reads: the bytes of every token and a str -> ids encoder.

    llguidance tokenizes forced text (e.g. ``{"name":"`` of a schema) with the encoder and allows the first of
    those tokens, so the ids must spell exactly the text: a sentencepiece-style encoder that prepends ``▁`` does
    not, and such text is tokenized greedily (longest token first) instead.
    """

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], eos: int) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self._tokenizer = tokenizer
        special = set(self.special_token_ids)
        self._by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(tokens):
            if b and i not in special:
                self._by_bytes.setdefault(b, i)
        self._longest = max(map(len, self._by_bytes), default=1)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance probes with bytes once, then sends str
            raise TypeError("str only")
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        data = text.encode()
        if b"".join(self.tokens[i] if i < len(self.tokens) else b"" for i in ids) == data:
            return ids
        out, at = [], 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                if (token := self._by_bytes.get(data[at : at + n])) is not None:
                    out.append(token)
                    at += n
                    break
            else:  # a byte no token spells: let llguidance see the mismatch rather than guess
                return ids
        return out


class TokenizerView:
    """llguidance's view of one tokenizer and a bounded cache of compiled grammars (host state, thread-safe).

    Attributes:
        ll: the `llguidance.LLTokenizer`.
        vocab_size: rows of the logits (>= the tokenizer's vocabulary; the extra rows are never allowed).
        n_tokens: the tokenizer's vocabulary (ids past it are never accepted).
        eos_token_ids: ids that end a sequence whose grammar is accepting.
        words: int32 words per bitmask row, ``ceil(vocab_size / 32)``.
        token_bytes: each token's bytes (special tokens: b""), read by `astrai.inference.closing`.
    """

    def __init__(self, ll: llguidance.LLTokenizer, vocab_size: int, n_tokens: int, eos: tuple[int, ...], cache: int,
                 token_bytes: Sequence[bytes] = ()):  # fmt: skip
        self.ll, self.vocab_size, self.n_tokens, self.eos_token_ids = ll, vocab_size, n_tokens, eos
        self.words = (vocab_size + 31) // 32
        self.token_bytes = token_bytes
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cache_size, self._lock = cache, threading.Lock()
        self._executor: llguidance.LLExecutor | None = None

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor


def build_view(
    tokenizer: Tokenizer,
    *,
    vocab_size: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    cache: int = 128,
) -> TokenizerView:
    """The tokenizer view: every token's bytes (TokenBytes) handed to llguidance.

    Args:
        tokenizer: our tokenizer (byte-level BPE, sentencepiece-style, byte fallback).
        vocab_size: the model's vocabulary (logits width); default the tokenizer's.
        eos_token_ids: ids that end a sequence; default ``tokenizer.eos_token_ids``.
        cache: compiled grammars kept (least recently used dropped first).
    """
    n = tokenizer.vocab_size
    vocab_size = n if vocab_size is None else vocab_size
    if vocab_size < n:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n} tokens")
    eos = tuple(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
    if not eos:
        raise ValueError("the tokenizer has no EOS token: a grammar could never end its sequence")
    token_bytes = TokenBytes(tokenizer)
    tokens = [token_bytes.bytes(i) for i in range(n)]
    wrapped = llguidance.TokenizerWrapper(_Wrapped(tokenizer, tokens, eos[0]))
    ll = llguidance.LLTokenizer(wrapped, n_vocab=vocab_size, eos_token=list(eos))
    special = tokenizer.special_token_ids
    return TokenizerView(ll, vocab_size, n, eos, cache, [b"" if i in special else b for i, b in enumerate(tokens)])


# ---- grammar sources (llguidance's grammar text; compile with compile_grammar) ----------------------------------
def json_schema_grammar(schema: Mapping[str, Any] | str, *, options: Mapping[str, Any] | None = None) -> str:
    """A JSON schema (dict or JSON text); `options` are llguidance's JSON options (default COMPACT_JSON).

    Properties come out in the schema's order; the schema's own ``x-guidance`` options, if any, win over `options`.
    Patterns read as ECMA-262 (`\\d` is `[0-9]`), and `date`, `time`, `date-time`, `email` formats admit only what
    pydantic and jsonschema accept (`schema_rewrite`).
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from e
    try:
        schema = rewrite_schema(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=dict(options or COMPACT_JSON))
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from e


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    """A regular expression (Rust `regex` syntax, except that `\\d` and `\\w` are ASCII, as in ECMA-262, which
    JSON Schema patterns follow), matched in full."""
    return llguidance.LLMatcher.grammar_from_regex(ecma_regex(pattern))


def choice_grammar(choices: Sequence[str]) -> str:
    """Exactly one of `choices` (vLLM's ``guided_choice``)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("a choice grammar needs a non-empty list of strings")
    return lark_grammar("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


def lark_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect), or GBNF/EBNF as llama.cpp writes it (converted to Lark)."""
    try:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
    except Exception as e:  # the GBNF converter raises plain Exceptions on syntax errors
        raise GrammarError(f"invalid grammar: {e}") from e


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar text of a request's `GrammarSpec` (JSON schema text, regex, choices, Lark/GBNF).

    Raises:
        GrammarError: the schema is not JSON, or the grammar text does not parse.
    """
    if spec.kind == "json_object":
        return json_object_grammar()
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict | bool):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return json_schema_grammar(schema)
    if spec.kind == "regex":
        try:
            return regex_grammar(spec.source)
        except Exception as e:  # llguidance checks the pattern at compile time; keep the error type uniform
            raise GrammarError(f"invalid regex: {e}") from e
    if spec.kind == "choice":
        return choice_grammar(spec.source)
    if spec.kind == "lark":
        return lark_grammar(spec.source)
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


# ---- compiled grammars and per-sequence matchers ---------------------------------------------------------------
class Grammar:
    """A grammar compiled against one view: a pristine matcher that `new_matcher` copies.

    Attributes:
        view: the tokenizer view it was compiled for.
        source: the llguidance grammar text.
        shortest: tokens of the complete output the admission check's rollout found from the start state (0: none
            within its limit); None until `grammar_check.check_grammar` passed it (kept with the cached grammar).
    """

    __slots__ = ("view", "source", "_pristine", "shortest")

    def __init__(self, view: TokenizerView, source: str, pristine: llguidance.LLMatcher) -> None:
        self.view, self.source, self._pristine = view, source, pristine
        self.shortest: int | None = None

    def forget(self) -> None:
        """Drop this grammar from its view's cache, so that the next request compiles it afresh (after it failed
        the admission check, or a sequence's matcher failed: llguidance's lazily built lexer, with its resource
        limits, is shared by every copy of one compiled grammar)."""
        with self.view._lock:
            if self.view._cache.get(self.source) is self:
                del self.view._cache[self.source]


def compile_grammar(view: TokenizerView, source: str) -> Grammar:
    """Compile `source` (from the ``*_grammar`` functions) for `view`, or fetch it from the view's cache.

    Raises:
        GrammarError: the grammar does not compile (the message is llguidance's, naming the problem), or its text
            is over `MAX_GRAMMAR_BYTES`.
    """
    size = len(source.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar (schema, tools or pattern) is {size:,} bytes; the limit is "
                           f"{MAX_GRAMMAR_BYTES:,}, which keeps its compilation under a second")  # fmt: skip
    with view._lock:
        grammar = view._cache.get(source)
        if grammar is not None:
            view._cache.move_to_end(source)
            return grammar
    pristine = llguidance.LLMatcher(view.ll, source, log_level=0)  # releases the GIL while it compiles
    if pristine.is_error():
        raise GrammarError(pristine.get_error())
    grammar = Grammar(view, source, pristine)
    with view._lock:
        grammar = view._cache.setdefault(source, grammar)  # another thread's copy, if it was first
        while len(view._cache) > view._cache_size:
            view._cache.popitem(last=False)
    return grammar


class Matcher:
    """One sequence's position in its grammar (mutable host state; not thread-safe, one owner).

    Attributes:
        grammar: the compiled grammar.
        ll: the `llguidance.LLMatcher`.
    """

    __slots__ = ("grammar", "ll")

    def __init__(self, grammar: Grammar, ll: llguidance.LLMatcher) -> None:
        self.grammar, self.ll = grammar, ll


def new_matcher(grammar: Grammar) -> Matcher:
    """A matcher at the start of `grammar` (a copy of the compiled one: no recompilation)."""
    return Matcher(grammar, grammar._pristine.deep_copy())


def allocate_bitmask(rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A zeroed int32 bitmask ``[rows, ceil(vocab_size / 32)]`` on the host: token v is bit ``v % 32`` of word
    ``v // 32`` (pin it to copy to the device without blocking)."""
    return torch.zeros((rows, (vocab_size + 31) // 32), dtype=torch.int32, pin_memory=pin_memory)


def _check_row(view: TokenizerView, row: torch.Tensor) -> None:
    if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous():
        raise ValueError(f"a bitmask row must be a contiguous int32 CPU tensor, got {row.dtype} on {row.device}")
    if row.numel() != view.words:
        raise ValueError(
            f"a bitmask row holds {view.words} int32 words for {view.vocab_size} tokens, got {row.numel()}"
        )


def fill_bitmask(matcher: Matcher, row: torch.Tensor) -> None:
    """Write the tokens `matcher` allows next into `row` (int32 ``[ceil(V/32)]``, contiguous, on the host).

    A finished matcher allows only EOS; one in an error state allows only EOS too.
    """
    _check_row(matcher.grammar.view, row)
    matcher.ll.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


def fill_bitmask_batch(view: TokenizerView, rows: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
    """`fill_bitmask` for many sequences at once, in llguidance's thread pool: ``(matcher, row index)`` pairs.

    Rows not named are left as they are (the engine skips the mask on unconstrained rows).
    """
    if bitmask.dim() != 2:
        raise ValueError("the bitmask must be [rows, words]")
    _check_row(view, bitmask[0])
    if not bitmask.is_contiguous():
        raise ValueError("the bitmask must be contiguous")
    for m, r in rows:
        if m.grammar.view is not view or not 0 <= r < bitmask.shape[0]:
            raise ValueError(f"row {r}: matcher of another view, or outside the bitmask")
    pairs = [(m.ll, r) for m, r in rows]
    view.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), view.words * 4, bitmask.shape[0])


def accept(matcher: Matcher, token: int) -> bool:
    """Advance `matcher` by `token`; False, leaving the matcher unchanged, if the grammar forbids it."""
    if not 0 <= token < matcher.grammar.view.n_tokens:  # llguidance would fail the matcher for good
        return False
    return matcher.ll.try_consume_tokens([token]) == 1


def valid_prefix(matcher: Matcher, tokens: Sequence[int]) -> int:
    """How many of `tokens`, in order, the grammar allows from `matcher`'s state (the matcher is not moved):
    speculative decoding keeps only those guesses of a constrained sequence."""
    n = 0
    while n < len(tokens) and 0 <= tokens[n] < matcher.grammar.view.n_tokens:
        n += 1  # llguidance would fail the matcher for good on an id outside its vocabulary
    return matcher.ll.validate_tokens(list(tokens[:n])) if n else 0


def fill_bitmask_after(matcher: Matcher, tokens: Sequence[int], row: torch.Tensor) -> None:
    """`fill_bitmask` for the state `matcher` reaches after `tokens` (allowed ones, `valid_prefix`), leaving the
    matcher where it was: a speculative row draws as if its guesses had been accepted."""
    if not tokens:
        return fill_bitmask(matcher, row)
    consumed = matcher.ll.try_consume_tokens(list(tokens))
    if consumed != len(tokens):
        matcher.ll.rollback(consumed)
        raise RuntimeError(f"the grammar refused guessed token {tokens[consumed]} that it had validated")
    try:
        fill_bitmask(matcher, row)
    finally:
        matcher.ll.rollback(len(tokens))


def is_accepting(matcher: Matcher) -> bool:
    """The output so far is complete: EOS may come next."""
    return matcher.ll.is_accepting()


def is_finished(matcher: Matcher) -> bool:
    """The grammar is complete and allows nothing but EOS (or EOS was accepted): the sequence should stop."""
    return matcher.ll.is_stopped() and not matcher.ll.is_error()


def matcher_error(matcher: Matcher) -> str | None:
    """Why the matcher failed (llguidance's message, e.g. a parser resource limit), or None."""
    return matcher.ll.get_error() if matcher.ll.is_error() else None


def error_summary(message: str) -> str:
    """The first line of an llguidance error (the rest is a dump of the parser's state), in words where it is only
    a name: "NoExtensionBias" is a state that no token can continue."""
    line = message.strip().partition("\n")[0][:300]
    return "no token can continue the output" if line == "NoExtensionBias" else line


def bitmask_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack an int32 bitmask ``[..., W]`` to booleans ``[..., vocab_size]`` (True = allowed)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(-2)[..., :vocab_size].bool()

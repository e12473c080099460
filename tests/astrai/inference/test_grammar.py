"""Grammar matchers over our tokenizers: a random "model" constrained by the bitmask always yields valid output.

Three small tokenizers trained here: byte-level BPE (GPT-2 alphabet), a Llama-2-style sentencepiece BPE
(``▁`` pieces, ``<0xNN>`` byte fallback, Replace/ByteFallback/Fuse/Strip decoder) and the Metaspace-decoder
variant. At every step the walk picks a uniformly random token the bitmask allows, until the matcher finishes.
"""

import functools
import json
import random
import re
import time

import jsonschema
import pytest
import torch

from astrai.inference.grammar import (
    GrammarError,
    accept,
    allocate_bitmask,
    bitmask_allowed,
    build_view,
    choice_grammar,
    compile_grammar,
    fill_bitmask,
    fill_bitmask_after,
    fill_bitmask_batch,
    is_accepting,
    is_finished,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    new_matcher,
    regex_grammar,
    valid_prefix,
)
from astrai.io.token_bytes import TokenBytes
from astrai.io.tokenizer import Tokenizer, train_tokenizer
from helpers import grammar_takes, sentencepiece_tokenizer

CORPUS = [
    '{"name": "Ada", "kind": "cat", "age": 36, "tags": ["a", "b"], "owner": {"id": 12, "admin": true}}',
    "Hello world, the quick brown fox jumps over 1234 lazy dogs. naïve café [1, 2, 3] null false",
    "AB-123 x-ray yes no maybe later",
] * 10
KINDS = ["byte_level", "llama2", "metaspace"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}},
            "required": ["id", "admin"],
            "additionalProperties": False,
        },
        "note": {"type": ["string", "null"], "maxLength": 5},
    },
    "required": ["name", "kind", "age", "owner"],
    "additionalProperties": False,
}
SEEDS = range(20)


@functools.cache
def tokenizer(kind: str) -> Tokenizer:
    if kind == "byte_level":
        return train_tokenizer(CORPUS, vocab_size=400)
    return sentencepiece_tokenizer(CORPUS, style=kind, vocab_size=200)


@functools.cache
def view(kind: str):
    return build_view(tokenizer(kind), vocab_size=tokenizer(kind).vocab_size + 7)  # a padded embedding


def walk(kind: str, source: str, seed: int, max_steps: int = 400) -> str:
    """A random model: a uniformly random allowed token per step until the matcher finishes; the output text."""
    v, rng = view(kind), random.Random(seed)
    m = new_matcher(compile_grammar(v, source))
    row, ids = allocate_bitmask(1, v.vocab_size)[0], []
    for _ in range(max_steps):
        fill_bitmask(m, row)
        allowed = bitmask_allowed(row, v.vocab_size)
        assert not allowed[tokenizer(kind).vocab_size :].any(), "padding rows must never be allowed"
        t = rng.choice(allowed.nonzero().flatten().tolist())
        if t in v.eos_token_ids:
            assert is_accepting(m) and accept(m, t) and is_finished(m)
            break
        assert accept(m, t)
        ids.append(t)
        if is_finished(m):
            break
    else:
        raise AssertionError(f"no end after {max_steps} steps: {tokenizer(kind).decode(ids)!r}")
    text = b"".join(TokenBytes(tokenizer(kind)).bytes(i) for i in ids).decode("utf-8")  # strict: valid UTF-8
    assert tokenizer(kind).decode(ids).strip() == text.strip()  # what the user sees
    return text


@pytest.mark.parametrize("kind", KINDS)
def test_random_model_json_schema_always_valid(kind):
    source = json_schema_grammar(SCHEMA)
    for seed in SEEDS:
        value = json.loads(walk(kind, source, seed))
        jsonschema.validate(value, SCHEMA)


@pytest.mark.parametrize("kind", KINDS)
def test_random_model_json_object(kind):
    for seed in range(5):
        assert isinstance(json.loads(walk(kind, json_object_grammar(), seed, max_steps=2000)), dict)


@pytest.mark.parametrize("kind", KINDS)
def test_random_model_regex(kind):
    pattern = r"[A-Z]{2}-[0-9]{3}( x[a-z]{1,3})?"
    outputs = {walk(kind, regex_grammar(pattern), seed) for seed in SEEDS}
    assert all(re.fullmatch(pattern, text) for text in outputs) and len(outputs) > 1


@pytest.mark.parametrize("kind", KINDS)
def test_random_model_choice(kind):
    choices = ["yes", "no", "maybe later", 'say "hi"', "中文", "naïve"]
    outputs = {walk(kind, choice_grammar(choices), seed) for seed in SEEDS}
    assert outputs <= set(choices) and len(outputs) > 2


def test_choice_grammar_takes_each_choice_verbatim_and_nothing_else():
    """Each choice's own token ids, spaces and quotes included, and no variant of it (the reference is the choice
    list itself: a grammar that strips, escapes or drops a choice fails here, which random walks can miss)."""
    tok, v = tokenizer("byte_level"), view("byte_level")
    choices = [" yes", "no ", 'say "hi"', "a|b"]
    grammar = compile_grammar(v, choice_grammar(choices))
    for choice in choices:
        assert grammar_takes(v, grammar, tok.encode(choice, add_special_tokens=False)), choice
    for other in ("yes", "no", "say hi", "a", " yes no ", ""):
        assert not grammar_takes(v, grammar, tok.encode(other, add_special_tokens=False)), other


@pytest.mark.parametrize("kind", KINDS)
def test_random_model_gbnf_and_lark(kind):
    gbnf = 'root ::= ("ab" | "cd") " " [0-9] [0-9]?'
    for seed in range(5):
        assert re.fullmatch(r"(ab|cd) [0-9][0-9]?", walk(kind, lark_grammar(gbnf), seed))
    assert walk(kind, lark_grammar('start: "x" ("y" | "z")'), 0) in {"xy", "xz"}


@pytest.mark.parametrize("kind", KINDS)
def test_token_outside_mask_is_rejected(kind):
    v, tok = view(kind), tokenizer(kind)
    m = new_matcher(compile_grammar(v, json_schema_grammar(SCHEMA)))
    row = allocate_bitmask(1, v.vocab_size)[0]
    fill_bitmask(m, row)
    allowed = bitmask_allowed(row, v.vocab_size)
    # an object starts with "{" (no free whitespace). llguidance's mask can be narrower than what `accept` takes
    # (under forced text it allows only the canonical tokenization), so the control is on tokens that cannot fit
    token_bytes = TokenBytes(tok)
    banned = [t for t in range(v.vocab_size) if not allowed[t] and not token_bytes.bytes(t).startswith(b"{")]
    assert tok.encode("x", add_special_tokens=False)[0] in banned and len(banned) > v.vocab_size // 2
    for t in banned[:: max(1, len(banned) // 50)] + [v.vocab_size - 1, *v.eos_token_ids]:
        assert not accept(m, t)
    fill_bitmask(m, row)  # the rejections left the matcher where it was
    assert torch.equal(bitmask_allowed(row, v.vocab_size), allowed) and not is_finished(m)
    assert accept(m, allowed.nonzero()[0].item())


def test_batch_fill_matches_single_rows():
    v = view("byte_level")
    grammars = [json_schema_grammar(SCHEMA), regex_grammar(r"[0-9]+"), choice_grammar(["yes", "no"])]
    matchers = [new_matcher(compile_grammar(v, g)) for g in grammars]
    accept(matchers[0], tokenizer("byte_level").encode("{", add_special_tokens=False)[0])
    batch = allocate_bitmask(4, v.vocab_size)
    fill_bitmask_batch(v, [(m, r) for r, m in zip([0, 2, 3], matchers, strict=True)], batch)
    for r, m in zip([0, 2, 3], matchers, strict=True):
        row = allocate_bitmask(1, v.vocab_size)[0]
        fill_bitmask(m, row)
        assert torch.equal(batch[r], row)
    assert not batch[1].any()  # rows not named are untouched


def test_guesses_are_cut_where_the_grammar_forbids_them_and_rows_see_the_state_after_them():
    """Speculative decoding's grammar hooks: `valid_prefix` counts the allowed guesses without moving the matcher;
    `fill_bitmask_after` gives the mask of the state after them (as accepting them one by one does) and leaves
    the matcher where it was."""
    v, tok = view("byte_level"), tokenizer("byte_level")
    m = new_matcher(compile_grammar(v, json_schema_grammar(SCHEMA)))
    walk_ids = tok.encode('{"name": "Rex", "kind": "dog"', add_special_tokens=False)
    ok = valid_prefix(m, walk_ids)
    assert ok >= 3  # a prefix of a valid document (the grammar may prefer other whitespace later)
    bad = tok.encode("x", add_special_tokens=False)[0]
    assert valid_prefix(m, [*walk_ids[:ok], bad]) == ok  # cut at the forbidden guess
    assert valid_prefix(m, [bad, *walk_ids]) == 0 and valid_prefix(m, [v.vocab_size + 5]) == 0
    before = allocate_bitmask(1, v.vocab_size)[0]
    fill_bitmask(m, before)
    for n in range(1, ok + 1):
        after = allocate_bitmask(1, v.vocab_size)[0]
        fill_bitmask_after(m, walk_ids[:n], after)
        reference = new_matcher(compile_grammar(v, json_schema_grammar(SCHEMA)))
        assert all(accept(reference, t) for t in walk_ids[:n])
        expected = allocate_bitmask(1, v.vocab_size)[0]
        fill_bitmask(reference, expected)
        assert torch.equal(after, expected) and not torch.equal(after, before)
    again = allocate_bitmask(1, v.vocab_size)[0]
    fill_bitmask(m, again)
    assert torch.equal(again, before)  # the matcher did not move
    with pytest.raises(RuntimeError, match="refused guessed token"):
        fill_bitmask_after(m, [bad], again)
    fill_bitmask(m, again)
    assert torch.equal(again, before) and not is_finished(m)


def test_compiled_grammars_are_cached_per_view():
    v = view("metaspace")
    source = json_schema_grammar(SCHEMA | {"title": "cache"})
    first = compile_grammar(v, source)
    t0 = time.perf_counter()
    second = compile_grammar(v, source)
    assert second._pristine is first._pristine and time.perf_counter() - t0 < 0.01


def test_bad_grammars_raise_grammar_error_quickly():
    v = view("byte_level")
    t0 = time.perf_counter()
    for make in [
        lambda: compile_grammar(v, regex_grammar("a(")),
        lambda: compile_grammar(v, json_schema_grammar({"type": "no-such-type"})),
        lambda: compile_grammar(v, lark_grammar("start: undefined_rule")),
        lambda: json_schema_grammar("{not json"),
        lambda: choice_grammar([]),
    ]:
        with pytest.raises(GrammarError):
            make()
    assert time.perf_counter() - t0 < 1.0


def test_bitmask_row_checks():
    v = view("byte_level")
    m = new_matcher(compile_grammar(v, regex_grammar("a")))
    with pytest.raises(ValueError, match="int32"):
        fill_bitmask(m, torch.zeros(v.words, dtype=torch.int64))
    with pytest.raises(ValueError, match="words"):
        fill_bitmask(m, torch.zeros(v.words + 1, dtype=torch.int32))

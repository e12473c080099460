"""Incremental detokenizer: the streamed deltas must add up to ``Tokenizer.decode`` of all ids.

Checked on a byte-level BPE (GPT-2/Qwen style) and on two sentencepiece-style BPEs with ``byte_fallback``
(Llama-2's ``Replace/ByteFallback/Fuse/Strip`` decoder and the newer ``Metaspace`` decoder), for random id
sequences (hypothesis), for real text, and around special tokens and prompts. Also `TokenBytes`, the per-token
bytes of logprobs.
"""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.io.token_bytes import TokenBytes
from astrai.io.tokenizer import Tokenizer, train_tokenizer
from helpers import sentencepiece_tokenizer

BYTE_CORPUS = ["Hello world, streaming one token at a time.", "中文文本，很好。", "naïve café"] * 10
# No CJK or emoji here, so those reach the sentencepiece-style tokenizers only through byte fallback.
SP_CORPUS = ["Hello world, the quick brown fox jumps.", "Streaming text one token at a time.", "naïve café"] * 10
TEXTS = ["Hello world", " two  spaces ", "中文 😀 and 🎉🎉", "naïve café\n\nnew line", "x😀y", "a"]
FFFD = "\ufffd"


@functools.cache
def byte_level() -> Tokenizer:
    return train_tokenizer(BYTE_CORPUS, vocab_size=300, bos_token="<|begin|>")


@functools.cache
def sentencepiece(style: str) -> Tokenizer:
    """A Llama-style BPE: ▁ word marker, 256 ``<0xNN>`` byte tokens at ids 3..258, BOS added on encode."""
    return sentencepiece_tokenizer(SP_CORPUS, style=style, vocab_size=160)


def tokenizer_for(kind: str) -> Tokenizer:
    return byte_level() if kind == "byte_level" else sentencepiece(kind)


KINDS = ["byte_level", "llama2", "metaspace"]


def stream(tok: Tokenizer, ids: list[int], *, skip: bool = True, prompt: list[int] = ()) -> list[str]:
    detok = tok.detokenizer(skip_special_tokens=skip, prompt_ids=prompt)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert detok.text == "".join(deltas)
    return deltas


def test_sentencepiece_fixture_uses_byte_fallback() -> None:
    tok = sentencepiece("llama2")
    ids = tok.encode("中😀", add_special_tokens=False)
    assert len(tok.byte_fallback_ids) == 256 and set(ids[1:]) <= tok.byte_fallback_ids and len(ids) == 8
    assert byte_level().byte_fallback_ids == frozenset()


# (which pool, index): pool 0 is any id, 1 a byte token (where the hard cases are), 2 the specials 0..2.
RAW_IDS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 16)), max_size=30)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(raw=RAW_IDS, skip=st.booleans())
def test_random_ids_match_full_decode(kind: str, raw: list[tuple[int, int]], skip: bool) -> None:
    tok = tokenizer_for(kind)
    pools = [range(tok.vocab_size), sorted(tok.byte_fallback_ids) or range(3, 259), range(3)]
    ids = [pools[p][i % len(pools[p])] for p, i in raw]
    deltas = stream(tok, ids, skip=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert not any(d.endswith(FFFD) for d in deltas[:-1])  # only flush may end mid-character


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=30, deadline=None)
@given(text=st.text(max_size=40))
def test_valid_text_streams_without_replacement_chars(kind: str, text: str) -> None:
    tok = tokenizer_for(kind)
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert all(FFFD not in d for d in deltas) or FFFD in text


@pytest.mark.parametrize("kind", KINDS)
def test_emoji_split_over_tokens_emitted_once_complete(kind: str) -> None:
    tok = tokenizer_for(kind)
    ids = tok.encode("x😀x", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert sum(p.endswith(FFFD) for p in pieces) >= 1 and len(ids) >= 4  # the emoji really is split
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == tok.decode(ids, skip_special_tokens=False)
    assert all(FFFD not in d for d in deltas)
    assert len([d for d in deltas if "😀" in d]) == 1
    if kind == "byte_level":  # no byte-fallback hold: the character comes out alone, as soon as it is complete
        assert deltas[len(ids) - 2] == "😀"  # emitted by the token that completes it, before the final "x"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", TEXTS)
def test_text_roundtrip_and_add_many(kind: str, text: str) -> None:
    tok = tokenizer_for(kind)
    ids = tok.encode(text)
    assert "".join(stream(tok, ids)) == tok.decode(ids)
    detok = tok.detokenizer()
    chunks = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    assert "".join(detok.add_many(c) for c in chunks) + detok.flush() == tok.decode(ids)
    assert detok.token_ids == ids


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens(kind: str) -> None:
    tok = tokenizer_for(kind)
    eos = tok.eos_token_id
    ids = [*tok.encode("Hello"), eos, *tok.encode(" world", add_special_tokens=False)]
    for skip in (True, False):
        streamed = "".join(stream(tok, ids, skip=skip))
        assert streamed == tok.decode(ids, skip_special_tokens=skip)
        assert (tok.eos_token in streamed) is not skip


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_context_keeps_leading_space(kind: str) -> None:
    tok = tokenizer_for(kind)
    prompt = tok.encode("Hello there, this is the prompt")
    # Sentencepiece-style encoding adds the word-boundary "▁" itself; byte-level needs the space in the text.
    gen = tok.encode("world 😀 fox" if tok.byte_fallback_ids else " world 😀 fox", add_special_tokens=False)
    expected = tok.decode(prompt + gen)[len(tok.decode(prompt)) :]
    assert expected == " world 😀 fox"
    if tok.byte_fallback_ids:
        assert tok.decode(gen) == "world 😀 fox"  # decoding the generated ids alone loses the space
    assert "".join(stream(tok, gen, prompt=prompt)) == expected


def test_window_stays_short() -> None:
    """Each step decodes a few tokens, not the whole sequence (O(window) per token)."""
    tok = byte_level()
    ids = tok.encode("Hello world, streaming one token at a time. 中文 " * 30)
    lengths = []
    detok = tok.detokenizer()
    real_decode = tok.decode
    tok.decode = lambda i, **kw: lengths.append(len(i)) or real_decode(i, **kw)  # type: ignore[method-assign]
    try:
        text = "".join(detok.add(i) for i in ids) + detok.flush()
    finally:
        del tok.decode
    assert text == tok.decode(ids) and len(ids) > 300
    assert max(lengths) <= 8


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(kind: str, text: str) -> None:
    """Each token's own bytes (logprobs' `bytes`) join to the decoded text; a lone byte token is one byte."""
    tok = tokenizer_for(kind)
    pieces = TokenBytes(tok)
    ids = tok.encode(text, add_special_tokens=False)
    joined = b"".join(pieces.bytes(i) for i in ids).decode()
    # sentencepiece-style decoders strip the first word's "▁"; the token's own bytes keep it as a space
    assert joined == (" " if tok.byte_fallback_ids else "") + tok.decode(ids)
    assert pieces.bytes(tok.token_to_id(tok.bos_token)) == tok.bos_token.encode()
    if tok.byte_fallback_ids:
        assert pieces.bytes(tok.token_to_id("<0xF0>")) == b"\xf0" and pieces.text(tok.token_to_id("<0xF0>")) == FFFD

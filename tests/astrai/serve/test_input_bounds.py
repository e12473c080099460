"""Over-long input is refused on a character bound before the chat template renders or the tokenizer runs (issue 42,
item 2): the bound never exceeds a real tokenizer's count, every text route refuses far-over prompts without a
render or encode call, a prompt right at the limit still passes, and a server under a flood of over-long bodies
keeps its memory and answers a witness request promptly.
"""

from __future__ import annotations

import concurrent.futures
import random
import resource
import time

import httpx
import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.serve import input_bounds
from astrai.serve.app import build_app
from astrai.serve.input_bounds import TextBound, compute_text_bound, text_bound
from astrai.serve.server import ConnectionLimits, GracefulServer, server_config
from helpers import tiny_model_dir
from tests.astrai.serve.conftest import API_KEY, MODEL_NAME
from tests.astrai.serve.test_hostile_http import running

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CORPUS = ["hello world, this is a tiny corpus", "the quick brown fox jumps over the lazy dog", "héllo wörld ☃ 日本語"]


class _Backend:
    """A bare `tokenizers.Tokenizer` in the shape `text_bound` reads (`.backend`)."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self.backend = backend


def _trained(model, pre, normalizer=None, decoder=None, trainer=None) -> _Backend:
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer, tok.normalizer = pre, normalizer
    if decoder is not None:
        tok.decoder = decoder
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_special_tokens(["<|im_start|>", "<|a_long_special_token_text|>"])
    return _Backend(tok)


def _tokenizers() -> dict[str, _Backend]:
    byte_level = trainers.BpeTrainer(vocab_size=200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with_unk = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"])
    meta = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], initial_alphabet=list("abcdefghijklm▁"))
    return {
        "byte-level": _trained(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), trainer=byte_level),
        "whitespace-dropping": _trained(models.BPE(unk_token="[UNK]"), pre_tokenizers.Whitespace(), trainer=with_unk),
        "metaspace-unk": _trained(models.BPE(unk_token="<unk>"), pre_tokenizers.Metaspace(), trainer=meta,
                                  normalizer=normalizers.NFKC(), decoder=decoders.Metaspace()),
    }  # fmt: skip


def _texts(rng: random.Random) -> list[str]:
    pieces = ["hello", " world", "   ", "\n\n\t", "<|im_start|>", "<|a_long_special_token_text|>", "日本語", "é",
              "e\u0301", "\u1f00\u0345", "ﬁ", "\x00", "zzzzqqq", "the quick brown fox"]  # fmt: skip
    out = [p * 50 for p in pieces]
    out += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 200))) for _ in range(100)]
    return out


@pytest.mark.parametrize("kind", ["byte-level", "whitespace-dropping", "metaspace-unk"])
def test_bound_never_exceeds_the_real_count(kind):
    tok = _tokenizers()[kind]
    bound = compute_text_bound(tok)
    assert bound is not None and bound.drops_whitespace == (kind == "whitespace-dropping")
    for text in _texts(random.Random(0)):
        real = len(tok.backend.encode(text, add_special_tokens=False).ids)
        assert bound.min_tokens(bound.count(text)) <= real, (kind, text[:80])


def test_bound_is_tight_on_the_longest_token():
    # negative control for a bound too lax to matter: n copies of the longest entry are n tokens, and the bound says n
    tok = _tokenizers()["byte-level"]
    bound = compute_text_bound(tok)
    longest = "<|a_long_special_token_text|>"
    assert bound.chars_per_token == len(longest)
    assert len(tok.backend.encode(longest * 7).ids) == bound.min_tokens(bound.count(longest * 7)) == 7


def test_unbounded_tokenizers_have_no_bound():
    # a word-level model maps any unknown word to one token: no character bound exists, nothing is refused early
    word = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    assert compute_text_bound(_Backend(word)) is None
    bert = _tokenizers()["byte-level"]
    bert.backend.normalizer = normalizers.BertNormalizer()  # deletes control characters: no bound
    assert compute_text_bound(bert) is None
    # a BPE without an unknown token drops characters outside its vocabulary: 1000 Ω are one token (the ▁ prefix)
    dropping = _trained(models.BPE(), pre_tokenizers.Metaspace(), trainer=trainers.BpeTrainer(vocab_size=100))
    assert len(dropping.backend.encode("Ω" * 1000).ids) == 1 and compute_text_bound(dropping) is None
    assert TextBound(4, drops_whitespace=True).count("a  b\n\tc") == 3


# ---- through the real server ------------------------------------------------------------------------------------
class _Counting:
    """Counts the tokenizer's render and encode calls (the work the bound must avoid)."""

    def __init__(self, monkeypatch, tokenizer) -> None:
        self.calls = 0
        for name in ("encode", "encode_nogil", "encode_chat", "apply_chat_template", "_render"):
            original = getattr(tokenizer, name)
            monkeypatch.setattr(tokenizer, name, self._wrap(original))

    def _wrap(self, original):
        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        return counted


def _limit_chars(server) -> tuple[int, int]:
    """(the server's context, the characters beyond which the bound refuses)."""
    reply = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL_NAME, "prompt": "hi"}, headers=AUTH,
                       timeout=10)  # fmt: skip
    context = reply.json()["max_model_len"]
    return context, context * text_bound(server.tokenizer).chars_per_token


def _requests(text: str) -> list[tuple[str, dict]]:
    user = [{"role": "user", "content": text}]
    return [
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": user, "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": text, "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": ["hi", text], "max_tokens": 1}),
        ("/v1/responses", {"model": MODEL_NAME, "input": text, "max_output_tokens": 16}),
        ("/v1/messages", {"model": MODEL_NAME, "messages": user, "max_tokens": 1}),
        ("/v1/messages/count_tokens", {"model": MODEL_NAME, "messages": user}),
        ("/tokenize", {"model": MODEL_NAME, "prompt": text}),
        ("/tokenize", {"model": MODEL_NAME, "messages": user}),
    ]


def test_over_long_prompts_are_refused_without_rendering_or_tokenizing(server, monkeypatch):
    context, limit = _limit_chars(server)
    counting = _Counting(monkeypatch, server.tokenizer)
    for path, body in _requests("hello world " * (limit // 12 + 10)):
        reply = httpx.post(server.base_url + path, json=body, headers={**AUTH, "x-api-key": API_KEY}, timeout=30)
        assert reply.status_code == 400, (path, reply.text[:200])
        error = reply.json()["error"]
        if path.startswith("/v1/messages"):
            assert error["type"] == "invalid_request_error" and "prompt is too long" in error["message"]
        else:
            assert error["code"] == "context_length_exceeded", (path, error)
            assert f"maximum context length is {context} tokens" in error["message"]
            assert error["param"] in ("messages", "prompt", "input"), error
        assert counting.calls == 0, f"{path} rendered or tokenized an over-long prompt"


def test_an_over_long_assistant_turn_is_refused_after_rendering_before_tokenizing(server, monkeypatch):
    # the pre-render check counts user turns only (templates may drop other text); the rest is checked rendered
    _, limit = _limit_chars(server)
    encoded = []
    monkeypatch.setattr(server.tokenizer, "encode_nogil", lambda *a, **k: encoded.append(1) or [0])
    monkeypatch.setattr(server.tokenizer, "encode_chat", lambda *a, **k: encoded.append(1) or [0])
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x " * limit},
                {"role": "user", "content": "again"}]  # fmt: skip
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", headers=AUTH, timeout=30,
                       json={"model": MODEL_NAME, "messages": messages, "max_tokens": 1})  # fmt: skip
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    assert not encoded


def test_a_prompt_right_at_the_limit_is_accepted(server):
    # the longest token (a special token's text, special in a raw prompt) repeated: exactly as many tokens as copies
    context, _ = _limit_chars(server)
    longest = max(server.tokenizer.backend.get_vocab(with_added_tokens=True), key=len)
    assert len(longest) == text_bound(server.tokenizer).chars_per_token
    fits = {"model": MODEL_NAME, "prompt": longest * (context - 1), "max_tokens": 1, "add_special_tokens": False}
    reply = httpx.post(f"{server.base_url}/v1/completions", json=fits, headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["usage"]["prompt_tokens"] == context - 1
    over = {**fits, "prompt": longest * context}  # one more: no room for the completion
    reply = httpx.post(f"{server.base_url}/v1/completions", json=over, headers=AUTH, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    count = httpx.post(
        f"{server.base_url}/tokenize",
        headers=AUTH,
        timeout=60,
        json={"model": MODEL_NAME, "prompt": longest * context, "add_special_tokens": False},
    )
    assert count.status_code == 200 and count.json()["count"] == context  # a count needs no room to generate


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.fixture(scope="module")
def big_bodies(tmp_path_factory):
    """A server taking 8 MB bodies (the issue's 7.2 MB prompts), so a flood of over-long prompts can arrive."""
    model = astrai.load(tiny_model_dir(tmp_path_factory.mktemp("bounds") / "m"))
    engine = Engine(model, EngineConfig(max_running=4, max_waiting=8, compile=False, kv_budget_tokens=2048))
    app = build_app(engine, model_name="m", max_body_bytes=8 << 20)
    config = server_config(app, ConnectionLimits(), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    with running(GracefulServer(config, engine)) as url:
        yield url
    engine.shutdown()


def test_a_flood_of_over_long_prompts_costs_little_memory_and_no_witness_latency(big_bodies):
    url, chat = big_bodies, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30).status_code == 200  # warm
    huge = {"model": "m", "messages": [{"role": "user", "content": "hello world " * 600_000}], "max_tokens": 1}
    before = _rss_bytes()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(httpx.post, f"{url}/v1/chat/completions", json=huge, timeout=60) for _ in range(4)]
        time.sleep(0.3)  # the bodies are arriving or being parsed
        start = time.monotonic()
        witness = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        waited = time.monotonic() - start
        replies = [f.result() for f in floods]
    grown = _rss_bytes() - before
    assert witness.status_code == 200
    assert all(r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded" for r in replies)
    # without the bound: each body is ~3M tokens (2.5 s of encoding, ~1 GB of encodings) on the same 2 CPUs
    assert waited < 2.0, f"the witness waited {waited:.2f} s behind the over-long prompts"
    assert grown < 400 << 20, f"RSS grew {grown >> 20} MiB"


def test_dropping_the_bound_is_what_makes_the_difference(server, monkeypatch):
    # the mutation the count test must catch, run as a test: with no bound the over-long prompt is tokenized
    _, limit = _limit_chars(server)
    monkeypatch.setattr(input_bounds, "tokens_over", lambda *a, **k: None)
    counting = _Counting(monkeypatch, server.tokenizer)
    body = {"model": MODEL_NAME, "prompt": "hello world " * (limit // 12 + 10), "max_tokens": 1}
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    assert counting.calls > 0

"""Embeddings share the encoder fairly (issue 42, item 3), through a live server on a free port.

A huge embeddings request once held the encoder for minutes: others queued behind it, a client that left did not
stop it, and a SIGTERM waited for it and logged a 500. Here the encoder runs in passes of a bounded number of
tokens on its own worker, taking turns between requests; each claim is checked by what the worker did (its
`passes` and `held` counters, `app.state.embedder`) or by the order in which answers come back, not by absolute
times. Vectors are compared with `astrai.embed_ids` on the same model (positive control).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn

import astrai
from astrai.inference.embed import plan_batches
from astrai.inference.engine import Engine, EngineConfig
from astrai.models.encoder import EncoderConfig
from astrai.serve.app import build_app
from astrai.serve.common import APIError
from astrai.serve.embeddings_api import ClientGone, Embedder, parse_embeddings
from astrai.serve.input_bounds import text_bound
from astrai.serve.server import GracefulServer
from helpers import assert_close, tiny_model_dir

KEY, MODEL = "test-key", "tiny-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
WIDTH = 1024  # tokens per row of the big requests; also the pass budget, so each pass is one such row
BUDGET = 250_000  # tokens per request
PATTERNS = 4  # distinct rows in a big request (their reference vectors are cheap to compute)


def _row(i: int, vocab: int, width: int = WIDTH) -> list[int]:
    return [(i * 31 + 7 * j) % vocab for j in range(width)]


def _big(rows: int, vocab: int) -> list[list[int]]:
    return [_row(i % PATTERNS, vocab) for i in range(rows)]


def _start(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    uv = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                       timeout_graceful_shutdown=2), app.state.engine)  # fmt: skip
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    return uv, thread, f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"


def _app(model, **kwargs):
    engine = Engine(model, EngineConfig(max_running=4, max_waiting=8, compile=False, kv_budget_tokens=2048))
    app = build_app(engine, model_name=MODEL, api_key=KEY, embeddings=EncoderConfig(pooling="mean"),
                    max_embedding_batch_tokens=WIDTH, **kwargs)  # fmt: skip
    return app, app.app.state.embedder  # behind the Guard, the Starlette app's state holds the embedder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("embed_fair") / "m"))


@pytest.fixture(scope="module")
def live(model):
    app, embedder = _app(model, max_embedding_tokens_per_request=BUDGET)
    uv, thread, base = _start(app)
    yield embedder, base
    uv.should_exit = True
    thread.join(timeout=20)


def _expected(model, rows) -> torch.Tensor:
    return astrai.embed_ids(model, rows, pooling="mean", normalize=True)


def _post(base: str, rows, timeout: float = 60) -> httpx.Response:
    body = {"model": MODEL, "input": rows, "encoding_format": "float"}
    return httpx.post(base + "/v1/embeddings", json=body, headers=HEADERS, timeout=timeout)


def _vectors(resp: httpx.Response) -> torch.Tensor:
    assert resp.status_code == 200, resp.text
    return torch.tensor([d["embedding"] for d in resp.json()["data"]])


def _wait(cond, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@contextlib.contextmanager
def _raw_request(base: str, rows) -> Iterator[socket.socket]:
    """Send an embeddings request on a raw socket; closing it (on exit) is the client leaving."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "input": rows}).encode()
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(head + body)
        yield sock
    finally:
        sock.close()


def _started(embedder, passes_before: int) -> None:
    _wait(lambda: embedder.held >= 1 and embedder.passes >= passes_before + 3, 30, "the big request never ran")


def test_passes_are_bounded_by_the_step_budget(live, model):
    embedder, base = live
    rows = [_row(i, model.config.vocab_size, WIDTH) for i in range(3)] + [[1, 2, 3]] * 5
    before = embedder.passes
    got = _vectors(_post(base, rows))
    # three full rows cannot share a pass of WIDTH tokens; the five short rows ride in a fourth
    assert embedder.passes - before == 4
    assert_close(got, _expected(model, rows), atol=1e-5)  # positive control: the same vectors as the facade


def test_plan_batches_keeps_each_pass_within_the_budget():
    lengths = [5, 900, 3, 64, 64, 2000, 17, 1, 300, 300, 300]
    for budget in (1, 64, 600, 1024, 10_000):
        passes = plan_batches(lengths, batch_size=4, max_batch_tokens=budget)
        assert sorted(i for p in passes for i in p) == list(range(len(lengths)))  # every row exactly once
        for p in passes:
            padded = len(p) * max(lengths[i] for i in p)
            assert len(p) <= 4 and (padded <= budget or len(p) == 1), (budget, p)  # only a lone row may pass it
    assert plan_batches(lengths, batch_size=32) == [sorted(range(len(lengths)), key=lambda i: -lengths[i])]


def test_an_abandoned_request_frees_the_encoder(live, model):
    embedder, base = live
    vocab = model.config.vocab_size
    before = embedder.passes
    with _raw_request(base, _big(240, vocab)):  # 240 passes
        _started(embedder, before)
        at_close = embedder.passes
    _wait(lambda: embedder.held == 0, 5, "the encoder still holds the abandoned request")
    freed = embedder.passes
    assert freed - at_close <= 30, f"{freed - at_close} passes ran after the client left"  # one, plus loop lag
    assert freed - before < 240
    witness = [[3, 1, 4, 1, 5, 9, 2, 6]]
    assert_close(_vectors(_post(base, witness, timeout=10)), _expected(model, witness), atol=1e-5)
    assert embedder.passes == freed + 1  # the witness's own pass; nothing of the abandoned request ran again


def test_a_small_request_is_not_stuck_behind_a_big_one(live, model):
    embedder, base = live
    vocab = model.config.vocab_size
    big, small = _big(120, vocab), [[9, 8, 7, 6, 5]]
    result: dict[str, httpx.Response] = {}
    before = embedder.passes
    thread = threading.Thread(target=lambda: result.setdefault("big", _post(base, big)), daemon=True)
    thread.start()
    _started(embedder, before)
    started = embedder.passes - before
    got = _post(base, small, timeout=30)
    overtaken = embedder.passes - before  # passes the big request had run when the small one was answered
    assert "big" not in result and embedder.held == 1, "the small request waited for the whole big one"
    assert overtaken - started <= 60, f"the small request waited for {overtaken - started} passes"  # of 120
    assert_close(_vectors(got), _expected(model, small), atol=1e-5)
    thread.join(timeout=60)
    patterns = _expected(model, big[:PATTERNS])  # the big one is whole and right (its rows repeat PATTERNS rows)
    assert_close(_vectors(result["big"]), patterns[torch.arange(len(big)) % PATTERNS], atol=1e-5)


def test_the_per_request_budget_is_a_400_naming_input(live, model):
    embedder, base = live
    vocab = model.config.vocab_size
    rows = [_row(i, vocab) for i in range(BUDGET // WIDTH)] + [[1] * (BUDGET % WIDTH + 1)]
    before = embedder.passes
    resp = _post(base, rows)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input", resp.text
    assert f"at most {BUDGET}" in resp.json()["error"]["message"]
    assert embedder.passes == before  # refused before any pass


class _CountingTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.texts = tokenizer, 0
        self.backend = tokenizer.backend  # what the character bound reads

    def encode_batch(self, texts):
        self.texts += len(texts)
        return self.tokenizer.encode_batch(texts)


class _State:
    def __init__(self, model, tokenizer) -> None:
        self.tokenizer, self.engine = tokenizer, type("E", (), {"model": model})()


def test_the_budget_is_exact_and_stops_tokenizing_early(model):
    state = _State(model, _CountingTokenizer(model.tokenizer))
    assert len(parse_embeddings(state, {"input": [[1] * 10]}, max_tokens=10).inputs[0]) == 10  # at the budget
    with pytest.raises(APIError) as err:
        parse_embeddings(state, {"input": [[1] * 6, [2] * 5]}, max_tokens=10)
    assert err.value.status == 400 and err.value.param == "input" and "11 tokens" in err.value.message
    texts = ["the quick brown fox jumps over the lazy dog"] * 2000
    with pytest.raises(APIError, match="at most 100 per request"):
        parse_embeddings(state, {"input": texts}, max_tokens=100)
    assert state.tokenizer.texts <= 64  # one chunk, not all 2000 texts
    ok = parse_embeddings(state, {"input": texts[:3]}, max_tokens=100)
    assert ok.inputs == model.tokenizer.encode_batch(texts[:3])


def test_over_long_text_is_refused_on_its_characters_before_tokenizing(model):
    state = _State(model, _CountingTokenizer(model.tokenizer))
    context = model.config.max_position_embeddings
    per_token = text_bound(model.tokenizer).chars_per_token
    long = "ab " * (context * per_token // 3 + 10)  # more characters than `context` tokens can hold
    with pytest.raises(APIError) as err:
        parse_embeddings(state, {"input": ["hi", long]}, max_tokens=10 * context)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded" and err.value.param == "input"
    assert "input[1]" in err.value.message and f"maximum context length is {context}" in err.value.message
    many = ["ab " * (context // 4)] * 40  # each fits; together past the budget on characters alone
    with pytest.raises(APIError, match="at most 64 per request"):
        parse_embeddings(state, {"input": many}, max_tokens=64)
    assert state.tokenizer.texts == 0  # neither was tokenized
    fits = "ab " * (context // 8)  # positive control: a text that fits is tokenized
    got = parse_embeddings(state, {"input": [fits]}, max_tokens=context)
    assert got.inputs == model.tokenizer.encode_batch([fits]) and state.tokenizer.texts == 1


def test_tokenizing_stops_when_the_client_left(model):
    state, gone = _State(model, _CountingTokenizer(model.tokenizer)), threading.Event()
    texts = ["the quick brown fox"] * 200
    assert len(parse_embeddings(state, {"input": texts}, gone=gone).inputs) == 200  # positive control
    assert state.tokenizer.texts == 200
    gone.set()
    with pytest.raises(ClientGone):
        parse_embeddings(state, {"input": texts}, gone=gone)
    assert state.tokenizer.texts == 200  # nothing more was tokenized


def test_the_worker_holds_a_bounded_number_of_requests_and_refuses_once_down(model):
    down: dict[str, str | None] = {"why": None}
    embedder = Embedder(model, EncoderConfig(), max_batch_tokens=16, unavailable=lambda: down["why"], max_queued=1)

    async def scenario() -> None:
        gone = threading.Event()
        first = asyncio.create_task(embedder.run([[1] * 16] * 500, gone))  # 500 passes
        await asyncio.sleep(0)  # it is held now
        with pytest.raises(APIError) as err:
            await embedder.run([[1]], threading.Event())
        assert err.value.status == 429
        gone.set()
        with pytest.raises(ClientGone):
            await first
        assert embedder.passes < 500
        vectors = await embedder.run([[1, 2]], threading.Event())  # room again: positive control
        assert_close(vectors, astrai.embed_ids(model, [[1, 2]]), atol=1e-5)
        down["why"] = "the engine was shut down"
        with pytest.raises(APIError) as err:
            await embedder.run([[1]], threading.Event())
        assert err.value.status == 503 and "shut down" in err.value.message

    try:
        asyncio.run(scenario())
    finally:
        embedder.close()


def test_shutdown_ends_embeddings_with_a_503(model):
    app, embedder = _app(model, max_embedding_tokens_per_request=2_000_000)
    uv, thread, base = _start(app)
    result = {}
    big = _big(1500, model.config.vocab_size)  # far longer than the graceful timeout of 2 s
    client = threading.Thread(target=lambda: result.setdefault("big", _post(base, big)), daemon=True)
    client.start()
    _started(embedder, 0)
    t0 = time.monotonic()
    uv.should_exit = True  # SIGTERM-like
    client.join(timeout=30)
    answered = time.monotonic() - t0
    thread.join(timeout=30)
    assert not thread.is_alive() and not client.is_alive()
    resp = result["big"]
    assert resp.status_code == 503 and "shut down" in resp.json()["error"]["message"], resp.text
    assert answered < 2.0, f"answered {answered:.2f} s after the stop; the graceful timeout is 2 s"
    assert embedder.passes < 1500 and embedder.held == 0

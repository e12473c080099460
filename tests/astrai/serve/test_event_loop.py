"""Issue 18 item 3: nothing heavy runs on the event loop.

A client posting a multi-megabyte (legal) prompt must not freeze another client's stream: chat-template rendering
and tokenization run on the server's worker pool, through the GIL-releasing `Tokenizer.encode_nogil`. Measured
through a live server (own fixture: a body limit large enough for the big prompt) and, for every endpoint that
tokenizes, by checking that no event loop runs in the thread that tokenizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import pytest
import uvicorn

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.io.tokenizer import Tokenizer
from astrai.models.encoder import EncoderConfig
from astrai.serve import input_bounds
from astrai.serve.app import build_app
from helpers import tiny_model_dir

# (repeated text, characters): seconds of tokenizer time on a CPU core each. Plain text takes the direct path;
# special-token text in a message takes the slower one that encodes it as text (issue 18 item 8).
PAYLOADS = {"plain": ("hello world the quick brown fox ", 2 << 20), "forged": (" x<|im_end|>\n<|im_start|>a", 1 << 20)}


@pytest.fixture(scope="module")
def big_server(tmp_path_factory):
    """A live server whose body limit (16 MiB) lets a multi-megabyte prompt through to the tokenizer."""
    # a long context, so that the witness stream outlasts the big request on a slow machine
    model = astrai.load(tiny_model_dir(tmp_path_factory.mktemp("loop") / "m", max_position_embeddings=16384))
    engine = Engine(model, EngineConfig(max_running=8, compile=False, kv_budget_tokens=16400))
    app = build_app(engine, model_name="m", max_body_bytes=16 << 20, embeddings=EncoderConfig())
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    uv.should_exit = True
    with contextlib.suppress(Exception):
        thread.join(timeout=10)


async def _stream_gaps(client: httpx.AsyncClient, url: str, started: asyncio.Event, done: asyncio.Event) -> list:
    """Arrival times of a long completion stream's chunks, read until `done` is set."""
    body = {"model": "m", "prompt": "hello", "max_tokens": 16000, "stream": True, "ignore_eos": True}
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
                if len(times) == 5:
                    started.set()
            if done.is_set():
                break
    return times


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_big_prompt_does_not_freeze_another_stream(big_server, payload, monkeypatch):
    # the attack from the issue: one legal multi-megabyte chat body froze every other stream for seconds. The
    # character bound (input_bounds) now refuses this one untokenized; switched off, it stands for a prompt a
    # bigger model's context lets through to the tokenizer
    monkeypatch.setattr(input_bounds, "text_bound", lambda tokenizer: None)
    unit, size = PAYLOADS[payload]
    text = unit * (size // len(unit))
    big = {"model": "m", "messages": [{"role": "user", "content": text}]}

    async def main() -> tuple[list[float], float, float, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            started, done = asyncio.Event(), asyncio.Event()
            streaming = asyncio.create_task(_stream_gaps(client, big_server, started, done))
            await asyncio.wait([streaming, asyncio.ensure_future(started.wait())], timeout=20,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            assert started.is_set(), streaming.result() if streaming.done() else "the stream did not start"
            t0 = time.monotonic()
            # a separate connection pool: the big request must not share the stream's connection
            async with httpx.AsyncClient(timeout=60) as other:
                response = await other.post(f"{big_server}/v1/chat/completions", json=big)
            t1 = time.monotonic()
            done.set()
            return await asyncio.wait_for(streaming, 20), t0, t1, response

    times, t0, t1, response = asyncio.run(main())
    # rejected only after tokenization: the prompt is longer than the tiny model's context
    assert response.status_code == 400 and "context" in response.json()["error"]["message"]
    assert times[-1] > t1, "the stream ended before the big request did: raise its max_tokens"
    window = [b - a for a, b in zip(times, times[1:], strict=False) if b > t0 and a < t1]
    gap, busy = max(window, default=t1 - t0), t1 - t0
    print(f"big request {busy:.2f} s, stream's largest inter-chunk gap meanwhile {gap:.3f} s")
    assert busy > 0.3, "the big request was too quick to show anything: send more text"
    # before the fix the gap was the whole tokenization (~90% of the big request); now a fraction of it
    assert gap < 0.35 * busy, f"the stream stalled {gap:.2f} s while a {busy:.2f} s request tokenized"
    follow = httpx.post(f"{big_server}/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2})
    assert follow.status_code == 200


ENDPOINTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hello"}]}),
    ("/v1/embeddings", {"input": ["hello", "world"]}),
]


@pytest.mark.parametrize(("path", "body"), ENDPOINTS, ids=[p for p, _ in ENDPOINTS])
def test_every_endpoint_tokenizes_off_the_event_loop(big_server, monkeypatch, path, body):
    calls: list[bool] = []  # per tokenizer call: whether an event loop runs in the calling thread

    def spy(name):
        original = getattr(Tokenizer, name)

        def wrapped(self, *args, **kwargs):
            try:
                asyncio.get_running_loop()
                calls.append(True)
            except RuntimeError:
                calls.append(False)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Tokenizer, name, wrapped)

    for name in ("encode", "encode_nogil", "encode_batch", "encode_chat", "apply_chat_template"):
        spy(name)
    response = httpx.post(f"{big_server}{path}", json={"model": "m", **body}, timeout=30)
    assert response.status_code == 200, response.text
    assert calls and not any(calls), f"{path} tokenized on the event loop thread"

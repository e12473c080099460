"""Slow readers (issue 42, item 5): a stream whose client stops reading is aborted once a send stayed blocked for
the server's `stream_stall_timeout`, freeing its decode slot and KV, instead of generating on into an unbounded
queue; a client that reads, however long the stream takes, is never cut.

Through the session's live server (tests/astrai/serve/conftest.py), its engine paced (a few ms per step) so that
a stream outlasts the timeout; the timeout is set small on its `ServerState` for the test.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

API_KEY, MODEL_NAME = "test-key", "tiny-test"  # the conftest server's
STEP_S = 0.003  # the engine's pace: 1000 tokens take >= 3 s
TIMEOUT_S = 0.5
# ~1.3 KB per chunk, ~10 MB in all: more than the kernel's buffers hold
BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 1000,
        "logprobs": True, "top_logprobs": 20, "stream": True}  # fmt: skip


@pytest.fixture
def paced(server, monkeypatch):
    """The live server with a slow engine and a `TIMEOUT_S` stall timeout; the model says a long text."""
    runner = server.engine.runner

    def slow_execute(plan, *, vocab_size):
        time.sleep(STEP_S)
        return type(runner).execute(runner, plan, vocab_size=vocab_size)

    monkeypatch.setattr(runner, "execute", slow_execute)
    monkeypatch.setattr(server.app.state, "stream_stall_timeout", TIMEOUT_S)
    server.script("hello world, " * 400)
    return server


def _request(server) -> bytes:
    body = json.dumps(BODY).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip


def _wait_until_idle(server, seconds: float) -> float | None:
    """Seconds until the engine holds no request (None: still busy after `seconds`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        stats = server.engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def _stalled_client(server) -> socket.socket:
    """A connection that sent the stream request, saw it start generating, and from then on reads nothing."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's send blocks soon
        sock.settimeout(10)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(_request(server))
        t0 = time.monotonic()
        while server.engine.stats().running < BODY["n"] and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert server.engine.stats().running == BODY["n"]
    except BaseException:
        sock.close()
        raise
    return sock


def test_a_client_that_stops_reading_is_aborted_and_its_slot_freed(paced):
    with _stalled_client(paced) as sock:
        idle = _wait_until_idle(paced, 10)
        # generating all 1000 tokens takes >= 3 s; the abort comes once the window fills, plus TIMEOUT_S
        assert idle is not None and idle < 1000 * STEP_S, idle
        assert paced.kv_in_use() == 0
        received, deadline = b"", time.monotonic() + 10  # reading again: what was buffered, then the close
        while time.monotonic() < deadline and (chunk := sock.recv(1 << 16)):
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received and not chunk  # cut, closed


def test_a_slow_but_reading_client_is_not_cut(paced):
    """Positive control: the same stream, read (slowly at first) to the end, outlasting the timeout many times."""
    t0, events = time.monotonic(), []
    with httpx.Client(timeout=30) as c, c.stream("POST", paced.base_url + "/v1/chat/completions", json=BODY,
                                                 headers={"Authorization": f"Bearer {API_KEY}"}) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 5:
                    time.sleep(TIMEOUT_S / 2)  # a pause under the timeout
    assert events[-1] == "data: [DONE]" and time.monotonic() - t0 > 1000 * STEP_S > 4 * TIMEOUT_S
    finishes = [c for e in events[:-1] for c in json.loads(e[6:])["choices"] if c["finish_reason"]]
    assert sorted(c["finish_reason"] for c in finishes) == ["length"] * 8


def test_no_timeout_waits_for_the_reader(paced, monkeypatch):
    """Negative control: with the timeout off (None) the stalled stream keeps its slot past the timeout."""
    monkeypatch.setattr(paced.app.state, "stream_stall_timeout", None)
    with _stalled_client(paced):
        assert _wait_until_idle(paced, 4 * TIMEOUT_S) is None  # still generating (or held) after 4 timeouts
    # closing the socket is a disconnect, which aborts it (the conftest's wait_idle checks the server is idle)


def test_astrai_servers_drop_the_stalled_connection_at_once(paced):
    """Under `astrai serve`'s protocol (`server.server_config`) the stalled connection is dropped unflushed (the
    transport's abort): the client, reading again, gets less than was generated and a reset or EOF, and uvicorn
    logs no "returned without completing response" error."""
    import logging
    import threading

    import uvicorn

    from astrai.serve.server import ConnectionLimits, server_config

    app = paced.app  # the same app and engine, behind astrai's own protocol on another port
    config = server_config(app, ConnectionLimits(), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    errors: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: errors.append(record.getMessage()) if record.levelno >= logging.ERROR else None
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        other = type(paced).__new__(type(paced))
        other.__dict__.update(paced.__dict__, port=uv.servers[0].sockets[0].getsockname()[1])
        with _stalled_client(other) as sock:
            idle = _wait_until_idle(paced, 10)
            assert idle is not None and idle < 1000 * STEP_S, idle
            received, closed = b"", False
            try:
                while chunk := sock.recv(1 << 16):
                    received += chunk
                closed = True
            except ConnectionResetError:
                closed = True
            assert closed and b"[DONE]" not in received
        time.sleep(0.1)
        assert not [e for e in errors if "without completing" in e], errors
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
        uv.should_exit = True
        thread.join(timeout=20)

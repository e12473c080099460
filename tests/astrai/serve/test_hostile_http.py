"""The server against hostile HTTP clients (issue 18, items 1, 5, 7, 9): each test performs the attack over a real
socket to a live server on a free port, checks the safe answer, then that the server still serves normal requests.

The `guarded` server runs with small limits (a 256 KiB body, 1 s body and head deadlines, 8 connections) so the
attacks end in bounded time.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

import astrai
from astrai.inference.engine import Engine, EngineBusyError, EngineConfig
from astrai.serve.app import build_app
from astrai.serve.server import ConnectionLimits, GracefulServer, server_config
from helpers import tiny_model_dir

LIMIT = 256 << 10  # the guarded server's --max-body-bytes
TIMEOUT = 1.0  # its --body-timeout and --header-timeout, seconds
MAX_CONNECTIONS = 8
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@contextlib.contextmanager
def running(server: uvicorn.Server) -> Iterator[str]:
    """Run `server` in a thread; yields its base URL, stops it on exit."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = astrai.load(tiny_model_dir(tmp_path_factory.mktemp("hostile") / "m"))
    engine = Engine(model, EngineConfig(max_running=4, max_waiting=8, compile=False, kv_budget_tokens=2048))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def guarded(engine):
    app = build_app(engine, model_name="m", max_body_bytes=LIMIT, body_timeout=TIMEOUT)
    limits = ConnectionLimits(header_timeout=TIMEOUT, max_connections=MAX_CONNECTIONS)
    config = server_config(app, limits, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    with running(GracefulServer(config, engine)) as url:
        yield url


def port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def assert_serves(url: str) -> None:
    """The server still answers /health and a normal chat completion."""
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    reply = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def read_until_closed(sock: socket.socket, seconds: float) -> tuple[bytes, bool]:
    """What the server sends within `seconds`, and whether it closed the connection."""
    sock.settimeout(0.2)
    data, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def trickle(sock: socket.socket, data: bytes, every: float = 0.2) -> tuple[bytes, bool]:
    """Send `data` one byte every `every` seconds until the server closes; what it answered, and whether it did."""
    answer = b""
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
        got, closed = read_until_closed(sock, every)
        answer += got
        if closed:
            return answer, True
    got, closed = read_until_closed(sock, every)  # the server cut the upload: what it said before closing
    return answer + got, closed


def head(method: str, path: str, *, host: str = "127.0.0.1", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}".encode()


# ---- item 1: body limit for chunked requests ----------------------------------------------------------------------


def test_chunked_body_is_413_the_moment_it_passes_the_limit(guarded):
    # the attack: a Transfer-Encoding: chunked body (no Content-Length to check up front)
    with socket.create_connection(("127.0.0.1", port(guarded)), timeout=5) as sock:
        sock.sendall(head("POST", "/v1/chat/completions", extra="Content-Type: application/json\r\n"
                          "Transfer-Encoding: chunked\r\n\r\n"))  # fmt: skip
        chunk = b"a" * (16 << 10)
        for _ in range(LIMIT // len(chunk) + 1):  # one chunk past the limit, and the body not finished
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        answer, closed = read_until_closed(sock, 5)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b'"error"' in answer and b"limit" in answer and closed  # OpenAI's shape; the connection is not kept
    assert_serves(guarded)


def test_endless_chunked_upload_is_cut_with_bounded_memory(guarded):
    # an endless body sent as fast as the socket takes it: the server answers, stops reading and closes within
    # seconds, and its memory (same process: traced here) does not grow with the upload
    tracemalloc.start()
    try:
        with socket.create_connection(("127.0.0.1", port(guarded)), timeout=5) as sock:
            sock.sendall(head("POST", "/v1/messages", extra="Content-Type: application/json\r\n"
                              "Transfer-Encoding: chunked\r\n\r\n"))  # fmt: skip
            chunk, sent, cut, deadline = b"a" * (64 << 10), 0, False, time.monotonic() + 10
            while time.monotonic() < deadline and not cut:
                try:
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    sent += len(chunk)
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    cut = True
            answer, _ = read_until_closed(sock, 5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert cut, f"the server read all {sent} bytes"
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"type":"error"' in answer.replace(b" ", b"")  # Anthropic shape
    assert sent > 16 * LIMIT and peak < 16 * LIMIT, (sent, peak)  # under 4 MiB traced, with more than that read
    assert_serves(guarded)


def test_httpx_generator_upload_over_the_limit_gets_413(guarded):
    def body():
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(3 * LIMIT // 4096):
            yield b"a" * 4096
        yield b'"}]}'

    reply = httpx.post(f"{guarded}/v1/chat/completions", content=body(), timeout=10,
                       headers={"content-type": "application/json"})  # fmt: skip
    assert reply.status_code == 413 and "limit" in reply.json()["error"]["message"]
    assert_serves(guarded)


# ---- item 5: slow clients ------------------------------------------------------------------------------------------


def test_header_trickle_is_408_and_closed(guarded):
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port(guarded)), timeout=5) as sock:
        sock.sendall(head("GET", "/health"))
        answer, closed = trickle(sock, b"X-Slow: " + b"a" * 100)  # never a complete head
    assert closed and answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert time.monotonic() - started < TIMEOUT + 4
    assert_serves(guarded)


def test_idle_and_keep_alive_trickle_connections_are_closed(guarded):
    with socket.create_connection(("127.0.0.1", port(guarded)), timeout=5) as idle:  # connects, never sends
        answer, closed = read_until_closed(idle, TIMEOUT + 4)
    assert closed and answer.startswith(b"HTTP/1.1 408 ")
    with socket.create_connection(("127.0.0.1", port(guarded)), timeout=5) as sock:
        sock.sendall(head("GET", "/health", extra="\r\n"))  # one good request on a keep-alive connection ...
        time.sleep(0.3)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        sock.sendall(head("GET", "/health"))  # ... then the next head stalls
        answer, closed = read_until_closed(sock, TIMEOUT + 4)
    assert closed and answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def test_body_trickle_is_408_and_closed(guarded):
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port(guarded)), timeout=5) as sock:
        sock.sendall(head("POST", "/v1/chat/completions",
                          extra="Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"))  # fmt: skip
        answer, closed = trickle(sock, b" " * 50)
    assert closed and answer.startswith(b"HTTP/1.1 408 ") and b'"error"' in answer, answer[:200]
    assert time.monotonic() - started < TIMEOUT + 4
    assert_serves(guarded)


def test_connections_past_the_cap_get_503(guarded):
    time.sleep(0.2)  # earlier tests' connections are gone
    held = [socket.create_connection(("127.0.0.1", port(guarded)), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        with socket.create_connection(("127.0.0.1", port(guarded)), timeout=5) as extra:
            answer, closed = read_until_closed(extra, 1)
        assert closed and answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answer.lower()
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert_serves(guarded)


# ---- item 7: exposure with defaults --------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_post_without_json_content_type_is_415(guarded, content_type):
    # what a web page can send cross-site without a CORS preflight ("simple requests")
    headers = {"content-type": content_type} if content_type else {}
    content = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    openai = httpx.post(f"{guarded}/v1/chat/completions", content=content, headers=headers)
    assert openai.status_code == 415 and openai.json()["error"]["type"] == "invalid_request_error"
    anthropic = httpx.post(f"{guarded}/v1/messages", content=content, headers=headers)
    assert anthropic.status_code == 415 and anthropic.json()["type"] == "error"
    ok = httpx.post(f"{guarded}/v1/chat/completions", content=content,
                    headers={"content-type": "Application/JSON; charset=utf-8"})  # fmt: skip
    assert ok.status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example"])
def test_foreign_host_on_loopback_is_400(guarded, host):
    # DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1
    for path in ("/health", "/metrics", "/v1/models"):
        reply = httpx.get(f"{guarded}{path}", headers={"host": host})
        assert reply.status_code == 400 and "Host" in reply.json()["error"]["message"]
    chat = httpx.post(f"{guarded}/v1/chat/completions", json=CHAT, headers={"host": host})
    assert chat.status_code == 400


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1:80", "[::1]:8000", "localhost."])
def test_loopback_hosts_are_accepted(guarded, host):
    assert httpx.get(f"{guarded}/health", headers={"host": host}).status_code == 200


def test_allowed_hosts_lists_extra_names_or_all(engine):
    for allowed, host, status in [(("api.example",), "api.example:443", 200), (("api.example",), "evil.example", 400),
                                  (("api.example",), "localhost", 200), (("*",), "evil.example", 200)]:  # fmt: skip
        app = build_app(engine, model_name="m", allowed_hosts=allowed)
        config = server_config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        with running(uvicorn.Server(config)) as url:
            assert httpx.get(f"{url}/health", headers={"host": host}).status_code == status, (allowed, host)


def test_api_key_is_compared_in_constant_time(engine, monkeypatch):
    import hmac

    calls = []

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", spy)
    app = build_app(engine, model_name="m", api_key="s3cret-ключ")  # a non-ASCII key: compared as UTF-8 bytes
    with running(uvicorn.Server(server_config(app, host="127.0.0.1", port=0, log_level="warning",
                                              lifespan="off"))) as url:  # fmt: skip
        key = "s3cret-ключ".encode()
        for headers, status in [({b"authorization": b"Bearer " + key}, 200), ({b"x-api-key": key}, 200),
                                ({b"authorization": b"bearer " + key}, 200), ({b"x-api-key": b"s3cret"}, 401),
                                ({b"x-api-key": b"\xff\xfe"}, 401), ({}, 401)]:  # fmt: skip
            assert httpx.get(f"{url}/v1/models", headers=headers).status_code == status, headers
    assert calls and all(b == key for _, b in calls)


# ---- item 9: protocol polish ---------------------------------------------------------------------------------------


def test_404_and_405_in_the_api_shape(guarded):
    missing = httpx.get(f"{guarded}/v1/nope")
    assert missing.status_code == 404 and "Invalid URL (GET /v1/nope)" in missing.json()["error"]["message"]
    anthropic = httpx.post(f"{guarded}/v1/messages/nope", json={})
    assert anthropic.status_code == 404 and anthropic.json()["error"]["type"] == "not_found_error"
    wrong_method = httpx.get(f"{guarded}/v1/chat/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert "POST" in wrong_method.headers["allow"]
    messages = httpx.delete(f"{guarded}/v1/messages")
    assert messages.status_code == 405 and messages.json()["type"] == "error"
    assert_serves(guarded)


def test_busy_answers_carry_retry_after(server, monkeypatch):
    def busy(*args, **kwargs):
        raise EngineBusyError("64 requests are already waiting")

    monkeypatch.setattr(server.engine, "submit", busy)
    auth = {"x-api-key": "test-key"}
    openai = httpx.post(f"{server.base_url}/v1/chat/completions", json={**CHAT, "model": "tiny-test"}, headers=auth)
    assert openai.status_code == 429 and openai.headers["retry-after"] == "1"
    body = {"model": "tiny-test", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    anthropic = httpx.post(f"{server.base_url}/v1/messages", json=body, headers=auth)
    assert anthropic.status_code == 529 and anthropic.headers["retry-after"] == "1"
    assert anthropic.json()["error"]["type"] == "overloaded_error"

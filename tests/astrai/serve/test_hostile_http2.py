"""The server against hostile HTTP clients, second round (issue 42, items 6 and 8): request framing (a head over the
limit sent in one write; Content-Length beside Transfer-Encoding), the error shape of refusals made before routing
on /v1/messages, and API keys in the query string kept out of the access log. Each attack goes over a real socket
to a live server on a free port, beside a positive control (the same request made acceptable is served).

The `guarded` server runs `server_config`'s protocol with small limits (8 connections, 1 s head and body
deadlines, an API key) so the attacks end in bounded time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.serve import server as server_module
from astrai.serve.app import build_app
from astrai.serve.server import ConnectionLimits, GracefulServer, redact_query, scan_head, server_config
from helpers import tiny_model_dir

KEY = "k-secret"
TIMEOUT = 1.0  # the guarded server's body and head deadlines, seconds
MAX_CONNECTIONS = 8
HEAD_LIMIT = 16 << 10  # ConnectionLimits' default max_header_bytes
AUTH = f"Authorization: Bearer {KEY}\r\n"


@contextlib.contextmanager
def running(server: uvicorn.Server) -> Iterator[int]:
    """Run `server` in a thread; yields its port, stops it on exit."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = astrai.load(tiny_model_dir(tmp_path_factory.mktemp("hostile2") / "m"))
    engine = Engine(model, EngineConfig(max_running=4, max_waiting=8, compile=False, kv_budget_tokens=2048))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def guarded(engine) -> Iterator[int]:
    app = build_app(engine, model_name="m", api_key=KEY, max_body_bytes=64 << 10, body_timeout=TIMEOUT)
    limits = ConnectionLimits(header_timeout=TIMEOUT, max_connections=MAX_CONNECTIONS)
    config = server_config(app, limits, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    with running(GracefulServer(config, engine)) as port:
        yield port


def exchange(port: int, data: bytes, seconds: float = 3.0) -> tuple[bytes, bool]:
    """Send `data` in one write; what the server answers within `seconds`, and whether it closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        return read_until_closed(sock, seconds)


def read_until_closed(sock: socket.socket, seconds: float) -> tuple[bytes, bool]:
    sock.settimeout(0.1)
    data, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def answers(data: bytes) -> list[tuple[int, dict]]:
    """Each (status, JSON body) of the responses in `data` (Content-Length framed, as every answer here is)."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = int(next(v for k, _, v in (h.partition(": ") for h in lines[1:]) if k.lower() == "content-length"))
        out.append((int(lines[0].split()[1]), json.loads(rest[:length])))
        data = rest[length:]
    return out


def get(path: str, *, extra: str = "", close: bool = True) -> bytes:
    connection = "Connection: close\r\n" if close else ""
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{AUTH}{extra}{connection}\r\n".encode()


def padded_get(path: str, size: int, *, close: bool = True) -> bytes:
    """A GET head of exactly `size` bytes (an X-Pad header fills it)."""
    bare = len(get(path, extra="X-Pad: \r\n", close=close))
    return get(path, extra="X-Pad: " + "a" * (size - bare) + "\r\n", close=close)


# ---- item 6: framing ------------------------------------------------------------------------------------------------


def test_scan_head_reads_the_head_as_h11_does():
    raw = b"POST /v1/messages?x=1 HTTP/1.1\r\nHost: a\nContent-Length: 3\r\n folded: x\r\n\r\n"
    head = scan_head(raw + b"abc", 1000)
    assert (head.path, head.size) == (b"/v1/messages", len(raw))
    assert head.names == {b"host", b"content-length", b" folded"}  # a folded line names nothing h11 would read
    assert scan_head(b"GET /v1/mess", 1000) == scan_head(b"", 1000)  # no request line yet: nothing known
    assert scan_head(b"GET / HTTP/1.1\r\nX: " + b"a" * 100 + b"\r\n\r\n", 50).size is None  # searched up to the limit


@pytest.mark.parametrize("size", [HEAD_LIMIT + 1, 64 << 10, 200 << 10])
def test_head_over_the_limit_in_one_write_is_431_and_closed(guarded, size):
    # the attack: the whole over-long head in one write (h11's own limit only counts a head still incomplete)
    answer, closed = exchange(guarded, padded_get("/health", size))
    [(status, body)] = answers(answer)
    assert closed and status == 431 and "16384" in body["error"]["message"], answer[:300]
    # positive control: a head just under the limit, in one write too, is served
    [(status, body)] = answers(exchange(guarded, padded_get("/health", HEAD_LIMIT - 4))[0])
    assert status == 200 and body["status"] == "ok"


def test_head_over_the_limit_in_many_writes_is_431(guarded):
    with socket.create_connection(("127.0.0.1", guarded), timeout=5) as sock:
        data = padded_get("/v1/messages", 64 << 10)
        for i in range(0, len(data), 4096):
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(data[i : i + 4096])
        answer, closed = read_until_closed(sock, 3)
    [(status, body)] = answers(answer)
    assert closed and status == 431 and body["type"] == "error", answer[:300]  # the Anthropic shape on its path


def test_pipelined_head_over_the_limit_is_431_after_the_first_answer(guarded):
    # a small request, then in the same write a huge one: the second head is parsed only after the first answer
    answer, closed = exchange(guarded, get("/health", close=False) + padded_get("/health", 64 << 10))
    [(first, body), (second, error)] = answers(answer)
    assert (first, body["status"], second, closed) == (200, "ok", 431, True), answer[:300]
    assert "16384" in error["error"]["message"]


def chunked_post(path: str, framing: str) -> bytes:
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 1}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{AUTH}Content-Type: application/json\r\n{framing}\r\n"
    return head.encode() + (chunked if "chunked" in framing.lower() else body)


@pytest.mark.parametrize("framing", [
    "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
    "transfer-encoding: chunked\r\ncontent-length: 0\r\n",
    "TRANSFER-ENCODING: chunked\r\nContent-Length: 47\r\n",
])  # fmt: skip
def test_content_length_beside_transfer_encoding_is_400_and_closed(guarded, framing):
    # the attack: two framings for one body; a proxy in front going by the other one would see a different request
    # split (request smuggling). RFC 9112 section 6.1: answer, and close the connection in any case
    answer, closed = exchange(guarded, chunked_post("/v1/completions", framing) + get("/health"))
    [(status, body)] = answers(answer)  # the smuggled /health after it is never answered
    assert closed and status == 400 and "Transfer-Encoding" in body["error"]["message"], answer[:300]
    # positive controls: each framing alone is served, and keeps the connection for the next request
    for alone in ("Transfer-Encoding: chunked\r\n", "Content-Length: 47\r\n"):
        answer, closed = exchange(guarded, chunked_post("/v1/completions", alone) + get("/health"))
        assert [status for status, _ in answers(answer)] == [200, 200] and closed, answer[:300]


# ---- item 8c: a forced Anthropic tool call cut by max_tokens ------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": CITY}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def messages(server, body: dict) -> tuple[list[dict], str]:
    """(content, stop_reason) of a /v1/messages reply, non-streamed or (with body["stream"]) rebuilt from its events."""
    reply = httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": "test-key"}, timeout=60)
    assert reply.status_code == 200, reply.text
    if not body.get("stream"):
        return reply.json()["content"], reply.json()["stop_reason"]
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    blocks = [ev["content_block"] for ev in events if ev["type"] == "content_block_start"]
    return blocks, next(ev["delta"]["stop_reason"] for ev in events if ev["type"] == "message_delta")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}])
def test_tool_call_cut_by_max_tokens_leaves_no_empty_text_block(server, choice, stream):
    server.script(CALL)
    ids = server.tokenizer.encode(CALL, add_special_tokens=False)
    calls = len(ids)
    json_end = next(n for n in range(calls) if "}}" in server.tokenizer.decode(ids[:n]))  # the call's JSON closes
    body = {"model": "tiny-test", "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER],
            "tool_choice": choice, "stream": stream}  # fmt: skip
    for cut in (1, 3, json_end // 2, json_end - 1):  # in the start marker, in the name, in the arguments
        content, stop = messages(server, {**body, "max_tokens": cut})
        assert (content, stop) == ([], "max_tokens"), (cut, content)
    # positive control: with room for the whole call, it is the one tool_use block
    content, stop = messages(server, {**body, "max_tokens": calls + 8})
    assert [(b["type"], b["name"]) for b in content] == [("tool_use", "get_weather")] and stop == "tool_use"


def test_empty_reply_keeps_its_empty_text_block(server):
    # negative control: a reply that is empty (no markup dropped) is still the one empty text block, as before
    server.script("")
    body = {"model": "tiny-test", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    assert messages(server, body) == ([{"type": "text", "text": ""}], "end_turn")
    server.script("Let me check.\n" + CALL[:20])  # text, then a call cut short: the text stays, the markup goes
    calls = len(server.tokenizer.encode("Let me check.\n" + CALL[:20], add_special_tokens=False))
    content, stop = messages(server, {**body, "max_tokens": calls})
    assert (content, stop) == ([{"type": "text", "text": "Let me check."}], "max_tokens")


def test_cut_forced_call_agrees_with_the_openai_reply(server):
    # independent reference: OpenAI's chat route for the same cut forced call has no content and no tool_calls
    server.script(CALL)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}
    body = {"model": "tiny-test", "max_tokens": 6, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [tool], "tool_choice": "required"}  # fmt: skip
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body,
                       headers={"Authorization": "Bearer test-key"}, timeout=60).json()  # fmt: skip
    message = reply["choices"][0]["message"]
    assert not message.get("content") and not message.get("tool_calls"), message


def test_cut_closing_tag_is_not_content(server):
    server.script(CALL)
    calls = len(server.tokenizer.encode(CALL, add_special_tokens=False))
    body = {"model": "tiny-test", "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER],
            "tool_choice": {"type": "any"}, "max_tokens": calls - 1}  # fmt: skip
    content, _ = messages(server, body)
    assert [block["type"] for block in content] == ["tool_use"], content


# ---- item 8b: refusals before routing in the API's error shape ----------------------------------------------------

PATHS = {"/v1/messages": "anthropic", "/v1/messages/count_tokens": "anthropic", "/v1/chat/completions": "openai"}


def shape(body: dict) -> str:
    """Which API's error shape `body` has: Anthropic's {"type": "error", "error": {type, message}} or OpenAI's
    {"error": {message, type, param, code}}."""
    if body.get("type") == "error" and set(body["error"]) == {"type", "message"}:
        return "anthropic"
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return "openai"


def post_head(path: str, extra: str = "", *, auth: str = AUTH, host: str = "127.0.0.1") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}{extra}".encode()


JSON = "Content-Type: application/json\r\n"
CLOSE = "Connection: close\r\n"
GUARD_ATTACKS = {  # status: the request (each refused by app.Guard before any route runs)
    400: lambda p: post_head(p, JSON + "Content-Length: 2\r\n\r\n{}", host="evil.example"),  # DNS rebinding
    401: lambda p: post_head(p, JSON + "Content-Length: 2\r\n\r\n{}", auth=""),
    415: lambda p: post_head(p, "Content-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}"),
    413: lambda p: post_head(p, JSON + "Content-Length: 99999999\r\n\r\n"),
    408: lambda p: post_head(p, JSON + "Content-Length: 100\r\n\r\n{"),  # the rest of the body never comes
}
SERVER_ATTACKS = {  # refused by GuardedH11Protocol before uvicorn hands a request to the app
    408: lambda p: post_head(p, JSON),  # the head never ends
    431: lambda p: post_head(p, "X-Pad: " + "a" * (64 << 10) + "\r\n\r\n"),
    400: lambda p: post_head(p, JSON + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("where", "status"), [*(("guard", s) for s in GUARD_ATTACKS),
                                               *(("server", s) for s in SERVER_ATTACKS)])  # fmt: skip
def test_refusals_before_routing_use_the_paths_error_shape(guarded, path, where, status):
    attack = (GUARD_ATTACKS if where == "guard" else SERVER_ATTACKS)[status](path)
    answer, _ = exchange(guarded, attack, seconds=TIMEOUT + 2)
    [(got, body)] = answers(answer)
    assert got == status and shape(body) == PATHS[path], answer[:300]
    if status == 401 and PATHS[path] == "anthropic":
        assert body["error"]["type"] == "authentication_error"


def test_unparsable_request_is_400_in_the_paths_shape(guarded):
    for path, api in PATHS.items():
        answer, closed = exchange(guarded, post_head(path, "Not a header line\r\n\r\n"))
        [(status, body)] = answers(answer)
        assert (status, shape(body), closed) == (400, api, True), answer[:300]


def test_connection_cap_503_uses_the_paths_shape(guarded):
    time.sleep(0.3)  # earlier tests' connections are gone
    held = [socket.create_connection(("127.0.0.1", guarded), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        for path, api in [*PATHS.items(), (None, "openai")]:  # None: a client that sends nothing
            with socket.create_connection(("127.0.0.1", guarded), timeout=5) as extra:
                if path is not None:
                    extra.sendall(post_head(path, JSON + "Content-Length: 2\r\n\r\n{}"))
                answer, closed = read_until_closed(extra, 2)
            [(status, body)] = answers(answer)
            assert (status, shape(body), closed) == (503, api, True), answer[:300]
            assert b"retry-after: 1" in answer.lower()
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    # positive control: under the cap, the same request is served (a 400 from the route: the body is not a request)
    request = post_head("/v1/messages", JSON + CLOSE + "Content-Length: 2\r\n\r\n{}")
    [(status, body)] = answers(exchange(guarded, request)[0])
    assert status == 400 and shape(body) == "anthropic"


def test_connections_waiting_past_the_cap_are_bounded(guarded, monkeypatch):
    # a flood past the cap: only OVER_CAP_WAITING connections wait for their request line; any further one is
    # answered at once, so waiting connections cannot pile up
    monkeypatch.setattr(server_module, "OVER_CAP_WAITING", 2)
    monkeypatch.setattr(server_module, "OVER_CAP_WAIT_S", 30.0)  # capped by the head deadline: TIMEOUT
    time.sleep(0.3)
    held = [socket.create_connection(("127.0.0.1", guarded), timeout=5) for _ in range(MAX_CONNECTIONS)]
    waiting = [socket.create_connection(("127.0.0.1", guarded), timeout=5) for _ in range(2)]
    try:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", guarded), timeout=5) as extra:
            answer, closed = read_until_closed(extra, 2)
        assert closed and answer.startswith(b"HTTP/1.1 503 ") and time.monotonic() - started < TIMEOUT / 2
        for sock in waiting:  # the waiting ones are answered at the deadline
            answer, closed = read_until_closed(sock, TIMEOUT + 1)
            assert closed and answer.startswith(b"HTTP/1.1 503 ")
        assert time.monotonic() - started >= TIMEOUT * 0.8
    finally:
        for sock in held + waiting:
            sock.close()
    time.sleep(0.3)


# ---- item 8a: API keys in the query string stay out of the access log ----------------------------------------------


def test_redact_query_hides_credential_values_only():
    assert redact_query("/v1/models") == "/v1/models"
    assert redact_query("/v1/models?limit=5&api_key=SECRET&key=S2&x-api-key=S3&access_token=S4&Authorization=S5"
                        "&api%5Fkey=S6&order=asc") == ("/v1/models?limit=5&api_key=<redacted>&key=<redacted>"
                        "&x-api-key=<redacted>&access_token=<redacted>&Authorization=<redacted>&api%5Fkey=<redacted>"
                        "&order=asc")  # fmt: skip
    assert redact_query("/p?api_key=&flag&monkey=") == "/p?api_key=&flag&monkey="  # nothing to hide


@pytest.fixture
def access_log():
    """The messages the access log formats while the test runs (at INFO, whatever the server's level), with
    other libraries' filters on the logger set aside (litellm, once imported by another test, adds its own secret
    redaction to uvicorn.access, which would hide whether ours works)."""
    logger, lines = logging.getLogger("uvicorn.access"), []
    foreign = [f for f in logger.filters if type(f).__module__.split(".")[0] != "astrai"]
    for f in foreign:
        logger.removeFilter(f)

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, level = Capture(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)
    for f in foreign:
        logger.addFilter(f)


def test_api_key_in_the_query_string_is_redacted_in_the_access_log(guarded, access_log):
    # the attack (on the operator): a client sends its key in the URL, where access logs keep it
    query = f"limit=5&api_key={KEY}&token=tok-123&model=m"
    with httpx.Client(timeout=10) as client:
        reply = client.get(f"http://127.0.0.1:{guarded}/v1/models?{query}", headers={"x-api-key": KEY})
    assert reply.status_code == 200
    deadline = time.monotonic() + 5
    while not any("/v1/models" in line for line in access_log) and time.monotonic() < deadline:
        time.sleep(0.02)
    [line] = [line for line in access_log if "/v1/models" in line]
    assert KEY not in line and "tok-123" not in line, line
    # positive control: the rest of the line is uvicorn's, with the other parameters as sent
    assert '"GET /v1/models?limit=5&api_key=<redacted>&token=<redacted>&model=m HTTP/1.1" 200' in line, line

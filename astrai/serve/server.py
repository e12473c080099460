"""uvicorn around the app: connection limits that hold against slow clients, and a graceful shutdown that ends
generations cleanly before uvicorn cancels them.

uvicorn's shutdown stops accepting connections, waits up to `timeout_graceful_shutdown` seconds for open ones,
then *cancels* the request tasks: a stream cut that way ends without its final event. `GracefulServer` shuts
the engine down shortly before that deadline instead, so every unfinished stream still sends its last chunk
(finish_reason "abort", then `[DONE]` / `message_stop`) and its KV pages are freed. A SIGTERM that shut down
this way exits with status 0.

uvicorn has no limit on how long a request head may take (a client trickling one header byte every few seconds
holds its connection forever) nor on open connections (`limit_concurrency` answers 503 only once a request head
has arrived). `GuardedH11Protocol` adds both: a request head must arrive within `header_timeout` seconds of the
connection opening or of its first byte (else 408 and close), and connections past `max_connections` are
answered 503 and closed (after waiting up to OVER_CAP_WAIT_S for the request line, to answer in its API's error
shape). It also checks each request head's raw bytes before h11 parses them (`scan_head`): a head over
`max_header_bytes` is a 431 however it arrives (h11's own limit counts only a head still incomplete, so a larger
one that arrived in one read passed), and a head with both Content-Length and Transfer-Encoding is a 400 and the
connection is closed (RFC 9112 section 6.1: two framings are how requests are smuggled past a proxy). Every such
refusal uses the error shape of the path in the request line once that line is in (Anthropic's under
/v1/messages). The body's own deadline and size limit live in `app.Guard`. `server_config`
always selects this h11-based protocol (also where httptools is installed): HTTP parsing is not what bounds an
LLM server's throughput.

`with_cors` puts Starlette's CORS middleware in front of the app (outside the guard, so that a browser's preflight
`OPTIONS`, which carries no API key, is answered); `logging_config` routes astrai's loggers through uvicorn's
handlers at one level. uvicorn's access log prints each request's path with its query string: `QueryRedactor`
(installed by `server_config`) replaces the values of credential-like parameters (`?api_key=...`) there.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import http
import logging
import re
import signal
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import h11
import uvicorn
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from astrai.inference.engine import Engine
from astrai.serve.common import ABORT_CONNECTION, APIError, anthropic_error, openai_error

ABORT_AT = 0.8  # share of the graceful timeout after which unfinished generations are ended
OVER_CAP_WAIT_S = 0.25  # a connection over the cap waits this long for its request line (the 503's error shape)
OVER_CAP_WAITING = 64  # connections past the cap that may wait so; any further one is refused at once


@attrs.frozen(kw_only=True)
class ConnectionLimits:
    """Per-connection limits enforced below the app (the body's limits are the app's: `build_app`)."""

    header_timeout: float = 10.0
    """Seconds a request head (request line and headers) may take from the connection opening or its first byte."""
    keep_alive_timeout: int = 5
    """Seconds an idle keep-alive connection stays open between requests."""
    max_connections: int = 512
    """Most open connections (streams included); more are answered 503 and closed."""
    max_header_bytes: int = 16 << 10
    """Largest request head (request line and headers, in bytes); a larger one is answered 431 and closed."""


def _raw_error(status: int, message: str, headers: dict[str, str], path: bytes | None = None) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection, in the error shape of the API `path` belongs
    to (Anthropic's under /v1/messages, else OpenAI's; no path known yet: OpenAI's)."""
    error = APIError(status, message, type="invalid_request_error" if status < 500 else "server_error")
    anthropic = path is not None and path.startswith(b"/v1/messages")
    response = anthropic_error(error) if anthropic else openai_error(error)
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "connection: close"]
    lines += [f"{k.decode('latin-1')}: {v.decode('latin-1')}" for k, v in response.raw_headers]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + response.body


@attrs.frozen
class Head:
    """What the raw bytes of a request's head say before h11 parses them: the path of its request line (None until
    that line is in), its size in bytes once complete (None before), and the lowercase header names it has."""

    path: bytes | None
    size: int | None
    names: frozenset[bytes]


def scan_head(buffer: bytes, limit: int) -> Head:
    """The head at the start of `buffer`, read as h11 will (lines end at "\\n", a "\\r" before it dropped; the head
    ends at the first blank line; a header's name is what precedes its ":"). Only the first `limit` + 4 bytes are
    searched: a head that has not ended there is over the limit whatever follows."""
    window = buffer[: limit + 4]
    end = _HEAD_END.search(window)
    first, newline, _ = window.partition(b"\n")
    target = first.split(b" ")[1] if newline and first.count(b" ") >= 2 else None
    path = None if target is None else target.partition(b"?")[0]
    if end is None:
        return Head(path, None, frozenset())
    lines = window[: end.start()].split(b"\n")[1:]
    names = frozenset(line.partition(b":")[0].lower() for line in lines if b":" in line)
    return Head(path, end.end(), names)


_HEAD_END = re.compile(b"\n\r?\n")  # h11's blank_line_regex


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a request-head deadline, a head size limit that holds however the head arrives,
    a refusal of ambiguous framing, and a cap on open connections."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.head_timer: asyncio.TimerHandle | None = None
        self.over_cap: bytearray | None = None  # an over-cap connection's first bytes (it is never parsed)
        self.head_path: bytes | None = None  # the path of the request line last scanned (h11 consumes the bytes)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        over = len(self.connections) - self.limits.max_connections
        if over > OVER_CAP_WAITING:
            self._refuse_over_cap()  # too many waiting already: the 503 at once, in OpenAI's shape
        elif over > 0:
            # wait briefly for the request line, to answer in the error shape of its API
            self.over_cap = bytearray()
            wait = min(OVER_CAP_WAIT_S, self.limits.header_timeout)
            self.head_timer = self.loop.call_later(wait, self._refuse_over_cap)
        else:
            self._arm_head_timer()  # a connection that never sends a full head is closed too

    def data_received(self, data: bytes) -> None:
        if self.over_cap is not None:
            self.over_cap += data
            if b"\n" in self.over_cap or len(self.over_cap) > self.limits.max_header_bytes:
                self._refuse_over_cap()
            return
        if self.head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # first byte of the next request on a keep-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        # uvicorn's loop handles at most one request head per call, entered with the client IDLE: the head is
        # checked here, before h11 parses it
        if self.conn.their_state is h11.IDLE and not self._head_acceptable():
            return
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection failed): the timer is done
            self._disarm_head_timer()
        if getattr(self, "scope", None) is not None:  # lets a stalled stream drop its connection at once, unflushed
            self.scope.setdefault("extensions", {})[ABORT_CONNECTION] = self.transport.abort

    def _head_acceptable(self) -> bool:
        """False (the connection answered and closed) for a head over the limit or framed by both Content-Length
        and Transfer-Encoding. h11's own limit counts only a head still incomplete, so a larger head that arrives
        whole in one read passed it; and h11 reads such a request by Transfer-Encoding and keeps the connection,
        which a proxy in front that went by Content-Length would split differently (request smuggling)."""
        buffer, limit = self.conn.trailing_data[0], self.limits.max_header_bytes
        head = scan_head(buffer, limit)
        self.head_path = head.path
        if (head.size is None and len(buffer) > limit) or (head.size or 0) > limit:
            self._close_with(431, f"the request head is over the limit of {limit} bytes", {}, head.path)
            return False
        if {b"content-length", b"transfer-encoding"} <= head.names:
            message = "a request must not have both Content-Length and Transfer-Encoding (RFC 9112 section 6.1)"
            self._close_with(400, message, {}, head.path)
            return False
        return True

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a request h11 cannot parse is plain text; before any response: the API's shape
        if self.conn.our_state is not h11.IDLE:
            super().send_400_response(msg)
            return
        self._close_with(400, "the request is not valid HTTP/1.1", {}, self.head_path)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self.head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request head took over %s s", self.limits.header_timeout)
            path = scan_head(self.conn.trailing_data[0], self.limits.max_header_bytes).path
            message = f"the request head did not arrive within {self.limits.header_timeout} s"
            self._close_with(408, message, {}, path)

    def _refuse_over_cap(self) -> None:
        self._disarm_head_timer()
        if self.transport.is_closing():
            return
        path = scan_head(bytes(self.over_cap or b""), self.limits.max_header_bytes).path
        message = f"the server has {self.limits.max_connections} open connections, its limit; retry later"
        self._close_with(503, message, {"retry-after": "1"}, path)

    def _close_with(self, status: int, message: str, headers: dict[str, str], path: bytes | None = None) -> None:
        # written raw: no request was parsed, so h11 has no response to frame; the connection ends with it
        self.transport.write(_raw_error(status, message, headers, path))
        self.transport.close()


_SECRET_NAME = re.compile(r"key|token|secret|passw|pwd|auth|credential|signature|session|^sig$|^code$", re.I)


def redact_query(path: str) -> str:
    """`path` with the value of every query parameter whose name looks like a credential (api_key, key, token,
    access_token, secret, password, auth, signature, ...: matched on the percent-decoded name) replaced by
    `<redacted>`; other parameters, and their order and spelling, stay as sent."""
    base, mark, query = path.partition("?")
    if not mark:
        return path
    parts = []
    for part in query.split("&"):
        name, eq, value = part.partition("=")
        secret = eq and value and _SECRET_NAME.search(urllib.parse.unquote_plus(name))
        parts.append(f"{name}=<redacted>" if secret else part)
    return f"{base}?{'&'.join(parts)}"


class QueryRedactor(logging.Filter):
    """A filter for uvicorn's access log: redacts credentials in the query string of the logged path
    (`redact_query`), so a client that sends its API key as `?api_key=...` does not put the key in the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, str) and "?" in a for a in record.args):
            record.args = tuple(redact_query(a) if isinstance(a, str) and "?" in a else a for a in record.args)
        return True


def install_query_redactor() -> None:
    """Put a `QueryRedactor` on the `uvicorn.access` logger (once): logger-level, so it holds whatever handlers
    a log config gives that logger."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QueryRedactor) for f in access.filters):
        access.addFilter(QueryRedactor())


def server_config(app: ASGIApp, limits: ConnectionLimits | None = None, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn.Config serving `app` through `GuardedH11Protocol` with `limits`; `kwargs` go to uvicorn.Config.
    The access log redacts credentials in query strings (`QueryRedactor`)."""
    limits = limits or ConnectionLimits()
    protocol = functools.partial(GuardedH11Protocol, limits=limits)
    config = uvicorn.Config(app, http=protocol, timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
                            h11_max_incomplete_event_size=limits.max_header_bytes, **kwargs)  # fmt: skip
    install_query_redactor()  # after the Config: it applied its log config
    return config


def with_cors(app: ASGIApp, origins: Sequence[str], *, methods: Sequence[str] = ("*",),
              headers: Sequence[str] = ("*",), credentials: bool = False) -> ASGIApp:  # fmt: skip
    """`app` behind Starlette's CORSMiddleware allowing `origins` ("*": any), or `app` itself when `origins` is empty.

    The middleware is outermost: it answers preflight requests (OPTIONS with `Origin` and
    `Access-Control-Request-Method`) before the guard asks for an API key, and adds `access-control-allow-origin`
    to every response for an allowed origin, errors included (a browser can read a 401). Other origins get no
    CORS headers (a preflight from one is answered 400), so browsers refuse their cross-origin calls.
    """
    if not origins:
        return app
    return CORSMiddleware(app, allow_origins=list(origins), allow_methods=list(methods), allow_headers=list(headers),
                          allow_credentials=credentials)  # fmt: skip


def logging_config(level: str = "info") -> dict[str, Any]:
    """uvicorn's logging config plus the `astrai` loggers (`astrai.serve`: request logs and errors) at `level`,
    printed through uvicorn's default handler; pass it as `server_config(..., log_config=...)`."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["astrai"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


class StoppableServer(uvicorn.Server):
    """A uvicorn.Server whose SIGTERM stop, once complete, is a success (exit status 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                # uvicorn re-raises the signals it caught once shut down, so the exit status would say "killed by
                # SIGTERM"; a stop that was asked for and completed is a success (status 0). SIGINT still re-raises.
                self._captured_signals = [sig for sig in self._captured_signals if sig != signal.SIGTERM]


class GracefulServer(StoppableServer):
    """A uvicorn.Server that ends `engine`'s in-flight requests at ABORT_AT of the graceful timeout."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    async def on_tick(self, counter: int) -> bool:
        # an engine that lost a tensor-parallel rank can never answer again: stop serving (the CLI exits with 1)
        if self.engine.fatal is not None and not self.should_exit:
            logging.getLogger("astrai.serve").error("stopping the server: %s", self.engine.fatal)
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list | None = None) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.config.timeout_graceful_shutdown
        delay = 0.0 if timeout is None else max(0.0, ABORT_AT * timeout)
        # engine.shutdown joins the engine thread: run it off the event loop, which must keep streaming
        handle = loop.call_later(delay, lambda: loop.run_in_executor(None, self.engine.shutdown))
        try:
            await super().shutdown(sockets)
        finally:
            handle.cancel()

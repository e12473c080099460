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
answered 503 and closed at once. The body's own deadline and size limit live in `app.Guard`. `server_config`
always selects this h11-based protocol (also where httptools is installed): HTTP parsing is not what bounds an
LLM server's throughput.

`with_cors` puts Starlette's CORS middleware in front of the app (outside the guard, so that a browser's preflight
`OPTIONS`, which carries no API key, is answered); `logging_config` routes astrai's loggers through uvicorn's
handlers at one level.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import http
import logging
import signal
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import h11
import uvicorn
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from astrai.inference.engine import Engine
from astrai.serve.common import APIError, openai_error

ABORT_AT = 0.8  # share of the graceful timeout after which unfinished generations are ended


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
    """Largest request head; a larger one is answered 400."""


def _raw_error(status: int, message: str, headers: dict[str, str]) -> bytes:
    """A complete HTTP/1.1 error response (OpenAI's error shape) that closes the connection."""
    response = openai_error(APIError(status, message, type="invalid_request_error" if status < 500 else "server_error"))
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "connection: close"]
    lines += [f"{k.decode('latin-1')}: {v.decode('latin-1')}" for k, v in response.raw_headers]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + response.body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a request-head deadline and a cap on open connections."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            message = f"the server has {self.limits.max_connections} open connections, its limit; retry later"
            self._close_with(503, message, {"retry-after": "1"})
            return
        self._arm_head_timer()  # a connection that never sends a full head is closed too

    def data_received(self, data: bytes) -> None:
        if self.head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # first byte of the next request on a keep-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection failed): the timer is done
            self._disarm_head_timer()

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
            self._close_with(408, f"the request head did not arrive within {self.limits.header_timeout} s", {})

    def _close_with(self, status: int, message: str, headers: dict[str, str]) -> None:
        # written raw: no request was parsed, so h11 has no response to frame; the connection ends with it
        self.transport.write(_raw_error(status, message, headers))
        self.transport.close()


def server_config(app: ASGIApp, limits: ConnectionLimits | None = None, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn.Config serving `app` through `GuardedH11Protocol` with `limits`; `kwargs` go to uvicorn.Config."""
    limits = limits or ConnectionLimits()
    protocol = functools.partial(GuardedH11Protocol, limits=limits)
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=limits.max_header_bytes, **kwargs)  # fmt: skip


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


class GracefulServer(uvicorn.Server):
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

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                # uvicorn re-raises the signals it caught once shut down, so the exit status would say "killed by
                # SIGTERM"; a stop that was asked for and completed is a success (status 0). SIGINT still re-raises.
                self._captured_signals = [sig for sig in self._captured_signals if sig != signal.SIGTERM]

"""Host work for a client that left stops at its next checkpoint.

A request's heavy host work (rendering a chat template, tokenizing, building a big reply) runs on the tokenizer
pool (`ServerState.offload`). While it waits for a worker or runs, a watcher on the connection (`watch`) sets the
request's `gone` event when the client disconnects. Work that has not started then never starts
(`run_unless_gone`), and work that has started stops at its next `checkpoint()` (between rendering and
tokenizing, between the prompts of a list): a Rust encode or a Jinja render cannot be interrupted in the middle,
so each is one step. The handler answers `ClientGone` with a 499 nobody reads, and nothing is logged as an error.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

from starlette.requests import Request


class ClientGone(Exception):
    """The client closed the connection: the request's work stopped, nobody reads its answer."""


_GONE: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("astrai_client_gone", default=None)


def checkpoint() -> None:
    """Raise ClientGone when the client of the request this thread works for has left (no-op outside `offload`)."""
    gone = _GONE.get()
    if gone is not None and gone.is_set():
        raise ClientGone


def run_unless_gone(gone: threading.Event, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on this (worker) thread with `checkpoint()` watching `gone`; ClientGone at once when
    the client left while the work queued."""
    token = _GONE.set(gone)
    try:
        checkpoint()
        return fn(*args, **kwargs)
    finally:
        _GONE.reset(token)


async def watch(request: Request, gone: threading.Event) -> None:
    """Set `gone` when the client disconnects. Only after the body is read: then the next ASGI message a request
    receives is `http.disconnect` (run as a task, cancelled when the work is done)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()

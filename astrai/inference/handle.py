"""`RequestHandle`: the caller's side of one submitted request (host Python).

The engine puts stream `Delta`s, then the final `Completion` (or the exception that ended the engine) into the
handle from its own thread; the caller iterates the handle from any thread, or from an event loop when it
submitted with one. The handle knows the engine only through two callables, so it imports nothing above it.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from astrai.inference.outputs import Completion, Delta


class RequestHandle:
    """A submitted request: iterate it for `Delta`s, or call `result()` for the `Completion`."""

    def __init__(
        self,
        request_id: str,
        *,
        abort: Callable[[str], None],
        step: Callable[[], bool] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Args:
        request_id: the request's id.
        abort: cancels the request by id (`Engine.abort`).
        step: runs one engine step on the caller's thread and says whether there was work (engines without a
            background thread); None when another thread steps the engine.
        loop: the event loop that iterates the handle asynchronously, if any.
        """
        self.request_id, self._abort, self._step, self._loop = request_id, abort, step, loop
        self._sync: queue.SimpleQueue = queue.SimpleQueue()
        self._async: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self.completion: Completion | None = None
        # what the engine records of the request (`RequestDelivery` sets it), read after the fact by the server's
        # request tracing: its submission (`time.perf_counter()` seconds) and its sequences (their `scheduled_at`)
        self.submitted: float | None = None
        self.seqs: tuple[Any, ...] = ()

    @property
    def first_scheduled(self) -> float | None:
        """When the engine first scheduled one of the request's sequences (perf_counter seconds; None: not yet)."""
        return min((t for seq in self.seqs if (t := seq.scheduled_at) is not None), default=None)

    def put(self, item: Delta | Completion | BaseException) -> None:
        """Deliver an item (engine side; thread-safe)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._async.put_nowait, item)  # type: ignore[union-attr]
        else:
            self._sync.put(item)

    def _take(self, item: Delta | Completion | BaseException) -> Delta | None:
        """The delta to yield, or None once the completion arrived (stored); raises a delivered exception."""
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Completion):
            self.completion = item
            return None
        return item

    def __iter__(self) -> Iterator[Delta]:
        while self.completion is None:
            if self._step is not None:
                while self._sync.empty():
                    if not self._step() and self._sync.empty():
                        raise RuntimeError(f"request {self.request_id} is not known to the engine")
            delta = self._take(self._sync.get())
            if delta is not None:
                yield delta

    async def __aiter__(self) -> AsyncIterator[Delta]:
        if self._async is None:
            raise RuntimeError("submit with loop=asyncio.get_running_loop() to iterate asynchronously")
        while self.completion is None:
            delta = self._take(await self._async.get())
            if delta is not None:
                yield delta

    def poll(self) -> list[Delta]:
        """The deltas delivered so far and not yet consumed, without blocking (sets `completion` at the end)."""
        out = []
        while not self._sync.empty():
            delta = self._take(self._sync.get())
            if delta is not None:
                out.append(delta)
        return out

    def result(self) -> Completion:
        """Block until the request finishes; returns its Completion (again on later calls)."""
        for _ in self:
            pass
        assert self.completion is not None
        return self.completion

    def abort(self) -> None:
        """Stop generating (frees the request's KV); the stream ends with finish_reason "abort"."""
        self._abort(self.request_id)

"""uvicorn around the app, with a graceful shutdown that ends generations cleanly before uvicorn cancels them.

uvicorn's shutdown stops accepting connections, waits up to `timeout_graceful_shutdown` seconds for open ones,
then *cancels* the request tasks: a stream cut that way ends without its final event. `GracefulServer` shuts
the engine down shortly before that deadline instead, so every unfinished stream still sends its last chunk
(finish_reason "abort", then `[DONE]` / `message_stop`) and its KV pages are freed.
"""

from __future__ import annotations

import asyncio

import uvicorn

from astrai.inference.engine import Engine

ABORT_AT = 0.8  # share of the graceful timeout after which unfinished generations are ended


class GracefulServer(uvicorn.Server):
    """A uvicorn.Server that ends `engine`'s in-flight requests at ABORT_AT of the graceful timeout."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

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

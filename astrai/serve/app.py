"""The Starlette app: OpenAI- and Anthropic-compatible routes around one `Engine`, plus health and metrics.

`build_app(engine, ...)` returns the ASGI app; `astrai serve` runs it on uvicorn. A pure-ASGI guard in front of
the routes enforces the optional API key (`Authorization: Bearer KEY` or `x-api-key: KEY`) and the body-size
limit, and counts requests by endpoint and status. No model code lives in the handlers: they map API fields to
`SamplingParams`, submit token ids, and format what the engine streams back.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from astrai.inference.engine import Engine
from astrai.models.encoder import EncoderConfig
from astrai.serve import anthropic_api, embeddings_api, openai_api
from astrai.serve.common import APIError, anthropic_error, openai_error
from astrai.serve.state import ServerState


class Guard:
    """Auth, body-size limit and request counting in front of every route (pure ASGI: streaming-safe)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state  # `state` is public: tests and embedders reach the engine through it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        render = anthropic_error if path.startswith("/v1/messages") else openai_error
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        error = self._check(path, headers)
        try:
            if error is not None:
                await render(error)(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.count_request(path, status["code"])

    def _check(self, path: str, headers: dict[str, str]) -> APIError | None:
        key = self.state.api_key
        if key and path.startswith("/v1/"):
            bearer = headers.get("authorization", "")
            if bearer != f"Bearer {key}" and headers.get("x-api-key") != key:
                return APIError(401, "invalid or missing API key", type="authentication_error")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.state.max_body_bytes:
            return APIError(413, f"the request body has {length} bytes; the limit is {self.state.max_body_bytes}")
        return None


def _basic_routes(state: ServerState) -> list[Route]:
    async def health(request: Request) -> Response:
        stats = state.engine.stats()
        return JSONResponse({"status": "ok", "model": state.model_name, "running": stats.running,
                             "waiting": stats.waiting})  # fmt: skip

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(state.metrics.render(state.engine.stats()), media_type="text/plain; version=0.0.4")

    async def models(request: Request) -> Response:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "astrai"}
        return JSONResponse({"object": "list", "data": [card]})

    return [Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models)]


def build_app(engine: Engine, *, model_name: str = "astrai", api_key: str | None = None,
              max_body_bytes: int = 8 << 20, embeddings: EncoderConfig | None = None) -> ASGIApp:  # fmt: skip
    """The ASGI app serving `engine`; shutting the app down (lifespan) shuts the engine down.

    `embeddings` enables `POST /v1/embeddings` with that pooling (the engine's model run as an encoder).
    """
    state = ServerState(engine=engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                        embeddings=embeddings)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        engine.shutdown()  # ends in-flight requests (finish_reason "abort") and frees their KV

    routes = _basic_routes(state) + openai_api.routes(state) + embeddings_api.routes(state)
    routes += anthropic_api.routes(state)
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.server = state
    return Guard(app, state)

"""Plumbing shared by the OpenAI and Anthropic routes: errors, JSON bodies, SSE framing, and running a request
on the engine so that a client disconnect aborts it (and frees its KV).

Each API renders errors in its own shape (OpenAI `{"error": {...}}`, Anthropic `{"type": "error", ...}`), so
handlers raise `APIError` and the route wrapper picks the renderer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from astrai.inference.engine import Engine, EngineBusyError, EngineDeadError
from astrai.inference.handle import RequestHandle
from astrai.inference.outputs import Completion, Delta
from astrai.inference.params import SamplingParams


@attrs.frozen
class APIError(Exception):
    """A request-level error: HTTP status, message, and the OpenAI type/param (Anthropic maps the status)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


def openai_error(err: APIError) -> JSONResponse:
    """OpenAI's error body."""
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    return JSONResponse(body, status_code=err.status)


# Anthropic error types by HTTP status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 529: "overloaded_error"}  # fmt: skip


def anthropic_error(err: APIError) -> JSONResponse:
    """Anthropic's error body."""
    kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": err.message}}, status_code=err.status)


async def json_body(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or APIError 400 naming what is wrong."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event; a blank line ends it (the framing the SDKs expect)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
    """An SSE response over `events` (already framed strings)."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def submit(engine: Engine, prompt_ids: list[int], params: SamplingParams, *, busy_status: int) -> RequestHandle:
    """Queue a request on the engine, mapping its errors to API errors (busy -> 429 / 529)."""
    try:
        return engine.submit(prompt_ids, params, loop=asyncio.get_running_loop())
    except EngineBusyError as err:
        raise APIError(busy_status, f"the server is busy: {err}; retry later", type="rate_limit_error") from None
    except EngineDeadError as err:
        raise APIError(503, str(err), type="server_error") from None
    except ValueError as err:  # prompt too long, bad sampling values: the message names the field and numbers
        raise APIError(400, str(err)) from None


async def _abort_on_disconnect(request: Request, handle: RequestHandle) -> None:
    # after the body is read, the next ASGI message is http.disconnect when the client goes away
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.abort()
            return


async def deltas(request: Request, handle: RequestHandle) -> AsyncIterator[Delta]:
    """Iterate a request's deltas; the request is aborted if the client disconnects or the consumer stops."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, handle))
    try:
        async for delta in handle:
            yield delta
    finally:
        watcher.cancel()
        if handle.completion is None:
            handle.abort()


async def complete(request: Request, handle: RequestHandle) -> tuple[list[Delta], Completion]:
    """Wait for a whole request (non-streaming), aborting it on disconnect; returns its deltas and Completion."""
    got = [delta async for delta in deltas(request, handle)]
    if handle.completion is None:
        raise APIError(499, "the client closed the request")
    return got, handle.completion


def route(render_error: Callable[[APIError], Response], handler: Callable) -> Callable:
    """Wrap a handler so that APIError (and unexpected failures) come back in the API's own error shape."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as err:
            return render_error(err)
        except Exception as err:  # a bug: still answer in the API's shape, with a 500
            return render_error(APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error"))

    return endpoint

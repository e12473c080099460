"""Plumbing shared by the OpenAI and Anthropic routes: errors, JSON bodies, SSE framing, and running a request
on the engine so that a client disconnect aborts it (and frees its KV).

Each API renders errors in its own shape (OpenAI `{"error": {...}}`, Anthropic `{"type": "error", ...}`), so
handlers raise `APIError` and the route wrapper picks the renderer.

Client input never causes a 500: a body that is not strict UTF-8 JSON, nests arrays/objects deeper than
`MAX_JSON_DEPTH`, holds an integer literal longer than Python parses (4,300 digits) or a lone UTF-16 surrogate
escape (`"\\ud800"`) is a 400. Anything else a handler raises is a bug: it is logged with its traceback on the
`astrai.serve` logger under a request id, and the client gets a 500 (or, mid-stream, an error event) that
carries only that id, never the exception text. No log line holds a prompt or the API key; `log_request` (called
only when the server logs requests, a debugging aid) shows a prompt's first `PROMPT_LOG_CHARS` characters.

A reply's size is bounded before generation (`check_reply_size`, the server's `max_reply_bytes`); a big one is
encoded off the loop (`json_bytes`, `sse_big`); a stream whose client stops reading is aborted after the server's
`stream_stall_timeout` (`stream_response`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from astrai.inference.engine import Engine, EngineBusyError, EngineDeadError, RequestFailedError
from astrai.inference.errors import LoRANotFoundError
from astrai.inference.handle import RequestHandle
from astrai.inference.outputs import Completion, Delta
from astrai.inference.params import SamplingParams
from astrai.serve import tenancy, tracing


@attrs.frozen
class APIError(Exception):
    """A request-level error: HTTP status, message, and the OpenAI type/param (Anthropic maps the status)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


RETRY_AFTER_S = 1  # sent as Retry-After with 429 / 529 (the queue is full): a short wait, then retry


def _retry_after(err: APIError) -> dict[str, str] | None:
    return {"Retry-After": str(RETRY_AFTER_S)} if err.status in (429, 529) else None


def openai_error(err: APIError) -> JSONResponse:
    """OpenAI's error body."""
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    return JSONResponse(body, status_code=err.status, headers=_retry_after(err))


# Anthropic error types by HTTP status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 529: "overloaded_error"}  # fmt: skip


def anthropic_error(err: APIError) -> JSONResponse:
    """Anthropic's error body."""
    kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    body = {"type": "error", "error": {"type": kind, "message": err.message}}
    return JSONResponse(body, status_code=err.status, headers=_retry_after(err))


PROMPT_LOG_CHARS = 200
"""Characters of a prompt that `log_request` shows."""

MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays/objects a request body may have (the body object is level 1)."""

logger = logging.getLogger("astrai.serve")

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape: half of a pair, or lone
_NESTED = (dict, list)


def _depth_exceeds(value: Any, limit: int) -> bool:
    # level by level, keeping only containers; set(map(type, ...)) skips long scalar lists at C speed
    level = [value] if isinstance(value, _NESTED) else []
    for _ in range(limit):
        below = []
        for node in level:
            children = node.values() if isinstance(node, dict) else node
            kinds = set(map(type, children))
            if dict in kinds or list in kinds:
                below += [child for child in children if isinstance(child, _NESTED)]
        if not below:
            return False
        level = below
    return True


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or APIError 400 naming what is wrong (never another exception)."""
    try:
        text = raw.decode("utf-8-sig")  # strict: UTF-8-encoded surrogates are invalid here (json.loads passes them)
        body = json.loads(text)
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8: {err}") from None
    except json.JSONDecodeError as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise APIError(400, f"the request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:  # int() refuses literals over sys.get_int_max_str_digits() (4,300) digits
        raise APIError(400, "the request body is not valid JSON: a number literal is too long") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    if _depth_exceeds(body, MAX_JSON_DEPTH):
        raise APIError(400, f"the request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(text):  # rare: only then pay for re-encoding the whole tree
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without "
                                "its pair): text must be valid Unicode") from None  # fmt: skip
    return body


async def json_body(request: Request) -> dict[str, Any]:
    """The request body as a JSON object (`parse_json`), or APIError 400 naming what is wrong."""
    return parse_json(await request.body())


_SPLITLINES_BREAKS = re.compile("[\x85\u2028\u2029]")


def one_line(payload: str) -> str:
    """JSON text with U+0085, U+2028 and U+2029 written as `\\u` escapes (the same JSON value).

    JSON leaves them raw under `ensure_ascii=False`, and SSE does not count them as line ends, but clients that
    split the stream with `str.splitlines` (httpx's `aiter_lines`, and scripts built on it) break an
    event in two there; the soak found a generated token holding one. Only in strings can they occur in JSON.
    """
    if _SPLITLINES_BREAKS.search(payload) is None:  # the usual case: one scan, no copy
        return payload
    return _SPLITLINES_BREAKS.sub(lambda m: f"\\u{ord(m.group()):04x}", payload)


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event; a blank line ends it (the framing the SDKs expect). Its data is one line for every
    client (`one_line`)."""
    payload = one_line(data if isinstance(data, str) else json.dumps(data, ensure_ascii=False))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


DEFAULT_MAX_REPLY_BYTES = 32 << 20
"""Largest reply (whole body, streamed or not) a request may ask for, as `reply_size` estimates it before
generation; `--max-reply-bytes` / `build_app(max_reply_bytes=...)` change it."""

# Bytes of JSON per item of a reply, measured on real tokenizers' output (json.dumps of each shape): a token's text
# in `content`/`text`; one chat `logprobs.content` entry (token, logprob, bytes; each alternative is one too); one
# legacy completions entry (`tokens` + `token_logprobs` + `text_offset` per token, a `top_logprobs` pair per
# alternative); one vLLM `prompt_logprobs` entry ({id: {logprob, rank, decoded_token}}).
BYTES_PER_TOKEN_TEXT = 8
BYTES_PER_CHAT_LOGPROB = 64
BYTES_PER_LEGACY_LOGPROB = 32
BYTES_PER_VLLM_LOGPROB = 72


def check_reply_size(limit: int | None, parts: Sequence[tuple[str, tuple[str, ...], int]]) -> int:
    """APIError 400 (413-style, code `reply_too_large`) when the estimated reply bytes add up to more than `limit`
    (None: no limit). `parts`: (what, the request fields that make it big, estimated bytes) per part of the reply.

    Checked before anything is generated or scored, so a request whose reply would be too big costs nothing: the
    message names the fields to lower (the largest part's first; `param` is its first field) with the estimate.
    Returns the estimated bytes (under the limit).
    """
    total = sum(size for _, _, size in parts)
    if limit is None or total <= limit:
        return total
    ranked = sorted((p for p in parts if p[2]), key=lambda p: -p[2])
    fields = list(dict.fromkeys(name for _, names, _ in ranked for name in names))
    detail = "; ".join(f"{what} ~{size / 1e6:.1f} MB" for what, _, size in ranked)
    raise APIError(400, f"the reply would be about {total / 1e6:.1f} MB ({detail}), over this server's limit of "
                        f"{limit / 1e6:.1f} MB (--max-reply-bytes): lower {', '.join(fields)}",
                   param=fields[0], code="reply_too_large")  # fmt: skip


BIG_REPLY_BYTES = 1 << 20
"""An estimated reply size above which `json_bytes` / `sse_big` encode with the pure-Python encoder (see there)."""

_COMPACT = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_SPACED = json.JSONEncoder(ensure_ascii=False)  # `sse`'s own format


def json_bytes(content: Any, *, big: bool = False) -> bytes:
    """`content` encoded as Starlette's JSONResponse does (compact, UTF-8, no NaN), for `state.offload`.

    A `big` reply (estimated over `BIG_REPLY_BYTES`) goes through the pure-Python encoder: about 5x the CPU of the
    C one, but the C encoder holds the GIL for the whole call (0.3 s for 15 MB), which would stall the event loop
    even from a worker thread; the Python one lets the loop run every switch interval.
    """
    return (_gil_friendly(_COMPACT, content) if big else _COMPACT.encode(content)).encode()


def _gil_friendly(encoder: json.JSONEncoder, content: Any) -> str:
    # the pure-Python encoder's pieces, handing the GIL over (sleep(0)) every few thousand: a thread waiting for
    # it (the event loop) gets it at once instead of after a switch interval (5 ms) per acquisition
    pieces = []
    for k, piece in enumerate(encoder.iterencode(content)):
        pieces.append(piece)
        if k % 2048 == 0:
            time.sleep(0)
    return "".join(pieces)


def sse_big(data: dict[str, Any]) -> str:
    """`sse(data)` for a big event (an echoed prompt's logprobs), GIL-friendly as `json_bytes(big=True)`: for
    `state.offload`."""
    return f"data: {one_line(_gil_friendly(_SPACED, data))}\n\n"


ABORT_CONNECTION = "astrai.abort_connection"
"""The ASGI scope extension (`astrai.serve.server`'s protocol sets it) that drops the connection at once."""

DEFAULT_STREAM_STALL_TIMEOUT = 30.0
"""Seconds a stream's send may stay blocked before its request is aborted (`--stream-stall-timeout`)."""


class _Stalled(Exception):
    """A stream's send stayed blocked past its stall timeout: the client stopped reading."""


class _StallGuardedStream(StreamingResponse):
    """A StreamingResponse whose request is aborted when its client stops reading.

    uvicorn's `send` waits (flow control) while the connection's write buffer is full, that is while the client
    reads nothing; the body iterator then stays suspended and the engine keeps generating into the request's delta
    queue, holding its decode slot and KV. When one send stays blocked for the server's `stream_stall_timeout`
    (`ServerState`, read through `scope["app"].state.server`; None: wait forever), the body iterator is closed,
    which aborts the request (`deltas`' cleanup frees its KV), and the connection is dropped at once, its unsent
    buffer discarded (`astrai.serve.server`'s protocol offers the transport's abort as the scope extension
    `ABORT_CONNECTION`; under another server the response ends unfinished and uvicorn closes the connection once
    the buffer drains, logging "ASGI callable returned without completing response").
    """

    stall_timeout: float | None = DEFAULT_STREAM_STALL_TIMEOUT
    _abort_connection: Callable[[], None] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self._abort_connection = scope.get("extensions", {}).get(ABORT_CONNECTION)
        state = getattr(getattr(scope.get("app"), "state", None), "server", None)
        self.stall_timeout = getattr(state, "stream_stall_timeout", DEFAULT_STREAM_STALL_TIMEOUT)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        timeout = self.stall_timeout

        async def bounded_send(message: Any) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                raise _Stalled from None

        try:
            await super().stream_response(send if timeout is None else bounded_send)
        except _Stalled:
            logger.warning("a stream's client read nothing for %s s: its request is aborted", timeout)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # aborts the request, frees its KV
            if self._abort_connection is not None:
                self._abort_connection()
                await asyncio.sleep(0)  # uvicorn sees the connection lost: the unfinished response is not an error


def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
    """An SSE response over `events` (already framed strings), aborted when its client stops reading for the
    server's `stream_stall_timeout` (`_StallGuardedStream`)."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return _StallGuardedStream(events, media_type="text/event-stream", headers=headers)


def submit(engine: Engine, prompt_ids: list[int], params: SamplingParams, *, busy_status: int,
           lora: str | None = None) -> RequestHandle:  # fmt: skip
    """Queue a request on the engine (with the LoRA adapter `lora`, None: the base model), mapping its errors to API
    errors (busy -> 429 / 529; an adapter unloaded since the route checked its name -> 404 `model_not_found`); the
    request's tenancy salts its prefix-cache pages (`tenancy.salted`)."""
    adapter = {} if lora is None else {"lora": lora}
    try:
        handle = engine.submit(prompt_ids, tenancy.salted(params), loop=asyncio.get_running_loop(), **adapter)
    except EngineBusyError as err:
        raise APIError(busy_status, f"the server is busy: {err}; retry later", type="rate_limit_error") from None
    except EngineDeadError as err:
        raise APIError(503, str(err), type="server_error") from None
    except ValueError as err:  # prompt too long, bad sampling values: the message names the field and numbers
        if isinstance(err, LoRANotFoundError):  # unloaded since the route checked the name
            raise APIError(404, f"The model `{lora[:200]}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found") from None  # fmt: skip
        raise APIError(400, str(err), param=getattr(err, "param", None)) from None  # EngineInputError.param
    if (trace := tracing.CURRENT.get()) is not None:  # request tracing is on: its spans read the handle's times
        trace.add(handle, params, lora)
    return handle


async def _abort_on_disconnect(request: Request, handle: RequestHandle) -> None:
    # after the body is read, the next ASGI message is http.disconnect when the client goes away
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.abort()
            return


def engine_error(err: EngineDeadError | RequestFailedError) -> APIError:
    """The API error of a request the engine ended: 400 naming the field whose constraint failed (its grammar
    reached a state with no way forward), 500 for a failure of the server's own (the engine logged it), 503 once the
    engine itself stopped (every request fails until a restart; /health says so too)."""
    if isinstance(err, EngineDeadError):
        return APIError(503, str(err), type="server_error")
    if err.param is None:
        return APIError(500, str(err), type="server_error")
    return APIError(400, str(err), param=err.param)


BREATHE_S = 0.005
"""Longest a request's delta loop runs on the event loop before it lets other tasks in (`_Breather`)."""


class _Breather:
    """Lets other tasks run once `BREATHE_S` passed since it last did: a request whose deltas are all queued
    (a stream of 16 choices with 20 logprobs each, or its whole reply being collected) never suspends on its own,
    since neither the delta queue nor a non-blocking send yields to the event loop."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    async def __call__(self) -> None:
        if time.monotonic() - self.last > BREATHE_S:
            await asyncio.sleep(0)
            self.last = time.monotonic()


async def deltas(request: Request, handle: RequestHandle) -> AsyncIterator[Delta]:
    """Iterate a request's deltas; the request is aborted if the client disconnects or the consumer stops. A
    request the engine ended with an error raises its `engine_error` (an APIError). Other tasks get the loop at
    least every `BREATHE_S` seconds."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, handle))
    breathe = _Breather()
    try:
        async for delta in handle:
            yield delta
            await breathe()
    except (EngineDeadError, RequestFailedError) as err:
        raise engine_error(err) from None
    finally:
        watcher.cancel()
        if handle.completion is None:
            handle.abort()


def submit_all(engine: Engine, requests: Sequence[tuple[list[int], SamplingParams]], *, busy_status: int,
               lora: str | None = None) -> list[RequestHandle]:  # fmt: skip
    """`submit` each (prompt ids, params) in order; if one fails (the queue filled up meanwhile), the ones already
    queued are aborted before the error is raised, so a list of prompts runs whole or not at all."""
    handles: list[RequestHandle] = []
    try:
        for ids, params in requests:
            handles.append(submit(engine, ids, params, busy_status=busy_status, lora=lora))
    except BaseException:
        for handle in handles:
            handle.abort()
        raise
    return handles


async def _abort_all_on_disconnect(request: Request, handles: Sequence[RequestHandle]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        handle.abort()


async def merged_deltas(request: Request, handles: Sequence[RequestHandle], sources: Sequence[AsyncIterator[Delta]]
                        ) -> AsyncIterator[tuple[int, Delta]]:  # fmt: skip
    """(k, delta) from every `sources[k]` (`handles[k]`'s deltas, possibly wrapped) in arrival order.

    One watcher aborts every request when the client disconnects; when the consumer stops early, or a source
    raises (re-raised here), the unfinished requests are aborted too.
    """
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, source: AsyncIterator[Delta]) -> None:
        try:
            async for delta in source:
                queue.put_nowait((k, delta))
            queue.put_nowait((k, None))
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((k, err))

    watcher = asyncio.create_task(_abort_all_on_disconnect(request, handles))
    pumps = [asyncio.create_task(pump(k, source)) for k, source in enumerate(sources)]
    breathe = _Breather()
    try:
        left = len(pumps)
        while left:
            k, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
                await breathe()
    finally:
        watcher.cancel()
        for task in pumps:
            task.cancel()
        for handle in handles:
            if handle.completion is None:
                handle.abort()


def log_request(request_id: str, route: str, prompt: Any, params: SamplingParams) -> None:
    """Log a request's id, route, prompt (its first `PROMPT_LOG_CHARS` characters) and sampling settings at INFO.

    Only called when the server logs requests (`ServerState.log_requests`, a debugging aid): otherwise no log
    line holds a prompt (nor, ever, the API key).
    """
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
    shown = text[:PROMPT_LOG_CHARS] + (f"... ({len(text)} characters)" if len(text) > PROMPT_LOG_CHARS else "")
    logger.info("request %s %s prompt=%r params=%r", request_id, route, shown, params)


async def complete(request: Request, handle: RequestHandle) -> tuple[list[Delta], Completion]:
    """Wait for a whole request (non-streaming), aborting it on disconnect; returns its deltas and Completion."""
    got = [delta async for delta in deltas(request, handle)]
    if handle.completion is None:
        raise APIError(499, "the client closed the request")
    return got, handle.completion


def internal_error(request: Request) -> APIError:
    """Log the exception being handled (traceback and a new request id); the generic 500 the client gets instead."""
    request_id = f"req-{uuid.uuid4().hex[:24]}"
    logger.exception("internal error in %s %s (request id %s)", request.method, request.url.path, request_id)
    return APIError(500, f"internal error; request id {request_id}", type="server_error")


async def _guarded(events: AsyncIterator[str], request: Request, render_error: Callable[[APIError], Response]
                   ) -> AsyncIterator[str]:  # fmt: skip
    try:
        async for event in events:
            yield event
    except Exception as err:  # the 200 went out: report in-band, in the API's stream error shape
        body = json.loads(render_error(err if isinstance(err, APIError) else internal_error(request)).body)
        yield sse(body, "error" if body.get("type") == "error" else None)  # Anthropic: `event: error`
    finally:
        if hasattr(events, "aclose"):
            await events.aclose()  # run the stream's own cleanup (abort, free KV) now, not at garbage collection


def route(render_error: Callable[[APIError], Response], handler: Callable) -> Callable:
    """Wrap a handler so that APIError (and unexpected failures, see `internal_error`) come back in the API's own
    error shape; a streamed body is wrapped the same way."""

    async def endpoint(request: Request) -> Response:
        try:
            response = await handler(request)
        except APIError as err:
            return render_error(err)
        except Exception:  # a bug, never the client's input: logged, and answered with a generic 500
            return render_error(internal_error(request))
        if isinstance(response, StreamingResponse):
            response.body_iterator = _guarded(response.body_iterator, request, render_error)
        return response

    return endpoint

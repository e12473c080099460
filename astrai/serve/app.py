"""The Starlette app: OpenAI- and Anthropic-compatible routes around one `Engine`, plus health, metrics and vLLM's
operational routes (`vllm_api`: /tokenize, /detokenize, /version, /ping) and LoRA adapters' (`lora_api`: cards,
runtime load / unload, metrics).

`build_app(engine, ...)` returns the ASGI app; `astrai serve` runs it on uvicorn. A pure-ASGI guard in front of
the routes (`Guard`) enforces the optional API key (`Authorization: Bearer KEY` or `x-api-key: KEY`; on /v1/*,
/tokenize, /detokenize, /metrics and the router-facing routes of `router_api`, while /health, /ping and /version
stay open for probes), loopback `Host` names on loopback connections, JSON-only POSTs (but /ping and the router's
bodiless /flush_cache), and the body's size and deadline (counted as it arrives),
and counts requests by endpoint and status; 404/405 come in the API's error shape too. Connection-level limits
(request-head deadline, open connections) are `server.py`'s. No model code lives in the handlers: they map API fields to
`SamplingParams`, submit token ids, and format what the engine streams back. `build_app`'s `sampling_defaults`
(generation_config.json's, filling unset request fields) and `log_requests` (prompts in the log, a debugging aid)
are kept on `ServerState`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from astrai.inference.engine import Engine
from astrai.models.encoder import EncoderConfig
from astrai.serve import (
    anthropic_api,
    embeddings_api,
    lora_api,
    openai_api,
    responses_api,
    router_api,
    tenancy,
    vllm_api,
)
from astrai.serve.common import APIError, anthropic_error, openai_error, route
from astrai.serve.state import ServerState
from astrai.serve.tracing import Tracer

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})  # besides /v1/*: they run the tokenizer (vLLM leaves them open)
KEYED_PATHS |= router_api.KEYED_PATHS  # the router-facing worker routes: model info, load, cache flush
LINGER_S = 0.25  # after an early answer, read (and drop) the rest of the body this long: closing on unread data
# resets the connection, and a reset can reach the client before it has read the answer


def error_renderer(path: str) -> Callable[[APIError], Response]:
    """The error shape of the API `path` belongs to: Anthropic's for /v1/messages*, OpenAI's for everything else."""
    return anthropic_error if path.startswith("/v1/messages") else openai_error


def _hostname(host: str) -> str:
    """`Host` header -> lowercase name without port: `[::1]:8000` -> `::1`, `LocalHost.:80` -> `localhost`."""
    name = host.partition("]")[0][1:] if host.startswith("[") else host.rpartition(":")[0] if ":" in host else host
    return name.lower().rstrip(".")


def _is_loopback(address: str | None) -> bool:
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def _key_matches(key: str, headers: dict[str, str]) -> bool:
    """`Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time (no timing oracle on the key)."""
    bearer = headers.get("authorization", "")
    token = bearer[7:] if bearer[:7].lower() == "bearer " else ""
    expected = key.encode()  # header values are raw bytes, decoded latin-1: compare bytes
    by_bearer = hmac.compare_digest(token.encode("latin-1"), expected)
    return hmac.compare_digest(headers.get("x-api-key", "").encode("latin-1"), expected) or by_bearer


def _matching_key(keys: tuple[str, ...], headers: dict[str, str]) -> str | None:
    """The API key of `keys` the request presents, or None; every key is compared (constant time each), so the
    time taken does not tell which key, if any, matched."""
    matches = [key for key in keys if _key_matches(key, headers)]
    return matches[0] if matches else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the already-read `body` once, then the connection's own messages (disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


class Guard:
    """Host check, auth, content type, body size and body deadline, and request counting in front of every route.

    Pure ASGI (streaming-safe). The Guard reads the body itself, counting bytes as they arrive, so a body over
    `max_body_bytes` is answered 413 the moment it passes the limit whatever its framing (chunked, or a
    `Content-Length` that lies) and never buffered whole, and a body still incomplete after `body_timeout`
    seconds is answered 408; the route then reads the body from memory. Requests arriving on a loopback address
    must name a loopback `Host` (DNS rebinding) unless `allowed_hosts` lists the name (or "*"); POST bodies must be
    `application/json` (a web page's simple cross-site request cannot send that type). Errors come in the API's
    own shape.
    """

    def __init__(self, app: ASGIApp, state: ServerState, *, body_timeout: float = 60.0,
                 allowed_hosts: tuple[str, ...] | None = None) -> None:  # fmt: skip
        self.app, self.state = app, state  # `state` is public: tests and embedders reach the engine through it
        self.body_timeout = body_timeout
        self.allowed_hosts = None if allowed_hosts is None else frozenset(_hostname(h) for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        status = {"code": 499}  # stays 499 when the client leaves before any answer
        tracer = self.state.tracer  # request tracing (`tracing`); None: off, nothing is traced
        trace = None if tracer is None else tracer.start(scope, headers, self.state.model_name)  # for this task
        if trace is not None:
            send = trace.sending(send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            error = self._check(scope, headers)
            tenancy.CURRENT.set(self._tenancy(headers))  # this request's task only (each request runs in its own)
            has_body = "transfer-encoding" in headers or headers.get("content-length", "0") not in ("0", "")
            if error is None:
                body, error = await self._read_body(receive)
                has_body = error is not None  # an error while reading leaves part of the body unread
                if body is not None:
                    status["code"] = 500
                    await self.app(scope, _replay(body, receive), counting_send)
            if error is not None:
                await _answer_early(error_renderer(path)(error), scope, receive, counting_send, unread_body=has_body)
        finally:
            self.state.metrics.count_request(path, status["code"])
            if trace is not None:
                tracer.finish(trace, status["code"])  # its spans, after the reply was written

    def _check(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        host = _hostname(headers.get("host", ""))
        if not self._host_allowed(host, scope):
            return APIError(400, f"the Host {host!r} is not allowed for this server; list it with --allowed-hosts")
        keys, path = self.state.api_keys, scope["path"]
        protected = (path.startswith("/v1/") or path in KEYED_PATHS
                     or (path == "/metrics" and not self.state.metrics_public))  # fmt: skip
        if keys and protected and _matching_key(keys, headers) is None:
            return APIError(401, "invalid or missing API key", type="authentication_error")
        media = headers.get("content-type", "").partition(";")[0].strip().lower()
        bare = path == "/ping" or path in router_api.BARE_POSTS  # SageMaker's bare POST, the router's cache flush
        if scope["method"] == "POST" and media != "application/json" and not bare:
            return APIError(415, f"POST bodies must be JSON sent as Content-Type: application/json, not {media!r}")
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if scope["method"] == "POST" and encoding not in ("", "identity"):
            return APIError(
                415, f"Content-Encoding {encoding[:40]!r} is not supported: send the JSON body uncompressed"
            )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.state.max_body_bytes:
            return APIError(413, f"the request body has {length} bytes; the limit is {self.state.max_body_bytes}")
        return None

    def _tenancy(self, headers: dict[str, str]) -> tenancy.RequestContext:
        """The request's cache salt by API key (`--cache-salt-by-api-key`) and cached-token reporting."""
        key = _matching_key(self.state.api_keys, headers) if self.state.cache_salt_by_api_key else None
        return tenancy.RequestContext(key_salt=None if key is None else tenancy.key_salt(key),
                                      show_cached_tokens=self.state.enable_prompt_tokens_details)  # fmt: skip

    def _host_allowed(self, host: str, scope: Scope) -> bool:
        if host in LOOPBACK_HOSTS or (self.allowed_hosts is not None and ({host, "*"} & self.allowed_hosts)):
            return True
        # not configured: a loopback connection (where a browser page may be rebinding a name) needs a loopback name
        return self.allowed_hosts is None and not _is_loopback((scope.get("server") or (None,))[0])

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, APIError | None]:
        """The whole body, or an error (413 past the limit, 408 past the deadline); (None, None): client gone."""
        limit, chunks, size = self.state.max_body_bytes, [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None, None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        return None, APIError(413, f"the request body passed the limit of {limit} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks), None
        except TimeoutError:
            return None, APIError(408, f"the request body did not arrive within {self.body_timeout:g} s")


async def _answer_early(response: Response, scope: Scope, receive: Receive, send: Send, *, unread_body: bool) -> None:
    """Send an error answer; with part of the body unread, close the connection after it (lingering briefly)."""
    if not unread_body:
        await response(scope, receive, send)
        return
    response.headers["connection"] = "close"  # never read (possibly endless) rest of the body on a kept connection
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": True})  # the whole answer
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while (message := await receive())["type"] == "http.request" and message.get("more_body", False):
                pass
    await send({"type": "http.response.body", "body": b"", "more_body": False})  # then uvicorn closes


def _basic_routes(state: ServerState) -> list[Route]:
    async def health(request: Request) -> Response:
        # 503 once the engine thread stopped (every generation request fails until a restart): an orchestrator's
        # liveness probe then restarts the server
        stats, down = state.engine.stats(), state.engine.unavailable
        body = {"status": "ok" if down is None else "error", "model": state.model_name, "running": stats.running,
                "waiting": stats.waiting}  # fmt: skip
        return JSONResponse(body if down is None else {**body, "error": down}, status_code=200 if down is None else 503)

    async def metrics(request: Request) -> Response:
        engine, stats = state.engine, state.engine.stats()
        prefix = (engine.radix.query_tokens, engine.radix.hit_tokens) if engine.radix is not None else (0, 0)
        text = state.metrics.render(stats, up=engine.unavailable is None, prefix_tokens=prefix)
        if engine.config.enable_lora:
            text += "\n".join(lora_api.lora_lines(stats, list(state.adapters()), engine.config.max_loras)) + "\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # vLLM's card fields too: routers and clients read max_model_len (the context a request may fill)
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "astrai",
            "root": state.model_name, "parent": None, "max_model_len": state.context}  # fmt: skip

    async def models(request: Request) -> Response:  # the base model, then each LoRA adapter (`lora_api`)
        return JSONResponse({"object": "list", "data": [card, *lora_api.adapter_cards(state)]})

    async def model(request: Request) -> Response:
        # OpenAI's "retrieve model": the card of the served model or an adapter, 404 in OpenAI's shape for any other
        name = request.path_params["name"]
        found = next((c for c in [card, *lora_api.adapter_cards(state)] if c["id"] == name), None)
        if found is None:
            raise APIError(404, f"The model {name[:200]!r} does not exist", param="model", code="model_not_found")
        return JSONResponse(found)

    return [Route("/health", route(openai_error, health)), Route("/metrics", route(openai_error, metrics)),
            Route("/v1/models", route(openai_error, models)),
            Route("/v1/models/{name:path}", route(openai_error, model)), *vllm_api.routes(state, health)]  # fmt: skip


async def _http_error(request: Request, exc: Exception) -> Response:
    # Starlette's 404 (no route) and 405 (route without that method), in the API's shape (OpenAI's wording)
    assert isinstance(exc, HTTPException)
    err = APIError(exc.status_code, f"Invalid URL ({request.method} {request.url.path})")
    response = error_renderer(request.url.path)(err)
    response.headers.update(exc.headers or {})  # 405: Allow
    return response


def build_app(engine: Engine, *, model_name: str = "astrai", api_key: str | Sequence[str] | None = None,
              max_body_bytes: int = 8 << 20, embeddings: EncoderConfig | None = None, body_timeout: float = 60.0,
              allowed_hosts: tuple[str, ...] | None = None, metrics_public: bool = False, tokenizer_workers: int = 4,
              allow_special_tokens_in_content: bool = False, sampling_defaults: Mapping[str, Any] | None = None,
              log_requests: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, model_aliases: Sequence[str] = (),
              responses_max_stored: int = responses_api.DEFAULT_MAX_STORED,
              responses_max_stored_bytes: int = responses_api.DEFAULT_MAX_STORED_BYTES,
              max_embedding_tokens_per_request: int = embeddings_api.MAX_REQUEST_TOKENS,
              max_embedding_batch_tokens: int | None = None, cache_salt_by_api_key: bool = False,
              enable_prompt_tokens_details: bool = False, max_reply_bytes: int | None = 32 << 20,
              stream_stall_timeout: float | None = 30.0, lora_parents: Mapping[str, str] | None = None,
              lora_runtime_updates: bool = False, lora_root: str | None = None,
              tracer: Tracer | None = None) -> ASGIApp:  # fmt: skip
    """The ASGI app serving `engine`; shutting the app down (lifespan) shuts the engine down.

    `embeddings` enables `POST /v1/embeddings` with that pooling (the engine's model run as an encoder), run on
    its own worker thread (`embeddings_api.Embedder`) in passes of at most `max_embedding_batch_tokens` padded
    tokens (None: the engine's `max_step_tokens`), taking turns between requests; a request may hold at most
    `max_embedding_tokens_per_request` tokens over its inputs.
    `body_timeout` bounds the seconds a request body may take to arrive; `allowed_hosts` (see `Guard`) lists the
    `Host` names accepted besides loopback ones ("*": any; None: any, except on loopback connections).
    With an `api_key`, `GET /metrics` needs the key too unless `metrics_public`. `tokenizer_workers` threads
    render chat templates and tokenize, off the event loop; `allow_special_tokens_in_content` lets special-token
    text in chat messages become control tokens (`Tokenizer.encode_chat`). `sampling_defaults` (keys of
    `sampling_fields.SAMPLING_DEFAULT_KEYS`, e.g. `Model.generation_defaults` from generation_config.json) fill the
    sampling fields a request leaves unset; an explicit value in the request wins. `log_requests` logs each
    request's id, route, prompt (its first 200 characters) and sampling params at INFO on the `astrai.serve`
    logger; without it no log line holds a prompt. `tool_call_parser` names the format of the model's tool calls
    (`tool_parsers.PARSERS`: hermes, mistral, llama3_json, qwen3_coder, deepseek_v3; None: detected from the chat
    template). `reasoning_parser` (`reasoning.PARSERS`: qwen3, deepseek_r1) splits `<think>` reasoning off the
    answer (OpenAI `reasoning_content`, Anthropic `thinking` blocks); None: the text stays as generated.
    A request's `model` must be `model_name` or one of `model_aliases` (or absent): any other is a 404
    `model_not_found`. `api_key` may list several keys (each accepted); `cache_salt_by_api_key` salts every
    request's prefix-cache pages by the key it presented, so clients of different keys never share a cached page,
    and `enable_prompt_tokens_details` reports `cached_tokens` in usage (`tenancy`). `responses_max_stored` /
    `responses_max_stored_bytes` bound the `/v1/responses` store. `max_reply_bytes` bounds a reply's size as
    estimated before generation (n, max_tokens, logprobs, echo, prompt_logprobs; over it: a 400 naming them;
    None: no bound); `stream_stall_timeout` aborts a stream whose client stopped reading for that many seconds
    (`common.stream_response`; None: never).
    LoRA adapters loaded on an engine with `enable_lora` are served by name (`lora_api`): `lora_parents` maps an
    adapter to the base name its card reports as `parent` (default `model_name`); `lora_runtime_updates` adds
    `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`, which read only under `lora_root` when it is set.
    `tracer` (`tracing.Tracer`) gives every generation request a span tree, exported by its processor; None (the
    default): no tracing, and nothing of OpenTelemetry is imported.

    Raises:
        ValueError: `sampling_defaults` has a key that is not a sampling default, or a value of the wrong type;
            `tool_call_parser` or `reasoning_parser` is not a parser's name; `cache_salt_by_api_key` without a key;
            `lora_runtime_updates` on an engine without `enable_lora`.
    """
    keys = api_key if api_key is None or isinstance(api_key, str) else tuple(api_key)
    if cache_salt_by_api_key and not keys:
        raise ValueError("cache_salt_by_api_key needs an api_key: without keys every client is the same tenant")
    if lora_runtime_updates and not engine.config.enable_lora:
        raise ValueError("lora_runtime_updates needs an engine with enable_lora (astrai serve --enable-lora)")
    state = ServerState(engine=engine, model_name=model_name, model_aliases=tuple(model_aliases), api_key=keys,
                        cache_salt_by_api_key=cache_salt_by_api_key,
                        enable_prompt_tokens_details=enable_prompt_tokens_details,
                        max_body_bytes=max_body_bytes, max_reply_bytes=max_reply_bytes,
                        stream_stall_timeout=stream_stall_timeout,
                        embeddings=embeddings, metrics_public=metrics_public, tokenizer_workers=tokenizer_workers,
                        allow_special_tokens_in_content=allow_special_tokens_in_content,
                        sampling_defaults=sampling_defaults or {}, log_requests=log_requests,
                        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                        lora_parents=dict(lora_parents or {}), lora_runtime_updates=lora_runtime_updates,
                        lora_root=lora_root, tracer=tracer)  # fmt: skip

    embedder = None
    if embeddings is not None:
        batch_tokens = max_embedding_batch_tokens or engine.config.max_step_tokens
        embedder = embeddings_api.Embedder(engine.model, embeddings, max_batch_tokens=batch_tokens,
                                           unavailable=lambda: engine.unavailable)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        engine.shutdown()  # ends in-flight requests (finish_reason "abort") and frees their KV
        if embedder is not None:
            embedder.close()  # ends held embeddings requests (503) and stops its thread
        if tracer is not None:
            await asyncio.to_thread(tracer.shutdown)  # exports the spans still queued (may wait on the network)

    routes = _basic_routes(state) + openai_api.routes(state)
    routes += embeddings_api.routes(state, embedder, max_request_tokens=max_embedding_tokens_per_request)
    routes += anthropic_api.routes(state)
    routes += responses_api.routes(state, max_stored=responses_max_stored, max_stored_bytes=responses_max_stored_bytes)
    routes += lora_api.routes(state) + router_api.routes(state)
    state.metrics.endpoints = frozenset(r.path for r in routes)  # any other path is counted as `other`
    state.metrics.model_name = model_name  # the vllm: families' model_name label
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.server = state
    app.state.embedder = embedder  # tests and benchmarks watch its passes
    app.add_exception_handler(404, _http_error)
    app.add_exception_handler(405, _http_error)
    return Guard(app, state, body_timeout=body_timeout, allowed_hosts=allowed_hosts)

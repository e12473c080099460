"""OpenAI-compatible routes: `POST /v1/chat/completions` and `POST /v1/completions` (`GET /v1/models` is app.py's).

What a request may hold, and how each field is validated and mapped onto the chat template and SamplingParams,
is `openai_protocol`'s; here the handlers submit the validated request and format the reply. Validation,
template rendering and tokenization run on the server's worker pool (`ServerState.offload`), never on the event
loop, so a huge prompt does not stall other clients' streams.

Every bad field is a 400 in OpenAI's error shape naming `param` (never a 500); the queue being full is a 429, a
dead engine a 503. A request is aborted (its KV freed) when the client disconnects. If the engine shuts down
mid-request, a stream ends with an `{"error": ...}` event (the SDKs raise it) and a plain request gets a 503.
Usage counts tokens (all n completions) with `prompt_tokens_details.cached_tokens` from the prefix cache.
Logprobs cover every generated token (a final eos included), with each token's own UTF-8 `bytes`; -inf is
reported as -9999.0, since JSON has no infinity. Streams: a role chunk per choice, content / tool_calls deltas
(a call's id and name first with `arguments: ""`, then its arguments), one finish chunk per choice, a usage
chunk with `choices: []` when asked, then `data: [DONE]`. Not enforced: `parallel_tool_calls: false`. A forced
call (tool_choice "required" / named) that the model fails to complete comes back as text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from astrai.inference.engine import EngineDeadError
from astrai.inference.handle import RequestHandle
from astrai.inference.outputs import Completion, Delta
from astrai.io.token_bytes import TokenBytes
from astrai.serve import common
from astrai.serve.common import APIError, openai_error, sse
from astrai.serve.openai_protocol import ChatRequest, CompletionRequest, parse_chat, parse_completion
from astrai.serve.state import ServerState
from astrai.serve.tool_calls import (
    Event,
    TextDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallParser,
    ToolCallStart,
    parse_tool_calls,
)


# ---- responses ----------------------------------------------------------------------------------------------
def _usage(completion: Completion) -> dict:
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": completion.cached_tokens}}  # fmt: skip


def _finish(reason: str | None, has_calls: bool) -> str:
    if reason == "abort":  # only on engine shutdown: a client that disconnected reads nothing
        raise APIError(503, "the request was aborted: the server is shutting down", type="server_error")
    return "tool_calls" if has_calls and reason == "stop" else reason or "stop"


def _stream_end(head: dict, handle: RequestHandle, include_usage: bool) -> list[str]:
    """A finished stream's last events: the usage chunk (`choices: []`) when asked for, then `[DONE]`."""
    usage = include_usage and handle.completion is not None
    return ([sse({**head, "choices": [], "usage": _usage(handle.completion)})] if usage else []) + [sse("[DONE]")]


def _error_event(err: APIError) -> str:
    # an error after the 200 header went out: the SDKs raise on an `error` object in the stream
    return sse({"error": {"message": err.message, "type": err.type, "param": None, "code": None}})


async def _engine_deltas(state: ServerState, request: Request, handle: RequestHandle, prompt_len: int
                         ) -> AsyncIterator[Delta]:  # fmt: skip
    """The request's deltas, through the metrics, aborted on disconnect; a dead engine is a 503."""
    try:
        async for delta in state.metrics.observe(common.deltas(request, handle), prompt_len):
            yield delta
    except EngineDeadError as err:
        raise APIError(503, str(err), type="server_error") from None


async def _collect(state: ServerState, request: Request, handle: RequestHandle, prompt_len: int) -> Completion:
    async for _ in _engine_deltas(state, request, handle, prompt_len):
        pass
    if handle.completion is None:
        raise APIError(499, "the client closed the request")
    return handle.completion


def _chat_logprobs(texts: TokenBytes, ids: tuple[int, ...], lps: Any, tops: Any) -> dict:
    def entry(token: int, logprob: float) -> dict:
        return {"token": texts.text(token), "logprob": max(logprob, -9999.0), "bytes": list(texts.bytes(token))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in (tops[k] if tops else ())]}
                        for k, (t, lp) in enumerate(zip(ids, lps or (), strict=False))]}  # fmt: skip


def _chunk_deltas(events: list[Event]) -> list[dict]:
    """Chat-chunk `delta`s for parser events, tool calls in OpenAI's streaming shape (ToolCallEnd needs none)."""
    out = []
    for e in events:
        if isinstance(e, TextDelta):
            out.append({"content": e.text})
        elif isinstance(e, ToolCallStart):
            fn = {"name": e.name, "arguments": ""}
            out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function", "function": fn}]})
        elif isinstance(e, ToolCallArgs):
            out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return out


async def _chat_stream(state: ServerState, request: Request, handle: RequestHandle, chat: ChatRequest,
                       head: dict) -> AsyncIterator[str]:  # fmt: skip
    tail = {"usage": None} if chat.include_usage else {}
    texts = TokenBytes(state.tokenizer)

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "choices": [choice], **tail})

    parsers = [ToolCallParser(chat.tool_names, chat.prefill) for _ in range(chat.params.n)]
    for i in range(chat.params.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async for d in _engine_deltas(state, request, handle, len(chat.prompt)):
            parser = parsers[d.index]
            if chat.parse:
                events = parser.feed(d.text) + (parser.finish() if d.finish_reason else [])
            else:
                events = [TextDelta(d.text)] if d.text else []
            lp = None
            if chat.params.wants_logprobs and d.token_ids:
                lp = _chat_logprobs(texts, d.token_ids, d.logprobs, d.top_logprobs)
            for k, delta in enumerate(_chunk_deltas(events) or ([{"content": ""}] if lp else [])):
                yield chunk(d.index, delta, lp if k == 0 else None)  # each token's logprob goes out once
            if d.finish_reason:
                yield chunk(d.index, {}, None, _finish(d.finish_reason, bool(parser.calls)))
    except APIError as err:
        yield _error_event(err)
        return
    for event in _stream_end(head, handle, chat.include_usage):
        yield event


def _openai_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def _chat_completions(state: ServerState, request: Request) -> Response:
    body = await common.json_body(request)
    chat = await state.offload(parse_chat, body, state.tokenizer, vocab_size=state.vocab_size, context=state.context,
                               allow_special_tokens=state.allow_special_tokens_in_content)  # fmt: skip
    handle = common.submit(state.engine, chat.prompt, chat.params, busy_status=429)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    if chat.stream:
        return common.stream_response(_chat_stream(state, request, handle, chat,
                                                   {**head, "object": "chat.completion.chunk"}))  # fmt: skip
    completion = await _collect(state, request, handle, len(chat.prompt))
    texts, choices = TokenBytes(state.tokenizer), []
    for out in completion.outputs:
        text, calls = parse_tool_calls(out.text, chat.tool_names, chat.prefill) if chat.parse else (out.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = [_openai_call(c) for c in calls]
        lp = None
        if chat.params.wants_logprobs:
            lp = _chat_logprobs(texts, out.token_ids, out.logprobs, out.top_logprobs)
        reason = _finish(out.finish_reason, bool(calls))
        choices.append({"index": out.index, "message": message, "logprobs": lp, "finish_reason": reason})
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": _usage(completion)})


# ---- legacy completions -------------------------------------------------------------------------------------
def _legacy_logprobs(texts: TokenBytes, ids: Any, lps: Any, tops: Any, offset: int) -> dict:
    tokens = [texts.text(t) for t in ids]
    offsets = [offset + sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    top = [{texts.text(a): max(b, -9999.0) for a, b in alts} for alts in tops] if tops else None
    return {"tokens": tokens, "token_logprobs": [max(x, -9999.0) for x in lps or ()], "top_logprobs": top,
            "text_offset": offsets}  # fmt: skip


async def _completions(state: ServerState, request: Request) -> Response:
    body = await common.json_body(request)
    req = await state.offload(parse_completion, body, state.tokenizer, vocab_size=state.vocab_size,
                              context=state.context)  # fmt: skip
    handle = common.submit(state.engine, req.prompt, req.params, busy_status=429)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}  # fmt: skip
    if req.stream:
        return common.stream_response(_completion_stream(state, request, handle, req, head))
    completion, texts = await _collect(state, request, handle, len(req.prompt)), TokenBytes(state.tokenizer)
    choices = []
    for o in completion.outputs:
        lp = None
        if req.logprobs is not None:
            lp = _legacy_logprobs(texts, o.token_ids, o.logprobs, o.top_logprobs, len(req.echo))
        choices.append({"index": o.index, "text": req.echo + o.text, "logprobs": lp,
                        "finish_reason": _finish(o.finish_reason, False)})  # fmt: skip
    return JSONResponse({**head, "choices": choices, "usage": _usage(completion)})


async def _completion_stream(state: ServerState, request: Request, handle: RequestHandle, req: CompletionRequest,
                             head: dict) -> AsyncIterator[str]:  # fmt: skip
    tail, texts = {"usage": None} if req.include_usage else {}, TokenBytes(state.tokenizer)
    offsets: dict[int, int] = {}  # per choice: characters sent so far (legacy text_offset)
    try:
        async for d in _engine_deltas(state, request, handle, len(req.prompt)):
            piece = ("" if d.index in offsets else req.echo) + d.text
            offset = offsets.get(d.index, 0) + len(piece) - len(d.text)
            lp = None
            if d.logprobs is not None and d.token_ids:
                lp = _legacy_logprobs(texts, d.token_ids, d.logprobs, d.top_logprobs, offset)
            offsets[d.index] = offset + len(d.text)
            finish = _finish(d.finish_reason, False) if d.finish_reason else None
            yield sse({**head, "choices": [{"index": d.index, "text": piece, "logprobs": lp, "finish_reason": finish}],
                       **tail})  # fmt: skip
    except APIError as err:
        yield _error_event(err)
        return
    for event in _stream_end(head, handle, req.include_usage):
        yield event


def routes(state: ServerState) -> list[Route]:
    """The OpenAI routes over `state`: errors in OpenAI's shape, busy -> 429."""

    def bind(handler: Any) -> Any:
        async def call(request: Request) -> Response:
            return await handler(state, request)

        return common.route(openai_error, call)

    return [Route("/v1/chat/completions", bind(_chat_completions), methods=["POST"]),
            Route("/v1/completions", bind(_completions), methods=["POST"])]  # fmt: skip

"""`POST /v1/responses` (OpenAI's Responses API) on the chat machinery, with `GET` / `DELETE /v1/responses/{id}`.

A request is mapped onto a chat completions request (`responses_protocol`, on the worker pool) and runs like one:
same chat template, tool-call grammars and parser (`ServerState.tool_parser`), structured output, reasoning parser
and sampling. The model's output becomes output items in order: a `reasoning` item (the text the server's
reasoning parser splits off, as `reasoning_text` content), a `message` item with one `output_text` part (when the
model wrote text, or wrote nothing at all), and one `function_call` item per parsed tool call (`call_id` is the
chat route's tool-call id). `status` is "completed", or "incomplete" with `incomplete_details.reason:
"max_output_tokens"` when the token budget cut the output (a forced call cut in a further parallel call is
complete, as on the chat route). Usage: `input_tokens` (`cached_tokens` from the prefix cache), `output_tokens`
(`reasoning_tokens`: the reasoning text's tokens), `total_tokens`.

Streaming (`stream: true`) sends the SDK's `response.*` events, each with its `event:` name and an increasing
`sequence_number`: `response.created`, `response.in_progress`, then per item `response.output_item.added`,
(message) `response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`; (reasoning) the same with `response.reasoning_text.*`; (function call)
`response.function_call_arguments.delta`..., `.done`; `response.output_item.done`; and last `response.completed`
or `response.incomplete` with the whole response. The streamed and the whole reply are built by the same
`_Assembler`, so they hold the same items. An error after the stream began is an `error` event.

Store: unless `store: false`, the finished response and its conversation (input and output as chat messages) are
kept in memory for `GET /v1/responses/{id}` and `previous_response_id` (whose conversation goes before the new
input; its `instructions` are not carried over, as OpenAI). The store is bounded in count and in bytes (the JSON
size of both), least recently used first out: `DEFAULT_MAX_STORED` responses and `DEFAULT_MAX_STORED_BYTES` by
default (`routes(state, max_stored=..., max_stored_bytes=...)`); an evicted or unknown id is a 404, as is one
removed by `DELETE`. It lives as long as the process.

Disconnecting aborts the engine request (`common.deltas`); parsing and rendering run on the worker pool.
"""

from __future__ import annotations

import json
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from astrai.serve import common, tenancy
from astrai.serve.common import APIError, openai_error, sse
from astrai.serve.openai_api import compile_grammar, engine_deltas, no_free_text
from astrai.serve.reasoning import new_parsers, sort_events
from astrai.serve.responses_protocol import ResponsesRequest, parse_responses, rename_param
from astrai.serve.state import ServerState
from astrai.serve.tool_calls import TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from astrai.serve.tool_parsers import new_parser

DEFAULT_MAX_STORED = 1024  # responses kept for GET / previous_response_id
DEFAULT_MAX_STORED_BYTES = 64 << 20  # their JSON size, responses and conversations together


@attrs.define
class _Stored:
    response: dict
    messages: list[dict]  # the conversation up to and including this response's output, as chat messages
    size: int


class ResponseStore:
    """Finished responses by id, at most `max_count` and `max_bytes` (JSON size), least recently used out first."""

    def __init__(self, max_count: int = DEFAULT_MAX_STORED, max_bytes: int = DEFAULT_MAX_STORED_BYTES) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, messages: list[dict], size: int) -> None:
        """Keep a response (`size`: its JSON bytes, `entry_size`); evicts the least recently used ones to fit. One
        larger than `max_bytes` on its own is not kept."""
        self.delete(response["id"])
        if size > self.max_bytes or self.max_count <= 0:
            return
        self._items[response["id"]] = _Stored(response, messages, size)
        self.bytes += size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, response_id: str) -> _Stored | None:
        """The stored response (now the most recently used), or None."""
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is not None:
            self.bytes -= item.size
        return item is not None


def entry_size(response: dict, messages: list[dict]) -> int:
    """The bytes a store entry counts: the JSON of the response and of its conversation (run off the loop)."""
    return len(json.dumps(response).encode()) + len(json.dumps(messages).encode())


_STORES: weakref.WeakKeyDictionary[ServerState, ResponseStore] = weakref.WeakKeyDictionary()


def store_of(state: ServerState) -> ResponseStore:
    """The response store of a server (made by `routes`)."""
    return _STORES[state]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Assembler:
    """Turns one output's text, as it arrives, into Responses output items and their stream events."""

    def __init__(self, state: ServerState, req: ResponsesRequest) -> None:
        chat = req.chat
        self.parser = new_parser(state.tool_parser, chat.tool_names, chat.tool_schemas, forced=chat.forced)
        thinkers = new_parsers(state.reasoning_parser, state.tokenizer, chat.prompt, constrained=no_free_text(chat))
        self.thinker = thinkers[0] if thinkers else None
        self.parse = chat.parse
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, dict] = {}  # parser call index -> its function_call item
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _start(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        shown = dict(item, content=[]) if "content" in item else dict(item)
        out = [self.event("response.output_item.added", item=shown, output_index=len(self.items) - 1)]
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": []} if item["type"] == "message" else \
                {"type": "reasoning_text", "text": ""}  # fmt: skip
            out.append(self.event("response.content_part.added", content_index=0, part=part, **self._where(item)))
        return out

    def close(self, status: str = "completed") -> list[dict]:
        """Finish the open item (if any): its done events."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where, out = self._where(item), []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            out.append(self.event(f"response.{name}.done", content_index=0, text=part["text"], **where,
                                  **({"logprobs": []} if name == "output_text" else {})))  # fmt: skip
            out.append(self.event("response.content_part.done", content_index=0, part=part, **where))
        else:
            out.append(self.event("response.function_call_arguments.done", arguments=item["arguments"],
                                  name=item["name"], **where))  # fmt: skip
        out.append(self.event("response.output_item.done", item=item, output_index=where["output_index"]))
        return out

    def _open(self, kind: str) -> list[dict]:
        """Make sure an item of `kind` (message / reasoning) is open: the events that opened it, if any."""
        out: list[dict] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": [part]}  # fmt: skip
            else:
                item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                        "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
            out += self._start(item)
        return out

    def _text(self, kind: str, text: str) -> list[dict]:
        out = self._open(kind)
        self.open["content"][0]["text"] += text
        name = "output_text" if kind == "message" else "reasoning_text"
        out.append(self.event(f"response.{name}.delta", content_index=0, delta=text, **self._where(self.open),
                              **({"logprobs": []} if kind == "message" else {})))  # fmt: skip
        return out

    def feed(self, text: str, final: bool, cut: bool = False) -> list[dict]:
        """Events for `text` appended to the output (`final`: the output ended; `cut`: by the token budget, so a
        call it cut short is dropped, never given back as text)."""
        reasoning = ""
        if self.thinker is not None:
            reasoning, text = sort_events(self.thinker.feed(text) + (self.thinker.finish() if final else []))
        out = self._text("reasoning", reasoning) if reasoning else []
        events = (self.parser.feed(text) + (self.parser.finish(cut) if final else [])) if self.parse else (
            [TextDelta(text)] if text else [])  # fmt: skip
        for e in events:
            if isinstance(e, TextDelta) and e.text:
                out += self._text("message", e.text)
            elif isinstance(e, ToolCallStart):
                out += self.close()
                item = {"id": _new_id("fc"), "type": "function_call", "call_id": e.id, "name": e.name,
                        "arguments": "", "status": "in_progress"}  # fmt: skip
                self.calls[e.index] = item
                out += self._start(item)
            elif isinstance(e, ToolCallArgs):
                item = self.calls[e.index]
                item["arguments"] += e.text
                out.append(self.event("response.function_call_arguments.delta", delta=e.text, **self._where(item)))
            elif isinstance(e, ToolCallEnd):
                final_args = {c.id: c.arguments for c in self.parser.calls}
                item = self.calls[e.index]
                item["arguments"] = final_args.get(item["call_id"], item["arguments"])
                out += self.close()
        return out

    def end(self, incomplete: bool) -> list[dict]:
        """Close what is open; an output with no item at all gets an empty message (the SDK's output_text is "")."""
        out = self.close("incomplete" if incomplete else "completed")
        if not self.items:
            out += self._open("message") + self.close("incomplete" if incomplete else "completed")
        return out

    def messages(self) -> list[dict]:
        """The output as one chat assistant message (for `previous_response_id`)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        reasoning = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]  # fmt: skip
        msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = reasoning
        return [msg]


def _echo(body: dict, req: ResponsesRequest) -> dict:
    """The request fields a response carries (the SDK's `Response` requires tools, tool_choice, ...); temperature
    and top_p are the values used (the server's sampling defaults fill unset ones)."""
    text = body.get("text") or {}
    return {
        "instructions": body.get("instructions"), "metadata": body.get("metadata"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": req.chat.params.temperature, "top_p": req.chat.params.top_p,
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "text": {"format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity", "medium")},
        "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None, **(body.get("reasoning") or {})},
        "store": body.get("store", True), "user": body.get("user"), "background": False, "truncation": "disabled",
        "error": None,
    }  # fmt: skip


def _usage(state: ServerState, handle: Any, assembler: _Assembler) -> dict | None:
    completion = handle.completion
    if completion is None:
        return None
    reasoning = "".join(i["content"][0]["text"] for i in assembler.items if i["type"] == "reasoning")
    thought = len(state.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return {"input_tokens": completion.prompt_tokens, "output_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
            # the SDK's type requires the field: 0 when the server does not report cached tokens (`tenancy`)
            "input_tokens_details": {"cached_tokens": completion.cached_tokens if tenancy.shows_cached_tokens()
                                     else 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": min(thought, completion.completion_tokens)}}  # fmt: skip


async def _run(state: ServerState, request: Request, body: dict, req: ResponsesRequest, head: dict,
               lora: str | None) -> AsyncIterator[dict]:  # fmt: skip
    """The request's stream events, the last one `response.completed` / `response.incomplete` (then stored); run
    with the LoRA adapter `lora` (None: the base model)."""
    handle = common.submit(state.engine, req.chat.prompt, req.chat.params, busy_status=429, lora=lora)
    asm = _Assembler(state, req)
    yield asm.event("response.created", response={**head, "status": "in_progress"})
    yield asm.event("response.in_progress", response={**head, "status": "in_progress"})
    reason = None
    async for d in engine_deltas(state, request, handle, len(req.chat.prompt)):
        for event in asm.feed(d.text, bool(d.finish_reason), cut=d.finish_reason == "length"):
            yield event
        reason = d.finish_reason or reason
    if handle.completion is None:
        raise APIError(499, "the client closed the request")
    if reason == "abort":  # only on engine shutdown: a client that disconnected reads nothing
        raise APIError(503, "the request was aborted: the server is shutting down", type="server_error")
    incomplete = reason == "length" and not req.chat.forced
    for event in asm.end(incomplete):
        yield event
    usage = await state.offload(_usage, state, handle, asm)
    done = {**head, "status": "incomplete" if incomplete else "completed", "output": asm.items, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "completed_at": None if incomplete else int(time.time())}  # fmt: skip
    if body.get("store", True) is not False:
        messages = req.messages + asm.messages()
        store_of(state).put(done, messages, await state.offload(entry_size, done, messages))
    yield asm.event("response.incomplete" if incomplete else "response.completed", response=done)


async def _create(state: ServerState, request: Request) -> Response:
    body = await common.json_body(request)
    lora = state.check_model(body)
    history: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store_of(state).get(previous) if isinstance(previous, str) else None
        if stored is None:
            raise APIError(404, f"Previous response with id {str(previous)[:200]!r} not found.",
                           param="previous_response_id", code="previous_response_not_found")  # fmt: skip
        history = stored.messages
    req = await state.offload(parse_responses, body, history, state.tokenizer, vocab_size=state.vocab_size,
                              context=state.context, allow_special_tokens=state.allow_special_tokens_in_content,
                              defaults=state.sampling_defaults, tool_parser=state.tool_parser,
                              request=request)  # fmt: skip
    try:
        await compile_grammar(state, req.chat.params)
    except APIError as err:
        raise attrs.evolve(err, param=rename_param(err.param)) from None
    head = {"id": _new_id("resp"), "object": "response", "created_at": int(time.time()),
            "model": state.reply_model(lora), "output": [], "usage": None, "incomplete_details": None,
            **_echo(body, req)}  # fmt: skip
    if state.log_requests:
        common.log_request(head["id"], request.url.path, req.messages, req.chat.params)
    events = _run(state, request, body, req, head, lora)
    if req.chat.stream:
        return common.stream_response(_framed(state, events))
    last: dict = {}
    try:
        async for last in events:  # noqa: B007 - the last event holds the whole response
            pass
    except APIError as err:
        raise attrs.evolve(err, param=rename_param(err.param)) from None
    return await _json(state, last["response"])


async def _json(state: ServerState, response: dict) -> Response:
    """A response object as JSON, serialized on the worker pool (it echoes the request's tools and instructions)."""
    return Response(await state.offload(json.dumps, response, ensure_ascii=False), media_type="application/json")


async def _framed(state: ServerState, events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """SSE frames (`event:` the type), an `error` event when the request fails after the stream began. Events that
    carry the whole response (it echoes the request's tools) are framed on the worker pool."""
    seq = 0
    try:
        async for event in events:
            seq = event["sequence_number"] + 1
            yield await state.offload(sse, event, event["type"]) if "response" in event else sse(event, event["type"])
    except APIError as err:
        error = {"type": "error", "code": err.code or err.type, "message": err.message,
                 "param": rename_param(err.param), "sequence_number": seq}  # fmt: skip
        yield sse(error, "error")
    finally:
        await events.aclose()


def routes(state: ServerState, *, max_stored: int = DEFAULT_MAX_STORED,
           max_stored_bytes: int = DEFAULT_MAX_STORED_BYTES) -> list[Route]:  # fmt: skip
    """`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}` over `state`, with a response store of at most
    `max_stored` responses and `max_stored_bytes` bytes (`store_of(state)`)."""
    store = _STORES.setdefault(state, ResponseStore(max_stored, max_stored_bytes))

    def found(request: Request) -> str:
        response_id = request.path_params["response_id"]
        if store.get(response_id) is None:
            raise APIError(404, f"Response with id {response_id[:200]!r} not found.", param="response_id",
                           code="response_not_found")  # fmt: skip
        return response_id

    async def create(request: Request) -> Response:
        return await _create(state, request)

    async def retrieve(request: Request) -> Response:
        return await _json(state, store.get(found(request)).response)

    async def delete(request: Request) -> Response:
        response_id = found(request)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return [Route("/v1/responses", common.route(openai_error, create), methods=["POST"]),
            Route("/v1/responses/{response_id}", common.route(openai_error, retrieve), methods=["GET"]),
            Route("/v1/responses/{response_id}", common.route(openai_error, delete), methods=["DELETE"])]  # fmt: skip

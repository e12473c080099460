"""Anthropic-compatible Messages API: `POST /v1/messages` (and `POST /v1/messages/count_tokens`).

Request validation, the prompt and the sampling settings (with the server's sampling defaults for unset fields)
are `anthropic_protocol`'s. The prompt is rendered and
tokenized on the server's worker pool (`ServerState.offload`), so a huge prompt does not stall other streams.

Response: `{"id": "msg_<24 hex>", "type": "message", "role": "assistant", "model", "content": [a `thinking` block
{"thinking", "signature": ""} when the server has a reasoning parser and the model reasoned, text block (omitted
when blank and tool calls follow; no block at all when the answer was only a tool call's markup that was dropped,
e.g. a forced call cut by `max_tokens`), tool_use blocks {"id": "toolu_<24 hex>", "name", "input"}], "stop_reason":
"end_turn" | "max_tokens" | "stop_sequence" | "tool_use", "stop_sequence", "usage": {"input_tokens",
"output_tokens"}}` (token counts; output includes the eos token). With `stream`: SSE events, each `event: <type>` +
`data: <json>` + a blank line: message_start, then per block content_block_start / content_block_delta
(`thinking_delta`, `text_delta`, or `input_json_delta` whose `partial_json` fragments concatenate to the input's
JSON) / content_block_stop, then message_delta (stop_reason, stop_sequence, usage.output_tokens) and message_stop;
no `[DONE]`. An engine failure mid-stream is an `error` event. The non-streaming body is assembled from the very
same events, so both modes always agree.

Which stop sequence fired: the request runs with `include_stop_str_in_output=True` and the reply strips the
stop itself. The engine emits text that might begin a stop string only once it is decided, so the matched stop
arrives whole at the end of the final delta; the stop that ended generation is the longest stop sequence the
text ends with (the engine picks the occurrence ending first, ties to the longest).

Errors: bad input 400, bad key 401, body too large 413, queue full 529 (overloaded_error), client gone 499; a client
disconnect aborts the request and frees its KV. Not supported: images, documents, citations, thinking signatures
(always ""), server tools, prompt caching fields (cache_control is accepted and ignored). With
`ServerState.log_requests` each request's id, route, messages (truncated) and sampling params are logged at INFO;
otherwise no prompt text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from astrai.inference.outputs import Delta
from astrai.serve.anthropic_protocol import MessagesRequest, parse_request, render_prompt, sampling_params
from astrai.serve.common import (
    APIError,
    anthropic_error,
    deltas,
    json_body,
    log_request,
    route,
    sse,
    stream_response,
    submit,
)
from astrai.serve.reasoning import ReasoningParser, new_parsers, sort_events
from astrai.serve.state import ServerState
from astrai.serve.tool_calls import TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from astrai.serve.tool_parsers import new_parser, tool_schemas


class BlockWriter:
    """Parser events -> Anthropic content-block events (dicts with "type").

    A text block opens at the first non-blank text, so blank text right before a tool call is dropped; each
    tool call is one tool_use block whose input streams as `input_json_delta` fragments. An empty reply is one
    empty text block, unless `finish(placeholder=False)`. With `single_call` only the first tool call is kept.
    """

    def __init__(self, single_call: bool = False) -> None:
        self.single_call, self.calls, self.index = single_call, 0, -1
        self.open: str | None = None  # type of the open block
        self.answered = False  # a text or tool_use block was opened (a thinking block does not count)
        self._blank, self._skip = "", set()

    def think(self, text: str) -> list[dict[str, Any]]:
        """Events for reasoning text: a `thinking` block (opened at the first fragment) and its `thinking_delta`."""
        out = [] if self.open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
        delta = {"type": "thinking_delta", "thinking": text}
        return out + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def push(self, event: TextDelta | ToolCallStart | ToolCallArgs | ToolCallEnd) -> list[dict[str, Any]]:
        """Events for one parser event."""
        if isinstance(event, TextDelta):
            return self._text(event.text)
        if isinstance(event, ToolCallStart):
            if self.single_call and self.calls:
                self._skip.add(event.index)
                return []
            self.calls, self._blank = self.calls + 1, ""
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": event.name, "input": {}}
            return self._start(block)
        if event.index in self._skip:
            return []
        if isinstance(event, ToolCallArgs):
            delta = {"type": "input_json_delta", "partial_json": event.text}
            return [{"type": "content_block_delta", "index": self.index, "delta": delta}] if event.text else []
        return self._close()

    def finish(self, placeholder: bool = True) -> list[dict[str, Any]]:
        """Close the last block. An all-blank or empty answer still gets its text block, unless not `placeholder`
        (the answer was a tool call's markup, dropped: no block at all)."""
        out = []
        if not self.answered and placeholder:
            out = self._start({"type": "text", "text": ""}) + (self._delta(self._blank) if self._blank else [])
        self._blank = ""
        return out + self._close()

    def _text(self, text: str) -> list[dict[str, Any]]:
        if self.open == "text":
            return self._delta(text) if text else []
        self._blank += text
        if not self._blank.strip():
            return []
        text, self._blank = self._blank, ""
        return self._start({"type": "text", "text": ""}) + self._delta(text)

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.index, self.open = self.index + 1, block["type"]
        self.answered = self.answered or block["type"] != "thinking"
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, text: str) -> list[dict[str, Any]]:
        return [{"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}}]

    def _close(self) -> list[dict[str, Any]]:
        was, self.open = self.open, None
        return [{"type": "content_block_stop", "index": self.index}] if was else []


def assemble(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `content` list that a sequence of content-block events builds (what the SDKs do client-side)."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for ev in events:
        if ev["type"] == "content_block_start":
            blocks.append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta" and ev["delta"]["type"] == "text_delta":
            blocks[ev["index"]]["text"] += ev["delta"]["text"]
        elif ev["type"] == "content_block_delta" and ev["delta"]["type"] == "thinking_delta":
            blocks[ev["index"]]["thinking"] += ev["delta"]["thinking"]
        elif ev["type"] == "content_block_delta":
            partial[ev["index"]] = partial.get(ev["index"], "") + ev["delta"]["partial_json"]
    for index, text in partial.items():
        blocks[index]["input"] = json.loads(text)
    return blocks


class Generation:
    """One request's deltas -> content-block events, plus the stop reason and token usage."""

    def __init__(self, req: MessagesRequest, parser: str = "hermes", thinker: ReasoningParser | None = None) -> None:
        """`parser`: the server's tool-call format (a forced call is grammar-constrained markup of it); `thinker`:
        the request's reasoning parser (its reasoning becomes a `thinking` block), None: no split."""
        self.stops, self.text, self.output_tokens = req.stop, "", 0
        self.finish: str | None = None
        self.matched: str | None = None
        names = req.tool_names
        forced = self.forced = req.forced is not None
        self.parser = new_parser(parser, names, tool_schemas(req.tools), forced=forced) if names else None
        self.writer = BlockWriter(req.single_call)
        self.thinker = thinker
        self.markup = False  # the parser got non-blank answer text (all of it markup if no block came of it)

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        """Events for one engine delta (the final one also closes the blocks)."""
        self.output_tokens += len(delta.token_ids)
        self.text += delta.text
        text = delta.text
        if delta.finish_reason == "stop" and self.stops:
            # the matched stop arrives whole at the end of the final delta (see the module docstring)
            hits = [s for s in self.stops if self.text.endswith(s)]
            self.matched = max(hits, key=len) if hits else None
            text = text[: len(text) - len(self.matched)] if self.matched else text
        reasoning = ""
        if self.thinker is not None:
            ended = self.thinker.finish() if delta.finish_reason is not None else []
            reasoning, text = sort_events(self.thinker.feed(text) + ended)
        self.markup = self.markup or (self.parser is not None and bool(text.strip()))
        parsed = (self.parser.feed(text) if self.parser else [TextDelta(text)]) if text else []
        if delta.finish_reason is not None:
            self.finish = delta.finish_reason
            parsed += self.parser.finish(delta.finish_reason == "length") if self.parser else []  # cut: no markup
        events = self.writer.think(reasoning) if reasoning else []
        events += [ev for p in parsed for ev in self.writer.push(p)]
        # an answer that was all a dropped call's markup (a forced call cut by max_tokens) is no block, not an empty
        # text block: the content is empty, as OpenAI's reply has neither content nor tool_calls then
        return events + (self.writer.finish(placeholder=not self.markup) if delta.finish_reason is not None else [])

    @property
    def stop_reason(self) -> str:
        """Anthropic's stop_reason for the finished generation."""
        if self.matched is not None:
            return "stop_sequence"
        if self.finish == "length" and not (self.forced and self.writer.calls):  # a cut-short forced call is dropped
            return "max_tokens"
        return "tool_use" if self.writer.calls else "end_turn"


def _error_event(message: str, kind: str = "api_error") -> str:
    return sse({"type": "error", "error": {"type": kind, "message": message}}, "error")


async def _stream(gen: Generation, source: AsyncIterator[Delta], head: dict[str, Any]) -> AsyncIterator[str]:
    yield sse({"type": "message_start", "message": head}, "message_start")
    # a failure here (the 200 is long gone) is logged and reported in-band by common.route's stream guard
    async for delta in source:
        for ev in gen.feed(delta):
            yield sse(ev, ev["type"])
    if gen.finish == "abort":
        yield _error_event("the request was aborted (the server is shutting down)", "overloaded_error")
        return
    delta = {"stop_reason": gen.stop_reason, "stop_sequence": gen.matched}
    yield sse({"type": "message_delta", "delta": delta, "usage": {"output_tokens": gen.output_tokens}}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")


def _check_context(prompt_len: int, max_tokens: int, context: int) -> None:
    """A 400 in Anthropic's wording when the prompt, or the prompt with `max_tokens`, exceeds the context (clients
    such as litellm recognise "prompt is too long" as a context-window error)."""
    if prompt_len >= context:
        raise APIError(400, f"prompt is too long: {prompt_len} tokens > {context - 1} maximum", param="messages")
    if prompt_len + max_tokens > context:
        raise APIError(400, f"input length and `max_tokens` exceed context limit: {prompt_len} + {max_tokens} > "
                            f"{context}, decrease input length or `max_tokens` and try again",
                       param="max_tokens")  # fmt: skip


def routes(state: ServerState) -> list[Route]:
    """The Anthropic routes over a `ServerState`."""

    async def prompt_ids(request: Request, req: MessagesRequest, generate: bool = True) -> list[int]:
        # rendered and tokenized off the loop, stopped once the client left
        return await state.offload(render_prompt, state.tokenizer, req, context=state.context, generate=generate,
                                   request=request,
                                   allow_special_tokens=state.allow_special_tokens_in_content)  # fmt: skip

    async def checked_body(request: Request) -> dict:
        body = await json_body(request)
        state.check_model(body)
        return body

    async def messages(request: Request) -> Response:
        body = await json_body(request)
        lora = state.check_model(body)  # the LoRA adapter `model` names, None: the base model
        req = parse_request(body)
        if req.thinking and state.reasoning_parser is None:
            raise APIError(400, "thinking: this server splits no reasoning off the output; start it with "
                                "--reasoning-parser (qwen3 or deepseek_r1) to return thinking blocks")  # fmt: skip
        ids = await prompt_ids(request, req)
        _check_context(len(ids), req.max_tokens, state.context)
        params = sampling_params(req, state.sampling_defaults, state.tokenizer, state.tool_parser)
        if params.grammar is not None:  # compiled off the event loop; a tool schema it cannot take is a 400
            try:
                await state.offload(state.engine.compile_grammar, params.grammar)
            except ValueError as err:
                raise APIError(400, str(err)) from None
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                "model": state.reply_model(lora)}  # fmt: skip
        if state.log_requests:
            log_request(head["id"], request.url.path, list(req.messages), params)
        handle = submit(state.engine, ids, params, busy_status=529, lora=lora)
        no_text = params.grammar is not None and req.forced is not None  # auto's grammar allows text (and thinking)
        thinkers = new_parsers(state.reasoning_parser, state.tokenizer, ids, constrained=no_text)
        gen = Generation(req, state.tool_parser, thinkers[0] if thinkers else None)
        source = state.metrics.observe(deltas(request, handle), len(ids))
        if req.stream:
            usage = {"input_tokens": len(ids), "output_tokens": 0}
            start = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
            return stream_response(_stream(gen, source, start))
        events = [ev async for delta in source for ev in gen.feed(delta)]
        if handle.completion is None:
            raise APIError(499, "the client closed the request")
        if gen.finish == "abort":
            raise APIError(503, "the request was aborted (the server is shutting down)", type="server_error")
        usage = {"input_tokens": len(ids), "output_tokens": handle.completion.completion_tokens}
        return JSONResponse({**head, "content": assemble(events), "stop_reason": gen.stop_reason,
                             "stop_sequence": gen.matched, "usage": usage})  # fmt: skip

    async def count_tokens(request: Request) -> Response:
        req = parse_request(await checked_body(request), count_only=True)
        return JSONResponse({"input_tokens": len(await prompt_ids(request, req, generate=False))})

    return [Route("/v1/messages", route(anthropic_error, messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", route(anthropic_error, count_tokens), methods=["POST"])]  # fmt: skip

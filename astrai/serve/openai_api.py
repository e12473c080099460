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
chunk with `choices: []` when asked, then `data: [DONE]`. Tool calls are parsed by the server's tool-call parser
(`ServerState.tool_parser`, `astrai.serve.tool_parsers`); a forced call (tool_choice "required" / named) is
grammar-constrained to that format's markup (`tool_grammars`), so it always parses and finishes with
"tool_calls" (when the token budget cuts a further parallel call short, that call is dropped and the reply, its
complete calls, still finishes with "tool_calls"). tool_choice "auto" is constrained to text, or text then
well-formed calls; `parallel_tool_calls: false` is enforced for both.

A completions request with a list of prompts submits one engine request per prompt (all or none: if the queue
fills up midway, the queued ones are aborted and the client gets a 429); choice `index` is `prompt_index * n +
j`, usage sums every prompt's tokens (each prompt counted once), a stream interleaves the prompts' chunks as
they come and ends with one usage chunk and one `[DONE]`; a disconnect aborts them all. With
`ServerState.log_requests` each request's id, route, prompt (its first 200 characters; chat: the messages as
JSON; one line per prompt of a list) and SamplingParams are logged at INFO; otherwise nothing of the prompt.

`echo` with `logprobs` scores the prompts first (`astrai.inference.score.prompt_logprobs` on the worker pool: one
chunked causal forward per prompt, outside the engine's KV pool); each choice's legacy `logprobs` then start with
the prompt's tokens (`null` first; each position's `top_logprobs` hold its alternatives and the prompt token, as
vLLM's do), followed by the generated ones. `max_tokens: 0` with echo only echoes (and scores).

Big replies: before anything is scored or submitted, the reply's size is estimated from n, max_tokens, the
logprob counts, echo and prompt_logprobs (`reply_size`); over the server's
`max_reply_bytes` it is a 400 naming those fields (`common.check_reply_size`). A whole reply is built and
JSON-encoded on the worker pool (`_chat_reply`, `_completion_reply`), as is a stream's chunk with an echoed
prompt's logprobs, so that tens of MB of logprobs never stall the event loop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from astrai.inference.engine import EngineDeadError, RequestFailedError
from astrai.inference.handle import RequestHandle
from astrai.inference.outputs import Completion, Delta
from astrai.inference.params import SamplingParams
from astrai.inference.score import PromptLogprobs, prompt_logprobs
from astrai.io.token_bytes import TokenBytes
from astrai.serve import common, tenancy
from astrai.serve.common import APIError, openai_error, sse
from astrai.serve.openai_protocol import ChatRequest, CompletionRequest, parse_chat, parse_completion
from astrai.serve.reasoning import new_parsers, prompt_start, sort_events, split
from astrai.serve.reply_size import chat_reply_parts, completion_reply_parts
from astrai.serve.sampling_fields import response_id
from astrai.serve.state import ServerState
from astrai.serve.tool_calls import Event, TextDelta, ToolCall, ToolCallArgs, ToolCallStart
from astrai.serve.tool_parsers import new_parser, parse


async def compile_grammar(state: ServerState, params: SamplingParams) -> None:
    """Compile a constrained request's grammar on the worker pool (not the event loop); 400 naming the field."""
    if params.grammar is None:
        return
    try:
        await state.offload(state.engine.compile_grammar, params.grammar)
    except ValueError as err:  # EngineInputError: `param` names the request field
        raise APIError(400, str(err), param=getattr(err, "param", None)) from None


# ---- responses ----------------------------------------------------------------------------------------------
def _usage(completion: Completion) -> dict:
    usage = {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
             "total_tokens": completion.prompt_tokens + completion.completion_tokens}  # fmt: skip
    return _with_cached(usage, completion.cached_tokens)


def _with_cached(usage: dict, cached: int) -> dict:
    """`usage` with `prompt_tokens_details.cached_tokens`, when the server reports it (`tenancy`)."""
    return {**usage, "prompt_tokens_details": {"cached_tokens": cached}} if tenancy.shows_cached_tokens() else usage


def _finish(reason: str | None, has_calls: bool, forced: bool = False) -> str:
    if reason == "abort":  # only on engine shutdown: a client that disconnected reads nothing
        raise APIError(503, "the request was aborted: the server is shutting down", type="server_error")
    # a forced output that the budget cut in a further parallel call: that call was dropped, the reply is complete
    done = reason == "stop" or (forced and reason == "length")
    return "tool_calls" if has_calls and done else reason or "stop"


def _stream_end(head: dict, handle: RequestHandle, include_usage: bool) -> list[str]:
    """A finished stream's last events: the usage chunk (`choices: []`) when asked for, then `[DONE]`."""
    usage = include_usage and handle.completion is not None
    return ([sse({**head, "choices": [], "usage": _usage(handle.completion)})] if usage else []) + [sse("[DONE]")]


def _error_event(err: APIError) -> str:
    # an error after the 200 header went out: the SDKs raise on an `error` object in the stream
    return sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})


async def engine_deltas(state: ServerState, request: Request, handle: RequestHandle, prompt_len: int
                         ) -> AsyncIterator[Delta]:  # fmt: skip
    """The request's deltas, through the metrics, aborted on disconnect; a dead engine is a 503, a request the
    engine ended with an error a 400 naming the failed constraint's field (`common.engine_error`)."""
    async for delta in state.metrics.observe(common.deltas(request, handle), prompt_len):
        yield delta


async def _collect(state: ServerState, request: Request, handle: RequestHandle, prompt_len: int) -> Completion:
    async for _ in engine_deltas(state, request, handle, prompt_len):
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
    texts = TokenBytes(state.tokenizer, as_ids=chat.tokens_as_ids)

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None,
              stop_reason: str | int | None = None) -> str:  # fmt: skip
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                  **_stop_reason(stop_reason, finish is not None)}  # fmt: skip
        return sse({**head, "choices": [choice], **tail})

    parsers = [new_parser(state.tool_parser, chat.tool_names, chat.tool_schemas, forced=chat.forced)
               for _ in range(chat.params.n)]  # fmt: skip
    thinkers = new_parsers(state.reasoning_parser, state.tokenizer, chat.prompt, constrained=no_free_text(chat),
                           n=chat.params.n)  # fmt: skip
    for i in range(chat.params.n):
        yield chunk(i, {"role": "assistant", "content": ""})
        if chat.echo:
            yield chunk(i, {"content": chat.echo})
    try:
        async for d in engine_deltas(state, request, handle, len(chat.prompt)):
            parser, reasoning, text = parsers[d.index], "", d.text
            if thinkers is not None:  # <think> reasoning goes out as reasoning_content; the tool parser reads the rest
                thinker = thinkers[d.index]
                reasoning, text = sort_events(thinker.feed(d.text) + (thinker.finish() if d.finish_reason else []))
            if chat.parse:
                events = parser.feed(text) + (parser.finish(d.finish_reason == "length") if d.finish_reason else [])
            else:
                events = [TextDelta(text)] if text else []
            lp = None
            if chat.params.wants_logprobs and d.token_ids:
                lp = _chat_logprobs(texts, d.token_ids, d.logprobs, d.top_logprobs)
            out = ([{"reasoning_content": reasoning}] if reasoning else []) + _chunk_deltas(events)
            for k, delta in enumerate(out or ([{"content": ""}] if lp else [])):
                yield chunk(d.index, delta, lp if k == 0 else None)  # each token's logprob goes out once
            if d.finish_reason:
                yield chunk(d.index, {}, None, _finish(d.finish_reason, bool(parser.calls), chat.forced), d.stop_reason)
    except APIError as err:
        yield _error_event(err)
        return
    for event in _stream_end(head, handle, chat.include_usage):
        yield event


def _stop_reason(reason: str | int | None, final: bool = True) -> dict:
    """vLLM's `stop_reason` choice field: the stop string that ended the output, the `stop_token_ids` id it
    ended on, null for EOS and every other end; astrai's "budget" says the end of a constrained output was steered
    to fit `max_tokens` (`astrai.inference.closing`). Always in a reply's choices; in a stream, in each choice's
    final chunk only (as vLLM, which leaves unset fields out of its chunks)."""
    return {"stop_reason": reason} if final else {}


def no_free_text(chat: ChatRequest) -> bool:
    """Whether a grammar rules out free text (a schema, a forced call), hence a think block; tool_choice "auto"'s
    grammar allows text."""
    grammar = chat.params.grammar
    return grammar is not None and (chat.forced or grammar.param != "tool_choice")


def _openai_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def _chat_completions(state: ServerState, request: Request) -> Response:
    body = await common.json_body(request)
    lora = state.check_model(body)
    chat = await state.offload(parse_chat, body, state.tokenizer, vocab_size=state.vocab_size, context=state.context,
                               allow_special_tokens=state.allow_special_tokens_in_content,
                               defaults=state.sampling_defaults, tool_parser=state.tool_parser,
                               request=request)  # fmt: skip
    big = common.check_reply_size(state.max_reply_bytes, chat_reply_parts(chat)) > common.BIG_REPLY_BYTES
    await compile_grammar(state, chat.params)
    head = {"id": response_id(body, "chatcmpl"), "created": int(time.time()), "model": state.reply_model(lora)}
    scored = None if chat.prompt_logprobs is None else (await _score(state, [chat.prompt], chat.prompt_logprobs,
                                                                     lora))[0]  # fmt: skip
    if state.log_requests:
        common.log_request(head["id"], request.url.path, body.get("messages"), chat.params)
    handle = common.submit(state.engine, chat.prompt, chat.params, busy_status=429, lora=lora)
    if chat.stream:
        return common.stream_response(_chat_stream(state, request, handle, chat,
                                                   {**head, "object": "chat.completion.chunk"}))  # fmt: skip
    completion = await _collect(state, request, handle, len(chat.prompt))
    # built and encoded on the worker pool: logprobs of n long choices are tens of MB of JSON (seconds of CPU)
    reply = await state.offload(_chat_reply, state, chat, head, completion, scored, big, request=request)
    return Response(reply, media_type="application/json")


def _chat_reply(state: ServerState, chat: ChatRequest, head: dict, completion: Completion,
                scored: PromptLogprobs | None, big: bool) -> bytes:  # fmt: skip
    """A finished chat request's whole reply, JSON-encoded (run on the worker pool: it may be big)."""
    texts, choices = TokenBytes(state.tokenizer, as_ids=chat.tokens_as_ids), []
    start = prompt_start(state.tokenizer, chat.prompt, constrained=no_free_text(chat))
    for out in completion.outputs:
        answer, reasoning = out.text, None
        if state.reasoning_parser is not None:
            reasoning, answer = split(state.reasoning_parser, out.text, start)
        text, calls = (parse(state.tool_parser, answer, chat.tool_names, chat.tool_schemas, forced=chat.forced,
                             cut=out.finish_reason == "length") if chat.parse else (answer, []))  # fmt: skip
        text = chat.echo + text
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if state.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [_openai_call(c) for c in calls]
        lp = None
        if chat.params.wants_logprobs:
            lp = _chat_logprobs(texts, out.token_ids, out.logprobs, out.top_logprobs)
        reason = _finish(out.finish_reason, bool(calls), chat.forced)
        choices.append({"index": out.index, "message": message, "logprobs": lp, "finish_reason": reason,
                        **_stop_reason(out.stop_reason)})  # fmt: skip
    reply = {**head, "object": "chat.completion", "choices": choices, "usage": _usage(completion)}
    if scored is not None:
        reply["prompt_logprobs"] = _vllm_prompt_logprobs(texts, scored, chat.prompt_logprobs)
    return common.json_bytes(reply, big=big)


# ---- legacy completions -------------------------------------------------------------------------------------
def _legacy_logprobs(texts: TokenBytes, ids: Any, lps: Any, tops: Any, offset: int) -> dict:
    tokens = [texts.text(t) for t in ids]
    offsets = [offset + sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    top = [{texts.text(a): max(b, -9999.0) for a, b in alts} for alts in tops] if tops else None
    return {"tokens": tokens, "token_logprobs": [max(x, -9999.0) for x in lps or ()], "top_logprobs": top,
            "text_offset": offsets}  # fmt: skip


def _prompt_part(texts: TokenBytes, scores: PromptLogprobs, top: int) -> dict:
    """The echoed prompt's entries of the legacy logprobs: null first, and, as vLLM does, each position's `top`
    alternatives together with the prompt's own token (so lm-eval can tell whether the prompt was greedy)."""
    tokens = [texts.text(t) for t in scores.token_ids]
    tops: list[dict | None] = [None]
    for token, logprob, alts in zip(scores.token_ids[1:], scores.logprobs[1:], scores.top_logprobs[1:], strict=True):
        tops.append({texts.text(a): max(b, -9999.0) for a, b in ((token, logprob), *alts[:top])})
    return {
        "tokens": tokens,
        "token_logprobs": [None if x is None else max(x, -9999.0) for x in scores.logprobs],
        "top_logprobs": tops,
        "text_offset": [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))],
    }


def _vllm_prompt_logprobs(texts: TokenBytes, scores: PromptLogprobs, top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` (chat: beside `choices`; completions: in each choice): null for the first token,
    then per position {token id: {logprob, rank, decoded_token}} of the prompt's own token and the `top` most
    likely ones (rank 1 = the most likely; the prompt's token holds its vocabulary rank)."""
    out: list[dict | None] = [None]
    for token, logprob, rank, alts in zip(scores.token_ids[1:], scores.logprobs[1:], scores.ranks[1:],
                                          scores.top_logprobs[1:], strict=True):  # fmt: skip
        entry = {str(token): {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": texts.text(token)}}
        for place, (alt, alt_logprob) in enumerate(alts[:top], 1):
            entry.setdefault(str(alt), {"logprob": max(alt_logprob, -9999.0), "rank": place,
                                        "decoded_token": texts.text(alt)})  # fmt: skip
        out.append(entry)
    return out


def _with_prompt(prompt: dict | None, generated: dict | None, echo: str) -> dict | None:
    """The prompt's logprobs followed by the generated tokens' (None when neither exists). The generated tokens'
    `text_offset`s, counted from the end of the `echo` text, move to the end of the prompt's token texts, so the
    offsets of one choice always increase (a prompt given as ids decodes to text of another length)."""
    if prompt is None or generated is None:
        return prompt or generated
    end = sum(len(t) for t in prompt["tokens"])
    generated = {**generated, "text_offset": [o - len(echo) + end for o in generated["text_offset"]]}
    return {key: prompt[key] + (generated[key] or [{} for _ in generated["tokens"]]) for key in prompt}


def _summed_usage(completions: list[Completion], prompt_tokens: int = 0) -> dict:
    """Usage over a list of prompts' completions: each prompt counted once, every completion's tokens
    (`prompt_tokens`: those of prompts that were only echoed, never generated from)."""
    prompt = prompt_tokens + sum(c.prompt_tokens for c in completions)
    generated = sum(c.completion_tokens for c in completions)
    usage = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    return _with_cached(usage, sum(c.cached_tokens for c in completions))


async def _score(state: ServerState, prompts: list[list[int]], top: int, lora: str | None
                 ) -> list[PromptLogprobs]:  # fmt: skip
    """Each prompt's token logprobs with `top` alternatives: a causal forward per prompt on the worker pool,
    chunked over the vocabulary (`astrai.inference.score`), under the request's adapter when it names one."""

    def score() -> list[PromptLogprobs]:
        with state.engine.lora_model(lora) as model:
            return prompt_logprobs(model, prompts, top=top)

    return await state.offload(score)


async def _score_prompts(state: ServerState, req: CompletionRequest, lora: str | None
                         ) -> list[PromptLogprobs] | None:  # fmt: skip
    """Each prompt's scores when the request echoes them with logprobs or asks for vLLM's `prompt_logprobs`
    (with the larger of the two counts of alternatives); None otherwise."""
    if not req.prompt_logprobs and req.prompt_top is None:
        return None
    top = max(req.logprobs or 0 if req.prompt_logprobs else 0, req.prompt_top or 0)
    return await _score(state, [p.ids for p in req.prompts], top, lora)


def _vllm_prompt_part(texts: TokenBytes, scores: list[PromptLogprobs] | None, k: int, req: CompletionRequest
                      ) -> dict:  # fmt: skip
    """A completions choice's `prompt_logprobs` entry (prompt `k`'s), when the request asked for it."""
    if scores is None or req.prompt_top is None:
        return {}
    return {"prompt_logprobs": _vllm_prompt_logprobs(texts, scores[k], req.prompt_top)}


def _echo_only(state: ServerState, req: CompletionRequest, scores: list[PromptLogprobs] | None) -> list[dict]:
    """Choices of a `max_tokens: 0` request: each prompt echoed n times (with its logprobs), nothing generated."""
    texts = TokenBytes(state.tokenizer, as_ids=req.tokens_as_ids)
    choices = []
    for k, prompt in enumerate(req.prompts):
        lp = _prompt_part(texts, scores[k], req.logprobs) if scores and req.prompt_logprobs else None
        extra = _vllm_prompt_part(texts, scores, k, req)
        choices += [{"index": k * req.n + j, "text": prompt.echo, "logprobs": lp, "finish_reason": "length",
                     "stop_reason": None, **extra} for j in range(req.n)]  # fmt: skip
    return choices


async def _completion_deltas(state: ServerState, request: Request, handles: list[RequestHandle],
                             req: CompletionRequest) -> AsyncIterator[tuple[int, Delta]]:  # fmt: skip
    """(prompt index, delta) of every prompt's request as they come, through the metrics; all are aborted on
    disconnect; a dead engine is a 503, a request the engine ended with an error a 400 (`common.engine_error`)."""
    sources = [state.metrics.observe(aiter(h), len(p.ids)) for h, p in zip(handles, req.prompts, strict=True)]
    try:
        async for k, delta in common.merged_deltas(request, handles, sources):
            yield k, delta
    except (EngineDeadError, RequestFailedError) as err:
        raise common.engine_error(err) from None


async def _completions(state: ServerState, request: Request) -> Response:
    body = await common.json_body(request)
    lora = state.check_model(body)
    req = await state.offload(parse_completion, body, state.tokenizer, vocab_size=state.vocab_size, request=request,
                              context=state.context, defaults=state.sampling_defaults,
                              max_sequences=state.max_waiting)  # fmt: skip
    big = common.check_reply_size(state.max_reply_bytes, completion_reply_parts(req)) > common.BIG_REPLY_BYTES
    if req.prompts:
        await compile_grammar(state, req.prompts[0].params)  # every prompt has the same grammar
    head = {"id": response_id(body, "cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": state.reply_model(lora)}  # fmt: skip
    if state.log_requests:
        several = len(req.prompts) > 1  # then body["prompt"] is the list of them
        for k, (prompt, p) in enumerate(zip(body["prompt"] if several else [body["prompt"]], req.prompts, strict=True)):
            common.log_request(head["id"] + (f"[{k}]" if several else ""), request.url.path, prompt, p.params)
    scores = await _score_prompts(state, req, lora)
    if not req.generate:
        choices = await state.offload(_echo_only, state, req, scores)  # the echoed logprobs may be big
        usage = _summed_usage([], sum(len(p.ids) for p in req.prompts))
        if req.stream:
            return common.stream_response(_echo_stream(state, head, choices, usage if req.include_usage else None))
        reply = await state.offload(common.json_bytes, {**head, "choices": choices, "usage": usage}, big=big)
        return Response(reply, media_type="application/json")
    handles = common.submit_all(state.engine, [(p.ids, p.params) for p in req.prompts], busy_status=429, lora=lora)
    if req.stream:
        return common.stream_response(_completion_stream(state, request, handles, req, head, scores))
    async for _ in _completion_deltas(state, request, handles, req):
        pass
    if any(h.completion is None for h in handles):
        raise APIError(499, "the client closed the request")
    # built and encoded on the worker pool: echoed and generated logprobs of a list of prompts are tens of MB
    reply = await state.offload(_completion_reply, state, req, head, handles, scores, big, request=request)
    return Response(reply, media_type="application/json")


def _completion_reply(state: ServerState, req: CompletionRequest, head: dict, handles: list[RequestHandle],
                      scores: list[PromptLogprobs] | None, big: bool) -> bytes:  # fmt: skip
    """A finished completions request's whole reply, JSON-encoded (run on the worker pool: it may be big)."""
    texts, choices = TokenBytes(state.tokenizer, as_ids=req.tokens_as_ids), []
    for k, (h, prompt) in enumerate(zip(handles, req.prompts, strict=True)):
        for o in h.completion.outputs:
            lp = None
            if req.logprobs is not None:
                lp = _legacy_logprobs(texts, o.token_ids, o.logprobs, o.top_logprobs, len(prompt.echo))
                echoed = _prompt_part(texts, scores[k], req.logprobs) if scores and req.prompt_logprobs else None
                lp = _with_prompt(echoed, lp, prompt.echo)
            reason = _finish(o.finish_reason, False)
            choices.append({"index": k * req.n + o.index, "text": prompt.echo + o.text, "logprobs": lp,
                            "finish_reason": reason, **_stop_reason(o.stop_reason),
                            **_vllm_prompt_part(texts, scores, k, req)})  # fmt: skip
    usage = _summed_usage([h.completion for h in handles])
    return common.json_bytes({**head, "choices": choices, "usage": usage}, big=big)


async def _echo_stream(state: ServerState, head: dict, choices: list[dict], usage: dict | None
                       ) -> AsyncIterator[str]:  # fmt: skip
    """A `max_tokens: 0` request as a stream: one chunk per choice (encoded on the worker pool: a choice holds its
    prompt's logprobs), the usage chunk when asked, `[DONE]`."""
    tail = {"usage": None} if usage is not None else {}
    for choice in choices:
        yield await state.offload(common.sse_big, {**head, "choices": [choice], **tail})
    if usage is not None:
        yield sse({**head, "choices": [], "usage": usage})
    yield sse("[DONE]")


async def _completion_stream(state: ServerState, request: Request, handles: list[RequestHandle],
                             req: CompletionRequest, head: dict, scores: list[PromptLogprobs] | None
                             ) -> AsyncIterator[str]:  # fmt: skip
    tail, texts = {"usage": None} if req.include_usage else {}, TokenBytes(state.tokenizer, as_ids=req.tokens_as_ids)
    offsets: dict[int, int] = {}  # per choice: characters sent so far (legacy text_offset)
    try:
        async for k, d in _completion_deltas(state, request, handles, req):
            index = k * req.n + d.index
            first = index not in offsets
            piece = (req.prompts[k].echo if first else "") + d.text
            offset = offsets.get(index, 0) + len(piece) - len(d.text)
            lp = None
            if d.logprobs is not None and d.token_ids:
                lp = _legacy_logprobs(texts, d.token_ids, d.logprobs, d.top_logprobs, offset)
            if first and scores:  # the echoed prompt's logprobs go with its text, in the choice's first chunk
                prompt_part = await state.offload(_prompt_part, texts, scores[k], req.logprobs)  # maybe MBs
                lp = _with_prompt(prompt_part, lp, req.prompts[k].echo)
                offset = sum(len(t) for t in prompt_part["tokens"])  # later offsets count from the prompt's tokens
            offsets[index] = offset + len(d.text)
            finish = _finish(d.finish_reason, False) if d.finish_reason else None
            choice = {"index": index, "text": piece, "logprobs": lp, "finish_reason": finish,
                      **_stop_reason(d.stop_reason, finish is not None)}  # fmt: skip
            chunk = {**head, "choices": [choice], **tail}
            yield await state.offload(common.sse_big, chunk) if first and scores else sse(chunk)
    except APIError as err:
        yield _error_event(err)
        return
    if req.include_usage and all(h.completion is not None for h in handles):
        yield sse({**head, "choices": [], "usage": _summed_usage([h.completion for h in handles])})
    yield sse("[DONE]")


def routes(state: ServerState) -> list[Route]:
    """The OpenAI routes over `state`: errors in OpenAI's shape, busy -> 429."""

    def bind(handler: Any) -> Any:
        async def call(request: Request) -> Response:
            return await handler(state, request)

        return common.route(openai_error, call)

    return [Route("/v1/chat/completions", bind(_chat_completions), methods=["POST"]),
            Route("/v1/completions", bind(_completions), methods=["POST"])]  # fmt: skip

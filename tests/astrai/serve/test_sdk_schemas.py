"""Every reply and stream event of the OpenAI and Anthropic routes validates against the official SDKs' own types.

The SDK clients build their response objects without validation (`construct`), so a test that reads replies through
`client.chat.completions.create(...)` stays green when the server omits a required field or writes a value outside
the API's literal set: the attribute is simply missing or holds the wrong string, and only a test that names that
field notices. Here the raw JSON of each route (whole and streamed, text, tool calls, logprobs, reasoning, a length
cut) goes through the SDKs' pydantic models with validation (`model_validate` / a `TypeAdapter` over the stream
event union), so the reference for field names, required fields and literal values is the SDK, not this repo's
code or a string written in this test.

Negative controls: the same validators reject a reply with a field dropped or a literal changed.
"""

from __future__ import annotations

import json

import anthropic.types as at
import httpx
import openai.types as ot
import openai.types.chat as oc
import pydantic
import pytest

HEADERS = {"Authorization": "Bearer test-key", "x-api-key": "test-key", "anthropic-version": "2023-06-01"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
ANT_TOOLS = [{"name": "get_weather", "description": "Current weather", "input_schema": SCHEMA}]
THOUGHT = "<think>\nThe user adds 2 and 2.\n</think>\n\nThe answer is 4."
MSGS = [{"role": "user", "content": "What is 2+2?"}]
STREAM_EVENT = pydantic.TypeAdapter(at.RawMessageStreamEvent)


def _post(server, path, body):
    r = httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _sse(text):
    """The `data:` payloads of an SSE body, `[DONE]` dropped; `event:` lines (Anthropic) are checked elsewhere."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture
def reasoning(server, monkeypatch):
    monkeypatch.setattr(server.app.state, "reasoning_parser", "qwen3")
    return server


CHAT_CASES = {
    "text": ("hello world", {}),
    "logprobs": ("hello world", {"logprobs": True, "top_logprobs": 2}),
    "tool_call": (CALL, {"tools": OAI_TOOLS, "max_tokens": 512}),
    "length": ("one two three four five six", {"max_tokens": 2}),
}


@pytest.mark.parametrize("case", CHAT_CASES)
def test_chat_completion_and_chunks_validate_against_openai_types(server, case):
    said, extra = CHAT_CASES[case]
    server.script(said)
    body = {"model": "tiny-test", "messages": MSGS, "max_tokens": 64, **extra}
    whole = oc.ChatCompletion.model_validate(_post(server, "/v1/chat/completions", body).json())
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    raw = _sse(_post(server, "/v1/chat/completions", stream).text)
    chunks = [oc.ChatCompletionChunk.model_validate(c) for c in raw]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    if case == "tool_call":
        assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.tool_calls
    if case == "logprobs":
        assert whole.choices[0].logprobs.content[0].top_logprobs


def test_chat_with_reasoning_validates(reasoning):
    reasoning.script(THOUGHT)
    body = {"model": "tiny-test", "messages": MSGS, "max_tokens": 64}
    reply = oc.ChatCompletion.model_validate(_post(reasoning, "/v1/chat/completions", body).json())
    assert reply.choices[0].message.content == "The answer is 4."
    for chunk in _sse(_post(reasoning, "/v1/chat/completions", {**body, "stream": True}).text):
        oc.ChatCompletionChunk.model_validate(chunk)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}], ids=["plain", "logprobs"])
def test_completions_validate_against_openai_types(server, extra):
    """The SDK types a streamed legacy completion chunk as a whole `Completion`, whose `finish_reason` is not
    nullable, while the API sends null before the last chunk: chunks with null are validated with it filled in.
    (`echo` with logprobs is left out for the same reason: the API's first prompt token has a null logprob, which
    the SDK's `List[float]` does not admit.)"""
    server.script("hello world")
    body = {"model": "tiny-test", "prompt": "Say hi", "max_tokens": 8, **extra}
    whole = ot.Completion.model_validate(_post(server, "/v1/completions", body).json())
    assert whole.choices[0].finish_reason == "stop"
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _sse(_post(server, "/v1/completions", stream).text)
    for chunk in chunks:
        choices = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
        ot.Completion.model_validate({**chunk, "choices": choices})
    assert [c["finish_reason"] for k in chunks for c in k["choices"] if c["finish_reason"]] == ["stop"]


MESSAGE_CASES = {
    "text": ("hello world", {}),
    "tool_use": (CALL, {"tools": ANT_TOOLS, "max_tokens": 512}),
    "max_tokens": ("one two three four five six", {"max_tokens": 2}),
    "stop_sequence": ("one two three", {"stop_sequences": ["two"]}),
}


def _check_messages(server, body):
    reply = at.Message.model_validate(_post(server, "/v1/messages", body).json())
    raw = _sse(_post(server, "/v1/messages", {**body, "stream": True}).text)
    events = [STREAM_EVENT.validate_python(e) for e in raw]
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    delta = next(e for e in events if e.type == "message_delta")
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == (reply.stop_reason, reply.stop_sequence)
    return reply


@pytest.mark.parametrize("case", MESSAGE_CASES)
def test_messages_and_stream_events_validate_against_anthropic_types(server, case):
    said, extra = MESSAGE_CASES[case]
    server.script(said)
    reply = _check_messages(server, {"model": "tiny-test", "max_tokens": 64, "messages": MSGS, **extra})
    assert reply.stop_reason == {"tool_use": "tool_use", "max_tokens": "max_tokens"}.get(
        case, "stop_sequence" if case == "stop_sequence" else "end_turn"
    )


def test_thinking_blocks_validate_against_anthropic_types(reasoning):
    reasoning.script(THOUGHT)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    reply = _check_messages(
        reasoning, {"model": "tiny-test", "max_tokens": 1500, "messages": MSGS, "thinking": thinking}
    )
    assert [type(b) for b in reply.content] == [at.ThinkingBlock, at.TextBlock]


def test_count_tokens_validates(server):
    body = {"model": "tiny-test", "messages": MSGS}
    at.MessageTokensCount.model_validate(_post(server, "/v1/messages/count_tokens", body).json())


def test_the_validators_reject_a_dropped_field_or_a_changed_literal():
    """Negative control: what the tests above rely on the SDK types to catch, they do catch."""
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "tiny-test", "stop_reason": "end_turn",
               "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1},
               "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}  # fmt: skip
    at.Message.model_validate(message)
    unsigned = [{"type": "thinking", "thinking": "x"}]
    for broken in ({**message, "stop_reason": "end-turn"}, {**message, "content": unsigned}):
        with pytest.raises(pydantic.ValidationError):
            at.Message.model_validate(broken)
    with pytest.raises(pydantic.ValidationError):
        STREAM_EVENT.validate_python({"type": "message_delta", "delta": {"stop_reason": "end_turn"}})  # no usage
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny-test",
        "choices": [],
        "usage": usage,
    }
    oc.ChatCompletionChunk.model_validate(chunk)
    for broken in ({**chunk, "object": "chat.completion"}, {**chunk, "usage": {"prompt_tokens": 3}}):
        with pytest.raises(pydantic.ValidationError):
            oc.ChatCompletionChunk.model_validate(broken)

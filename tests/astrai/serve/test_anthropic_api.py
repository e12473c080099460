"""The Anthropic Messages API through the official `anthropic` SDK and raw HTTP, against the live test server.

The model's text is scripted (`server.script`), so replies are known exactly; what the engine was asked to do
(prompt ids, sampling params) is recorded by wrapping `engine.submit`, and prompts are compared with the chat
template rendering the equivalent OpenAI-style conversation.
"""

import json
import re
import time
from types import SimpleNamespace

import anthropic
import httpx
import pytest

from astrai.inference.engine import EngineBusyError

HEADERS = {"x-api-key": "test-key", "anthropic-version": "2023-06-01"}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_FN = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def client(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="test-key", max_retries=0, timeout=60) as sdk:
        yield sdk


@pytest.fixture
def submitted(server, monkeypatch):
    """Every request the engine receives during the test: prompt ids and SamplingParams."""
    seen, real = [], server.engine.submit

    def record(prompt, params=None, **kwargs):
        seen.append(SimpleNamespace(ids=list(prompt), params=params))
        return real(prompt, params, **kwargs)

    monkeypatch.setattr(server.engine, "submit", record)
    return seen


def user(text):
    return [{"role": "user", "content": text}]


def rendered(server, messages, tools=None, suffix=""):
    """Token ids the chat template gives an OpenAI-style conversation (plus a pre-filled assistant suffix)."""
    text = server.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) + suffix
    return server.tokenizer.encode(text, add_special_tokens=False)


def post(server, body, headers=HEADERS, **kwargs):
    return httpx.post(f"{server.base_url}/v1/messages", json=body, headers=headers, timeout=60, **kwargs)


def sse_events(body):
    """(event, data) pairs; asserts the framing: `event:` + `data:` lines, each event ended by a blank line."""
    assert body.endswith("\n\n") and "[DONE]" not in body
    out = []
    for chunk in body[:-2].split("\n\n"):
        lines = chunk.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
        name, data = lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))
        assert data["type"] == name
        out.append((name, data))
    return out


def test_text_reply_ids_usage_and_prompt(server, client, submitted):
    server.script("hello world")
    reply = client.messages.create(model="tiny-test", max_tokens=32, messages=user("hi there"))
    assert re.fullmatch(r"msg_[0-9a-f]{24}", reply.id) and reply.type == "message" and reply.role == "assistant"
    assert reply.model == "tiny-test"  # the served name
    assert [(b.type, b.text) for b in reply.content] == [("text", "hello world")]
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    expected_prompt = rendered(server, user("hi there"))
    assert submitted[0].ids == expected_prompt
    assert reply.usage.input_tokens == len(expected_prompt)
    assert reply.usage.output_tokens == len(server.tokenizer.encode("hello world", add_special_tokens=False)) + 1
    assert submitted[0].params.temperature == 1.0  # Anthropic's default
    metrics = httpx.get(f"{server.base_url}/metrics", headers=HEADERS).text
    assert 'astrai_requests_total{endpoint="/v1/messages",status="200"}' in metrics


def test_system_as_string_and_blocks(server, client, submitted):
    server.script("ok")
    client.messages.create(model="tiny-test", max_tokens=8, system="Be brief.", messages=user("hi"))
    blocks = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    client.messages.create(model="tiny-test", max_tokens=8, system=blocks, messages=user("hi"))
    assert submitted[0].ids == rendered(server, [{"role": "system", "content": "Be brief."}, *user("hi")])
    assert submitted[1].ids == rendered(server, [{"role": "system", "content": "Be\nbrief."}, *user("hi")])


def test_sampling_fields_via_extra_body(server, client, submitted):
    server.script("ok")
    client.messages.create(model="tiny-test", max_tokens=8, messages=user("hi"), metadata={"user_id": "u1"},
                           extra_body={"temperature": 0.0, "top_k": 5, "top_p": 0.9, "seed": 7})  # fmt: skip
    params = submitted[0].params
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens, params.seed) == (0.0, 5, 0.9, 8, 7)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_report_the_match(server, client, stream):
    server.script("one two three four")
    # "hree" and "three" end at the same character: the engine's match is the longer one, and the text is cut
    # before it
    kwargs = dict(model="tiny-test", max_tokens=32, messages=user("count"), stop_sequences=["zzz", "hree", "three"])
    if stream:
        with client.messages.stream(**kwargs) as s:
            text = "".join(s.text_stream)
            reply = s.get_final_message()
        assert text == "one two "
    else:
        reply = client.messages.create(**kwargs)
    assert reply.content[0].text == "one two "
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "three"


def test_max_tokens_reason(server, client):
    script = "the quick brown fox jumps over the lazy dog"
    server.script(script)
    reply = client.messages.create(model="tiny-test", max_tokens=3, messages=user("go"))
    ids = server.tokenizer.encode(script, add_special_tokens=False)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3
    assert reply.content[0].text == server.tokenizer.decode(ids[:3])


def test_stream_matches_non_stream(server, client):
    server.script("the quick brown fox")
    kwargs = dict(model="tiny-test", max_tokens=32, messages=user("tell me"))
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == "the quick brown fox"
    skip = {"id"}
    assert final.model_dump(exclude=skip) == plain.model_dump(exclude=skip)


def test_assistant_prefill_is_continued_not_repeated(server, client, submitted):
    server.script(" 42.")
    messages = [*user("what is the answer?"), {"role": "assistant", "content": "The answer is"}]
    reply = client.messages.create(model="tiny-test", max_tokens=16, messages=messages)
    assert reply.content[0].text == " 42."
    assert submitted[0].ids == rendered(server, user("what is the answer?"), suffix="The answer is")


def test_count_tokens(server, client):
    counted = client.messages.count_tokens(model="tiny-test", messages=user("hello"), system="sys")
    assert counted.input_tokens == len(rendered(server, [{"role": "system", "content": "sys"}, *user("hello")]))


def test_sse_framing_and_event_order(server):
    server.script("hello world")
    response = post(server, {"model": "tiny-test", "max_tokens": 16, "messages": user("hi"), "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    names = " ".join(name for name, _ in events)
    assert re.fullmatch(r"message_start (content_block_start (content_block_delta )+content_block_stop )+"
                        r"message_delta message_stop", names), names  # fmt: skip
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "hello world"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(server.tokenizer.encode("hello world", add_special_tokens=False)) + 1


# ---- tools ------------------------------------------------------------------------------------------------------
def test_tool_use_non_stream(server, client, submitted):
    server.script("Let me check.\n" + CALL)
    reply = client.messages.create(
        model="tiny-test", max_tokens=128, messages=user("weather in Paris?"), tools=[WEATHER]
    )
    assert submitted[0].ids == rendered(server, user("weather in Paris?"), tools=[WEATHER_FN])
    assert reply.stop_reason == "tool_use"
    assert [b.type for b in reply.content] == ["text", "tool_use"] and reply.content[0].text == "Let me check."
    call = reply.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", call.id)


def test_tool_use_stream_fragments_are_json(server, client):
    server.script(CALL)
    body = {"model": "tiny-test", "max_tokens": 128, "messages": user("weather?"), "tools": [WEATHER], "stream": True}
    events = sse_events(post(server, body).text)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"] and starts[0]["input"] == {}  # no blank text block
    fragments = [d["delta"]["partial_json"] for n, d in events
                 if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]  # fmt: skip
    assert json.loads("".join(fragments)) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(model="tiny-test", max_tokens=128, messages=user("weather?"), tools=[WEATHER]) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    assert final.stop_reason == "tool_use"


def test_tool_result_round_trip_reaches_the_prompt(server, client, submitted):
    server.script(CALL)
    first = client.messages.create(model="tiny-test", max_tokens=128, messages=user("weather?"), tools=[WEATHER])
    call = first.content[0]
    server.script("It is sunny.")
    messages = [*user("weather?"), {"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": [{"type": "text", "text": "22 C, sunny"}]}]}]  # fmt: skip
    second = client.messages.create(model="tiny-test", max_tokens=32, messages=messages, tools=[WEATHER])
    assert second.content[0].text == "It is sunny." and second.stop_reason == "end_turn"
    expected = [*user("weather?"),
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]  # fmt: skip
    assert submitted[1].ids == rendered(server, expected, tools=[WEATHER_FN])
    prompt = server.tokenizer.decode(submitted[1].ids, skip_special_tokens=False)
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt


@pytest.mark.parametrize(
    "choice, script, expect",
    [
        ({"type": "any"}, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
         {"city": "Oslo"}),
        ({"type": "tool", "name": "get_weather"},
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', {"city": "Rome"}),
    ],
)  # fmt: skip
def test_tool_choice_forces_a_call(server, client, submitted, choice, script, expect):
    # no pre-fill: the call is forced by a grammar (tests/astrai/serve/test_tool_choice_grammar.py)
    server.script(script)
    reply = client.messages.create(model="tiny-test", max_tokens=256, messages=user("weather?"), tools=[WEATHER],
                                   tool_choice=choice)  # fmt: skip
    assert submitted[0].ids == rendered(server, user("weather?"), tools=[WEATHER_FN])
    assert submitted[0].params.grammar is not None and submitted[0].params.grammar.param == "tool_choice"
    assert [(b.type, b.name, b.input) for b in reply.content] == [("tool_use", "get_weather", expect)]
    assert reply.stop_reason == "tool_use"


def test_tool_choice_none_renders_no_tools_and_parses_nothing(server, client, submitted):
    server.script(CALL)
    reply = client.messages.create(model="tiny-test", max_tokens=128, messages=user("weather?"), tools=[WEATHER],
                                   tool_choice={"type": "none"})  # fmt: skip
    assert submitted[0].ids == rendered(server, user("weather?"))
    assert [(b.type, b.text) for b in reply.content] == [("text", CALL)] and reply.stop_reason == "end_turn"


@pytest.mark.parametrize("single", [False, True])
def test_parallel_calls_and_disable_parallel_tool_use(server, client, single):
    server.script(CALL + "\n" + CALL.replace("Paris", "Lyon"))
    choice = {"type": "auto", "disable_parallel_tool_use": single}
    reply = client.messages.create(model="tiny-test", max_tokens=200, messages=user("weather?"), tools=[WEATHER],
                                   tool_choice=choice)  # fmt: skip
    cities = [b.input["city"] for b in reply.content if b.type == "tool_use"]
    assert cities == (["Paris"] if single else ["Paris", "Lyon"]) and reply.stop_reason == "tool_use"
    assert len({b.id for b in reply.content}) == len(reply.content)


def test_tool_result_error_flag_reaches_the_prompt(server, client, submitted):
    server.script("sorry")
    messages = [*user("weather?"),
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom",
                                              "is_error": True}, {"type": "text", "text": "try again?"}]}]  # fmt: skip
    client.messages.create(model="tiny-test", max_tokens=8, messages=messages)
    prompt = server.tokenizer.decode(submitted[0].ids, skip_special_tokens=False)
    assert "<tool_response>\nError: boom\n</tool_response><|im_end|>\n<|im_start|>user\ntry again?<|im_end|>" in prompt


# ---- errors and cancellation ------------------------------------------------------------------------------------
GOOD = {"model": "tiny-test", "max_tokens": 8, "messages": user("hi")}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
BAD = {
    "missing max_tokens": ({k: v for k, v in GOOD.items() if k != "max_tokens"}, 400, "max_tokens"),
    "max_tokens as string": ({**GOOD, "max_tokens": "8"}, 400, "max_tokens"),
    "max_tokens zero": ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    "seed as string": ({**GOOD, "seed": "7"}, 400, "seed"),
    "seed over 64 bits": ({**GOOD, "seed": 1 << 64}, 400, "seed"),
    "messages not a list": ({**GOOD, "messages": "hi"}, 400, "messages"),
    "empty messages": ({**GOOD, "messages": []}, 400, "messages"),
    "unknown role": ({**GOOD, "messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    "first message from assistant": ({**GOOD, "messages": [{"role": "assistant", "content": "x"}]}, 400, "role"),
    "temperature above 1": ({**GOOD, "temperature": 1.5}, 400, "temperature"),
    "stream not a bool": ({**GOOD, "stream": "yes"}, 400, "stream"),
    "unknown field": ({**GOOD, "frequency_penalty": 1}, 400, "frequency_penalty"),
    "image block": ({**GOOD, "messages": [{"role": "user", "content": [IMAGE]}]}, 400, "image"),
    "tool schema not an object": ({**GOOD, "tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, 400,
                                  "input_schema"),
    "tool name pattern": ({**GOOD, "tools": [{**WEATHER, "name": "get weather!"}]}, 400, "tools.0.name"),
    "tool_choice unknown tool": ({**GOOD, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
                                 "nope"),
    "tool_result without tool_use": ({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, 400, "toolu_x"),
    "tool_use left unanswered": ({**GOOD, "messages": [*user("a"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_y", "name": "get_weather", "input": {}}]}, *user("b")]}, 400, "toolu_y"),
    "missing content": ({**GOOD, "messages": [{"role": "user"}]}, 400, "messages.0.content"),
    "empty content list": ({**GOOD, "messages": [{"role": "user", "content": []}]}, 400, "non-empty"),
    "prefill ends in whitespace": ({**GOOD, "messages": [*user("a"), {"role": "assistant", "content": "b "}]}, 400,
                                   "trailing whitespace"),
    "empty stop sequence": ({**GOOD, "stop_sequences": [""]}, 400, "stop_sequences.0"),
    "top_p zero": ({**GOOD, "top_p": 0}, 400, "top_p"),
    "tool_choice any without tools": ({**GOOD, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    "server tool": ({**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools.0.type"),
    "thinking enabled": ({**GOOD, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
}  # fmt: skip


def assert_error_shape(response, status, kind):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_4xx_in_anthropic_shape(server, case):
    body, status, needle = BAD[case]
    message = assert_error_shape(post(server, body), status, "invalid_request_error")
    assert needle in message
    assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"


def test_malformed_json_wrong_key_and_too_long_prompt(server, client):
    raw = httpx.post(f"{server.base_url}/v1/messages", content=b'{"model": "tiny-test", "max_tokens": ',
                     headers={**HEADERS, "content-type": "application/json"})  # fmt: skip
    assert "JSON" in assert_error_shape(raw, 400, "invalid_request_error")
    assert_error_shape(post(server, GOOD, headers={"x-api-key": "wrong"}), 401, "authentication_error")
    long = user("hello world " * server.engine.max_model_len)
    prompt_len = len(rendered(server, long))
    message = assert_error_shape(post(server, {**GOOD, "messages": long}), 400, "invalid_request_error")
    engine = server.engine
    context = min(engine.max_model_len, (engine.pool.num_pages - 1) * engine.config.page_size)
    assert message == f"prompt is too long: {prompt_len} tokens > {context - 1} maximum"  # Anthropic's wording
    short = user("hello")  # fits, but not with this max_tokens
    message = assert_error_shape(post(server, {**GOOD, "messages": short, "max_tokens": context}), 400,
                                 "invalid_request_error")  # fmt: skip
    assert message.startswith("input length and `max_tokens` exceed context limit: ")
    assert f" + {context} > {context}," in message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny-test", max_tokens=8, messages=[{"role": "user", "content": [IMAGE]}])
    assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"


def test_queue_full_is_529(server, monkeypatch):
    def busy(*args, **kwargs):
        raise EngineBusyError("64 requests are already waiting")

    monkeypatch.setattr(server.engine, "submit", busy)
    assert_error_shape(post(server, GOOD), 529, "overloaded_error")


class SlowRunner:
    """Delegates to the engine's runner, 5 ms per step: a scripted step is otherwise too fast to interrupt."""

    def __init__(self, runner):
        self.runner = runner

    def execute(self, plan, *, vocab_size):
        time.sleep(0.005)
        return self.runner.execute(plan, vocab_size=vocab_size)


def test_disconnect_mid_stream_aborts_and_frees_kv(server, monkeypatch):
    text = "hello world " * 60
    script = server.tokenizer.encode(text, add_special_tokens=False)  # ~1.5 s to generate at 5 ms a step
    server.script(text)
    monkeypatch.setattr(server.engine, "runner", SlowRunner(server.engine.runner))
    before = server.engine.stats().generated_tokens
    body = {"model": "tiny-test", "max_tokens": 400, "messages": user("go"), "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json=body, headers=HEADERS, timeout=60) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += line == "event: content_block_delta"
            if deltas == 3:
                break  # leaving the block closes the connection mid-stream
    server.wait_idle()
    assert server.kv_in_use() == 0
    assert server.engine.stats().generated_tokens - before < len(script) // 2  # stopped early: aborted

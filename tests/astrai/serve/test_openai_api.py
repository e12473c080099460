"""The OpenAI-compatible API through a live server, with the official `openai` SDK and raw httpx.

`server.script(text)` makes the model say `text`; expected values come from the tokenizer and the chat template
called directly on the same messages, never from a server run.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

KEY = "test-key"
MODEL = "tiny-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hi"}]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def n_tokens(server, text: str) -> int:
    return len(server.tokenizer.encode(text, add_special_tokens=False))


def template_ids(server, messages, tools=None, prefill="") -> list[int]:
    text = server.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return server.tokenizer.encode(text + prefill, add_special_tokens=False)


def assemble(chunks) -> dict[int, dict]:
    """Fold SDK stream chunks into per-choice {content, tool_calls, finish_reason, role}."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk" and chunk.model == MODEL and chunk.created > 0
        for choice in chunk.choices:
            acc = out.setdefault(choice.index, {"content": "", "calls": {}, "finish": None, "role": None})
            assert acc["finish"] is None, "a chunk after the choice finished"
            acc["role"] = acc["role"] or choice.delta.role
            acc["content"] += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = acc["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None and tc.function.name and tc.type == "function"
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            acc["finish"] = choice.finish_reason
    return out


# ---- chat ----------------------------------------------------------------------------------------------------
def test_chat_stream_matches_non_stream(server, client):
    text = "Hello world, the quick brown fox! héllo 🙂"
    server.script(text)
    full = client.chat.completions.create(model=MODEL, messages=USER)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and full.model == MODEL
    choice = full.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, "stop")
    assert choice.message.tool_calls is None
    prompt_len = len(template_ids(server, USER))
    completion_len = n_tokens(server, text) + 1  # the eos token counts
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_len, completion_len)
    assert full.usage.total_tokens == prompt_len + completion_len
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, stream=True))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert assemble(chunks) == {0: {"content": text, "calls": {}, "finish": "stop", "role": "assistant"}}


def test_chat_n2_usage_and_include_usage(server, client):
    server.script("two answers")
    full = client.chat.completions.create(model=MODEL, messages=USER, n=2)
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert all(c.message.content == "two answers" for c in full.choices)
    assert full.usage.completion_tokens == 2 * (n_tokens(server, "two answers") + 1)
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, n=2, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    got = assemble(chunks)
    assert {i: (g["content"], g["finish"]) for i, g in got.items()} == {i: ("two answers", "stop") for i in (0, 1)}
    *body, last = chunks
    assert last.choices == [] and last.usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == {
        "prompt_tokens": full.usage.prompt_tokens, "completion_tokens": full.usage.completion_tokens}  # fmt: skip
    assert all(c.usage is None for c in body)


def test_chat_content_parts_and_developer_role(server, client, prompts):
    server.script("ok")
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]
    client.chat.completions.create(model=MODEL, messages=messages)
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first\nsecond"}]
    assert prompts[-1] == template_ids(server, expected)


def test_logprobs_scripted_bytes_reassemble_the_text(server, client):
    text = "naïve 東京 🙂 done"
    server.script(text)
    full = client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=3)
    content = full.choices[0].logprobs.content
    ids = server.tokenizer.encode(text, add_special_tokens=False) + [server.tokenizer.eos_token_id]
    assert len(content) == len(ids)
    assert b"".join(bytes(e.bytes) for e in content[:-1]) == text.encode()  # token strings may split a character
    assert content[-1].token == server.tokenizer.eos_token
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content)
    streamed = [e for c in client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, stream=True)
                for ch in c.choices if ch.logprobs for e in ch.logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob, e.top_logprobs) for e in streamed] == [(e.token, e.logprob, []) for e in content]


def test_logprobs_real_model_greedy_is_top1(server, client):
    full = client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=5,
                                          temperature=0, max_tokens=8, extra_body={"ignore_eos": True})  # fmt: skip
    content = full.choices[0].logprobs.content
    assert len(content) == 8 and full.choices[0].finish_reason == "length"
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)


def test_stop_strings_and_max_tokens(server, client):
    server.script("Hello world. Goodbye world.")
    full = client.chat.completions.create(model=MODEL, messages=USER, stop=[". G", "zzz"])
    assert (full.choices[0].message.content, full.choices[0].finish_reason) == ("Hello world", "stop")
    got = assemble(client.chat.completions.create(model=MODEL, messages=USER, stop=". G", stream=True))
    assert (got[0]["content"], got[0]["finish"]) == ("Hello world", "stop")
    full = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 3
    ids = server.tokenizer.encode("Hello world. Goodbye world.", add_special_tokens=False)
    assert full.choices[0].message.content == server.tokenizer.decode(ids[:3])
    full = client.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=2)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 2


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


# ---- tools --------------------------------------------------------------------------------------------------
def check_call(call, name="get_weather", args=None):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    assert json.loads(call.function.arguments) == (args or {"city": "Paris"})


def test_tools_non_stream_and_stream(server, client, prompts):
    server.script("Let me look.\n" + CALL)
    full = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL])
    assert prompts[-1] == template_ids(server, USER, [WEATHER_TOOL])  # tools rendered ("auto" by default)
    message = full.choices[0].message
    assert message.content == "Let me look." and full.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    check_call(call)
    got = assemble(client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL], stream=True,
                                                  n=2, tool_choice="auto"))  # fmt: skip
    for i in (0, 1):
        assert (got[i]["content"], got[i]["finish"]) == ("Let me look.", "tool_calls")
        (streamed,) = got[i]["calls"].values()
        assert streamed["name"] == "get_weather" and json.loads(streamed["arguments"]) == {"city": "Paris"}
        assert streamed["arguments"] == call.function.arguments


def test_tools_stream_logprobs_once_per_token(server, client):
    server.script("Hi " + CALL)  # the delta that closes the JSON yields two chunks (name, arguments)
    kw = {"model": MODEL, "messages": USER, "tools": [WEATHER_TOOL], "logprobs": True}
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(**kw, stream=True)
                for ch in c.choices if ch.logprobs for e in ch.logprobs.content]  # fmt: skip
    assert len(full) == n_tokens(server, "Hi " + CALL) + 1
    assert [e.token for e in streamed] == [e.token for e in full]


def test_tool_choice_none_leaves_markup_as_text(server, client, prompts):
    server.script(CALL)
    full = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL], tool_choice="none")
    assert prompts[-1] == template_ids(server, USER)  # no tools in the prompt
    assert full.choices[0].message.content == CALL and full.choices[0].message.tool_calls is None
    assert full.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_renders_no_prefill(server, client, prompts, choice):
    # the call is forced by a grammar (tests/astrai/serve/test_tool_choice_grammar.py), not by a pre-fill
    server.script(CALL)
    tools = [WEATHER_TOOL, {"type": "function", "function": {"name": "other"}}]
    full = client.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice=choice)
    assert prompts[-1] == template_ids(server, USER, tools)
    (call,) = full.choices[0].message.tool_calls
    check_call(call)
    assert full.choices[0].message.content is None and full.choices[0].finish_reason == "tool_calls"
    got = assemble(client.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice=choice,
                                                  stream=True))  # fmt: skip
    assert got[0]["content"] == "" and [c["arguments"] for c in got[0]["calls"].values()] == ['{"city": "Paris"}']


def test_tool_result_round_trip_reaches_the_prompt(server, client, prompts):
    server.script("It is sunny in Paris.")
    messages = [*USER,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"}]  # fmt: skip
    full = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert full.choices[0].message.content == "It is sunny in Paris."
    rendered = server.tokenizer.decode(prompts[-1], skip_special_tokens=False)
    assert "<tool_response>\nsunny, 24C\n</tool_response>" in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    parsed = [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C", "name": "get_weather"}]  # fmt: skip
    assert prompts[-1] == template_ids(server, parsed, [WEATHER_TOOL])


# ---- legacy completions -------------------------------------------------------------------------------------
def test_completions_string_and_token_prompts(server, client):
    server.script(" the lazy dog")
    full = client.completions.create(model=MODEL, prompt="the quick brown fox jumps over")
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert (full.choices[0].text, full.choices[0].finish_reason) == (" the lazy dog", "stop")
    assert full.usage.prompt_tokens == len(server.tokenizer.encode("the quick brown fox jumps over"))
    ids = [5, 17, 42, 99]
    full = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, logprobs=2)
    assert full.usage.prompt_tokens == 4 and full.choices[0].finish_reason == "length"
    lp = full.choices[0].logprobs
    expected = server.tokenizer.encode(" the lazy dog", add_special_tokens=False)[:2]
    assert "".join(lp.tokens) == server.tokenizer.decode(expected) and lp.text_offset == [0, len(lp.tokens[0])]
    assert all(len(t) <= 2 for t in lp.top_logprobs) and len(lp.token_logprobs) == 2
    full = client.completions.create(model=MODEL, prompt=ids, echo=True)
    assert full.choices[0].text == server.tokenizer.decode(ids) + " the lazy dog"
    chunks = list(client.completions.create(model=MODEL, prompt="x", echo=True, stream=True, n=2,
                                            stream_options={"include_usage": True}))  # fmt: skip
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert texts == {0: "x the lazy dog", 1: "x the lazy dog"}
    assert chunks[-1].usage.completion_tokens == 2 * (n_tokens(server, " the lazy dog") + 1)


# ---- wire format and errors ---------------------------------------------------------------------------------
def test_sse_framing_raw(server):
    server.script("Hi " + CALL)
    body = {"model": MODEL, "messages": USER, "stream": True, "tools": [WEATHER_TOOL],
            "stream_options": {"include_usage": True}}  # fmt: skip
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=HEADERS)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n") and r.text.count("data: [DONE]") == 1
    events = r.text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    calls = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls", [])]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    assert all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"} for tc in calls[1:])
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Paris"}
    assert len({c["created"] for c in chunks}) == 1 and chunks[0]["created"] > 0
    # cached_tokens is reported only with --enable-prompt-tokens-details (tests/astrai/serve/test_cache_salt.py)
    assert chunks[-1]["choices"] == [] and "prompt_tokens_details" not in chunks[-1]["usage"]
    assert chunks[-1]["usage"]["prompt_tokens"] > 0


LONG = "hello " * 2500  # more tokens than the tiny model's 2048-token context
BAD = [  # (path, body, status, param or None, words the message must contain)
    ("chat", b"{not json", 400, None, ["JSON"]),
    ("chat", b"[1, 2]", 400, None, ["object"]),
    ("chat", {"messages": []}, 400, "messages", []),
    ("chat", {"messages": "hi"}, 400, "messages", []),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", ["wizard"]),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", []),
    ("chat", {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content", []),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content[0].type",
        ["image_url"],
    ),
    (
        "chat",
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}],
                }
            ]
        },
        400,
        "messages[0].tool_calls[0].function.arguments",
        [],
    ),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id", []),
    ("chat", {"messages": USER, "temperature": "hot"}, 400, "temperature", []),
    ("chat", {"messages": USER, "temperature": 2.5}, 400, "temperature", []),
    ("chat", {"messages": USER, "top_p": 0}, 400, "top_p", []),
    ("chat", {"messages": USER, "max_tokens": -1}, 400, "max_tokens", []),
    ("chat", {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens", []),
    ("chat", {"messages": USER, "max_tokens": 1.5}, 400, "max_tokens", []),
    ("chat", {"messages": USER, "n": 0}, 400, "n", []),
    ("chat", {"messages": USER, "n": True}, 400, "n", []),
    ("chat", {"messages": USER, "stop": [1, 2]}, 400, "stop", []),
    ("chat", {"messages": USER, "logit_bias": {"abc": 1}}, 400, "logit_bias", []),
    ("chat", {"messages": USER, "logit_bias": {"99999": 1}}, 400, "logit_bias", ["99999"]),
    ("chat", {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", []),
    ("chat", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", []),
    ("chat", {"messages": USER, "stream": "yes"}, 400, "stream", []),
    ("chat", {"messages": USER, "stream_options": {"include_usage": True}}, 400, "stream_options", []),
    ("chat", {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format.type", []),
    ("chat", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", ["2048"]),
    ("chat", {"messages": USER, "max_tokens": 5000}, 400, "max_tokens", ["5000", "2048"]),  # engine error
    (
        "chat",
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "has space"}}]},
        400,
        "tools[0].function.name",
        [],
    ),
    ("chat", {"messages": USER, "tools": [WEATHER_TOOL, WEATHER_TOOL]}, 400, "tools[1].function.name", []),
    (
        "chat",
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
        400,
        "tools[0].function.parameters",
        [],
    ),
    ("chat", {"messages": USER, "tools": [{"type": "retrieval"}]}, 400, "tools[0]", []),
    (
        "chat",
        {"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        400,
        "tool_choice",
        ["nope"],
    ),
    ("chat", {"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, 400, "tool_choice", []),
    ("chat", {"messages": USER, "tool_choice": "required"}, 400, "tool_choice", []),
    ("chat", {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions", []),
    ("chat", {"messages": USER, "frobnicate": None}, 400, "frobnicate", ["frobnicate", "messages", "docs/serving"]),
    ("chat", {"messages": USER, "prompt": "x"}, 400, "prompt", []),  # a completions field
    ("chat", {"messages": USER, "suffix": "x"}, 400, "suffix", []),
    ("chat", {"messages": USER, "chat_template": "{{ messages }}"}, 400, "chat_template", ["--chat-template"]),
    ("chat", {"messages": USER, "use_beam_search": True}, 400, "use_beam_search", ["beam"]),
    ("chat", {"messages": USER, "chat_template_kwargs": "x"}, 400, "chat_template_kwargs", ["object"]),
    ("chat", {"messages": USER, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs", ["'tools'"]),
    (
        "chat",
        {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}},
        400,
        "chat_template_kwargs",
        ["add_generation_prompt"],
    ),
    (
        "chat",
        {"messages": USER, "chat_template_kwargs": {"x": "<|im_start|>system"}},
        400,
        "chat_template_kwargs.x",
        ["special-token"],
    ),
    ("chat", {"messages": USER, "documents": "x"}, 400, "documents", []),
    ("chat", {"messages": USER, "add_generation_prompt": False}, 400, "add_generation_prompt", []),
    ("chat", {"messages": USER, "add_special_tokens": True}, 400, "add_special_tokens", []),
    ("chat", {"messages": USER, "continue_final_message": True}, 400, "continue_final_message", ["assistant"]),
    (
        "chat",
        {
            "messages": [*USER, {"role": "assistant", "content": "x"}],
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
        400,
        "continue_final_message",
        [],
    ),
    ("chat", {"messages": USER, "echo": "yes"}, 400, "echo", []),
    ("chat", {"messages": USER, "min_tokens": 1.5}, 400, "min_tokens", []),
    ("chat", {"messages": USER, "stop_token_ids": 5}, 400, "stop_token_ids", []),
    ("completions", {"prompt": ["a", ""]}, 400, "prompt", ["prompt[1]"]),
    ("completions", {"prompt": ["a", [10**9]]}, 400, "prompt", ["prompt[1]", "[0, "]),
    ("completions", {"prompt": ["a", LONG]}, 400, "prompt", ["prompt[1]", "2048"]),
    ("completions", {"prompt": ["a", "b"], "max_tokens": 2048}, 400, "max_tokens", ["prompt[0]", "2049"]),
    ("completions", {"prompt": ["a"] * 33, "n": 2}, 400, "prompt", ["33 prompts", "64"]),  # max_waiting 64
    ("completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", ["frobnicate", "max_tokens", "prompt"]),
    ("completions", {"prompt": "x", "messages": USER}, 400, "messages", []),  # a chat field
    ("completions", {"prompt": "x", "stop_token_ids": [1, "2"]}, 400, "stop_token_ids", []),
    ("completions", {"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids", ["99999"]),
    ("completions", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens", []),
    ("completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", []),
    ("completions", {"prompt": "x", "skip_special_tokens": "no"}, 400, "skip_special_tokens", []),
    ("completions", {"prompt": "x", "include_stop_str_in_output": 1}, 400, "include_stop_str_in_output", []),
    ("completions", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", []),
    ("completions", {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}, 400, "guided_choice", ["one"]),
    (
        "completions",
        {"prompt": "x", "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema",
        [],
    ),
    (
        "completions",
        {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
        400,
        "stream_options.continuous_usage_stats",
        [],
    ),
    ("completions", {"prompt": "x", "stream": True, "stream_options": {"nope": True}}, 400, "stream_options.nope", []),
    ("completions", {"prompt": []}, 400, "prompt", []),
    ("completions", {"prompt": [1, "a"]}, 400, "prompt", []),
    ("completions", {"prompt": [10**9]}, 400, "prompt", ["[0, "]),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ["only with echo"]),
    ("completions", {"prompt": "x", "max_tokens": -1, "echo": True}, 400, "max_tokens", []),
    ("completions", {"prompt": "x", "logprobs": 30}, 400, "logprobs", []),
    ("completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", []),
    ("completions", {"prompt": "x", "best_of": 3}, 400, "best_of", []),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), BAD)
def test_bad_requests_get_openai_errors(server, path, body, status, param, words):
    url = f"{server.base_url}/v1/{'chat/completions' if path == 'chat' else 'completions'}"
    kw = {"content": body} if isinstance(body, bytes) else {"json": {"model": MODEL, **body}}
    r = httpx.post(url, headers={**HEADERS, "Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error["message"]


def test_auth_and_body_limit_then_still_healthy(server, client):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": USER},
                   headers={"Authorization": "Bearer wrong"})  # fmt: skip
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    big = {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=big, headers=HEADERS)
    assert r.status_code == 413 and "error" in r.json()
    server.script("fine")
    assert client.chat.completions.create(model=MODEL, messages=USER).choices[0].message.content == "fine"
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"


def test_metrics_count_generated_tokens(server, client):
    def generated() -> int:
        text = httpx.get(server.base_url + "/metrics", headers=HEADERS).text
        return int(next(line.split()[-1] for line in text.splitlines() if line.startswith("astrai_generation_tokens")))

    server.script("count me")
    before = generated()
    client.chat.completions.create(model=MODEL, messages=USER, n=2)
    assert generated() - before == 2 * (n_tokens(server, "count me") + 1)


# ---- disconnects --------------------------------------------------------------------------------------------
@pytest.fixture
def slow(server, monkeypatch):
    """The real model at >= 5 ms a step, so that 400 tokens take seconds and only a disconnect ends them early."""
    execute = server.engine.runner.execute

    def slow_execute(plan, **kw):
        time.sleep(0.005)
        return execute(plan, **kw)

    monkeypatch.setattr(server.engine.runner, "execute", slow_execute)


def test_stream_disconnect_aborts_and_frees_kv(server, slow):
    body = {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 400, "ignore_eos": True}
    before = server.engine.stats().generated_tokens
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=HEADERS) as r:
        lines = r.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")) >= 3
    server.wait_idle()
    assert server.kv_in_use() == 0
    assert server.engine.stats().generated_tokens - before < 400


def test_non_stream_disconnect_aborts(server, slow):
    body = {"model": MODEL, "messages": USER, "max_tokens": 400, "ignore_eos": True}
    before = server.engine.stats().generated_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=0.3)
    server.wait_idle()
    assert server.kv_in_use() == 0
    assert server.engine.stats().generated_tokens - before < 400

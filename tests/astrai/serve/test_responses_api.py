"""`/v1/responses` (OpenAI's Responses API) through a live server, with the official openai SDK (and openai-agents).

References are independent of the server: every reply and stream event is validated against the SDK's own pydantic
types (`Response`, the `ResponseStreamEvent` union); expected prompts come from the chat template applied by the
tokenizer directly to the chat messages a Responses input stands for; structured output is checked by `jsonschema`.
`server.script(text)` makes the model say `text`.
"""

from __future__ import annotations

import asyncio
import json
import typing

import httpx
import jsonschema
import openai
import openai.types.responses as rt
import pytest

from astrai.serve.common import APIError
from astrai.serve.openai_protocol import parse_chat
from astrai.serve.responses_api import _framed, store_of
from astrai.serve.responses_protocol import parse_responses

KEY, MODEL = "test-key", "tiny-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA,
        "strict": True}  # fmt: skip
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
             "parameters": SCHEMA}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>\nThe user adds 2 and 2.\n</think>\n\nThe answer is 4."
# the SDK's stream event union, by each member's `type` literal (a clear error names the one event class)
EVENTS = {cls.model_fields["type"].annotation.__args__[0]: cls
          for cls in typing.get_args(typing.get_args(rt.ResponseStreamEvent)[0])}  # fmt: skip


@pytest.fixture
def client(oai):
    return oai


def template_ids(server, messages, tools=None) -> list[int]:
    text = server.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return server.tokenizer.encode(text, add_special_tokens=False)


def post(server, body, status=200):
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": MODEL, **body}, headers=HEADERS, timeout=60)
    assert r.status_code == status, r.text
    return r


def events(server, body) -> list:
    """The stream's events, each validated against the SDK's event union; sequence numbers checked."""
    text = post(server, {**body, "stream": True}).text
    raw = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert names == [e["type"] for e in raw]
    assert [e["sequence_number"] for e in raw] == list(range(len(raw)))
    return [EVENTS[e["type"]].model_validate(e) for e in raw]


def same_items(a, b) -> bool:
    """Output items equal but for their random ids."""
    strip = [{k: v for k, v in i.model_dump().items() if k != "id"} for i in a.output]
    return strip == [{k: v for k, v in i.model_dump().items() if k != "id"} for i in b.output]


def test_text_whole_and_streamed_validate(server, client, prompts):
    server.script("hello world")
    body = {"input": "hi", "instructions": "Be brief.", "metadata": {"k": "v"}, "max_output_tokens": 32}
    whole = rt.Response.model_validate(post(server, body).json())
    assert whole.status == "completed" and whole.output_text == "hello world" and whole.id.startswith("resp_")
    assert whole.model == MODEL and whole.metadata == {"k": "v"} and whole.instructions == "Be brief."
    assert whole.temperature == 1.0 and whole.top_p == 1.0  # the values used: no sampling defaults on this server
    assert (
        whole.usage.input_tokens == len(prompts[-1])
        and whole.usage.output_tokens == len(server.tokenizer.encode("hello world", add_special_tokens=False)) + 1
    )  # fmt: skip  (+ eos)
    assert prompts[-1] == template_ids(server, [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "hi"}])  # fmt: skip
    stream = events(server, body)
    kinds = [e.type for e in stream]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == "hello world"
    assert same_items(stream[-1].response, whole) and stream[-1].response.usage == whole.usage
    sdk = client.responses.create(model=MODEL, input="hi", max_output_tokens=32)
    assert sdk.output_text == "hello world"


def test_function_tool_loop_create_and_stream(server, client, prompts):
    server.script(CALL)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], max_output_tokens=128)
    rt.Response.model_validate(first.model_dump())
    assert prompts[-1] == template_ids(server, [{"role": "user", "content": "Weather in Paris?"}], [CHAT_TOOL])
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Paris"}  # fmt: skip
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[TOOL], max_output_tokens=128) as s:
        seen = [e.type for e in s]
        streamed = s.get_final_response()
    assert "response.function_call_arguments.delta" in seen and "response.function_call_arguments.done" in seen
    raw = events(server, {"input": "Weather in Paris?", "tools": [TOOL], "max_output_tokens": 128})
    deltas = "".join(e.delta for e in raw if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in raw if e.type == "response.function_call_arguments.done"]
    (item,) = [e.item for e in raw if e.type == "response.output_item.done"]
    assert deltas == done.arguments == item.arguments == call.arguments and done.item_id == item.id
    assert same_items(streamed, first) or [o.type for o in streamed.output] == ["function_call"]
    server.script("It is sunny.")
    history = [{"role": "user", "content": "Weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in
               first.output], {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]  # fmt: skip
    with client.responses.stream(model=MODEL, input=history, tools=[TOOL], max_output_tokens=64) as s:
        final = s.get_final_response()
    assert final.output_text == "It is sunny." and final.status == "completed"
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "sunny"}]  # fmt: skip
    assert prompts[-1] == template_ids(server, chat, [CHAT_TOOL])  # the call and its result reached the prompt


def test_tool_result_after_previous_response_id(server, client, prompts):
    """The Responses-native loop: the call's result sent with `previous_response_id` (no history resent)."""
    server.script(CALL)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], max_output_tokens=128)
    server.script("It is sunny.")
    result = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "sunny"}
    final = client.responses.create(model=MODEL, input=[result], previous_response_id=first.id, tools=[TOOL])
    assert final.output_text == "It is sunny."
    call = {"id": result["call_id"], "type": "function", "function": {"name": "get_weather",
            "arguments": {"city": "Paris"}}}  # fmt: skip
    chat = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None,
            "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "name": "get_weather",
            "content": "sunny"}]  # fmt: skip
    assert prompts[-1] == template_ids(server, chat, [CHAT_TOOL])


def test_fields_map_onto_the_chat_request(server):
    """A Responses body validates to exactly the chat request of its hand-written chat-completions equivalent."""
    kw = {"vocab_size": server.engine.model.config.vocab_size, "context": 2048}
    fmt = {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}
    body = {"input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
                      {"role": "user", "content": "q"}],
            "instructions": "sys", "tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False,
            "temperature": 0.5, "top_p": 0.9, "max_output_tokens": 77, "text": {"format": fmt}, "store": False,
            "metadata": {"a": "b"}, "user": "u"}  # fmt: skip
    chat = {"messages": [{"role": "system", "content": "sys"}, {"role": "developer", "content": "d"},
                         {"role": "user", "content": "q"}],
            "tools": [CHAT_TOOL], "tool_choice": "auto", "parallel_tool_calls": False, "temperature": 0.5,
            "top_p": 0.9, "max_tokens": 77, "response_format": {"type": "json_schema", "json_schema": {
                "name": "place", "schema": SCHEMA, "strict": True}}}  # fmt: skip
    got = parse_responses(body, [], server.tokenizer, **kw).chat
    assert got == parse_chat(chat, server.tokenizer, **kw)
    assert got.params.max_tokens == 77 and got.params.temperature == 0.5 and got.params.grammar is not None
    plain = parse_responses({"input": "q", "tools": [TOOL]}, [], server.tokenizer, **kw).chat
    parallel = parse_responses({"input": "q", "tools": [TOOL], "parallel_tool_calls": True}, [], server.tokenizer,
                               **kw).chat  # fmt: skip
    single = parse_responses({"input": "q", "tools": [TOOL], "parallel_tool_calls": False}, [], server.tokenizer,
                             **kw).chat  # fmt: skip
    assert plain == parallel != single  # one call only: another grammar


def test_forced_tool_choice_and_none(server, client, prompts):
    server.script(CALL)
    forced = client.responses.create(model=MODEL, input="x", tools=[TOOL], max_output_tokens=128,
                                     tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    assert [o.type for o in forced.output] == ["function_call"]
    assert forced.tool_choice.name == "get_weather"
    off = client.responses.create(model=MODEL, input="x", tools=[TOOL], tool_choice="none", max_output_tokens=128)
    assert off.output_text == CALL and prompts[-1] == template_ids(server, [{"role": "user", "content": "x"}])


def test_json_schema_format_validates(server, client):
    fmt = {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}
    for reply in (client.responses.create(model=MODEL, input="city?", text={"format": fmt}, max_output_tokens=40),
                  rt.Response.model_validate(events(server, {"input": "city?", "text": {"format": fmt},
                                                             "max_output_tokens": 40})[-1].response)):  # fmt: skip
        jsonschema.validate(json.loads(reply.output_text), SCHEMA)
        assert reply.text.format.type == "json_schema"


def test_incomplete_at_max_output_tokens(server):
    server.script("one two three four five six")
    whole = rt.Response.model_validate(post(server, {"input": "count", "max_output_tokens": 2}).json())
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete" and whole.usage.output_tokens == 2
    stream = events(server, {"input": "count", "max_output_tokens": 2})
    assert stream[-1].type == "response.incomplete" and stream[-1].response.status == "incomplete"


def test_a_call_cut_by_max_output_tokens_leaves_no_markup(server):
    # tool_choice auto: a complete call, then a second one the budget cuts; the cut call is dropped, never text
    said = CALL + "\n" + CALL.replace("Paris", "Rome")
    server.script(said)
    budget = len(server.tokenizer.encode(CALL + "\n" + CALL[:30], add_special_tokens=False))
    body = {"input": "weather?", "tools": [TOOL], "max_output_tokens": budget}
    for reply in (rt.Response.model_validate(post(server, body).json()),
                  events(server, body)[-1].response):  # fmt: skip
        assert reply.status == "incomplete"
        assert [item.type for item in reply.output] == ["function_call"]
        assert json.loads(reply.output[0].arguments) == {"city": "Paris"}
        assert "<tool_call>" not in json.dumps(reply.model_dump())


def test_reasoning_item_and_effort(server, monkeypatch):
    monkeypatch.setattr(server.app.state, "reasoning_parser", "qwen3")
    server.script(THOUGHT)
    whole = rt.Response.model_validate(post(server, {"input": "2+2?", "reasoning": {"effort": "low"}}).json())
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "The user adds 2 and 2." and whole.output_text == "The answer is 4."
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    stream = events(server, {"input": "2+2?"})
    assert "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta") == "The user adds 2 and 2."
    assert same_items(stream[-1].response, whole)
    # effort reaches the template as reasoning_effort, exactly as the chat route's field does
    tokenizer = server.tokenizer.with_chat_template("{{ messages[0]['content'] }} effort={{ reasoning_effort }}")
    kw = {"vocab_size": server.engine.model.config.vocab_size, "context": 2048}
    got = parse_responses({"input": "q", "reasoning": {"effort": "high"}}, [], tokenizer, **kw).chat.prompt
    assert got == parse_chat({"messages": [{"role": "user", "content": "q"}], "reasoning_effort": "high"},
                             tokenizer, **kw).prompt  # fmt: skip
    assert tokenizer.decode(got).endswith("effort=high")
    assert tokenizer.decode(parse_responses({"input": "q"}, [], tokenizer, **kw).chat.prompt).endswith("effort=")


def test_previous_response_id_continues_and_get_delete(server, client, prompts):
    server.script("first answer")
    first = client.responses.create(model=MODEL, input="hi", instructions="Sys.", max_output_tokens=16)
    server.script("second answer")
    second = client.responses.create(model=MODEL, input="more", previous_response_id=first.id, max_output_tokens=16)
    assert second.output_text == "second answer" and second.previous_response_id == first.id
    # instructions are not carried over (OpenAI's rule); the first turn's input and output are
    assert prompts[-1] == template_ids(server, [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "first answer"},
                                                {"role": "user", "content": "more"}])  # fmt: skip
    got = client.responses.retrieve(second.id)
    assert got.model_dump() == second.model_dump()
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    r = post(server, {"input": "x", "previous_response_id": second.id}, 404)
    assert r.json()["error"]["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=4)
    post(server, {"input": "x", "previous_response_id": unstored.id}, 404)


def test_store_bound_evicts_least_recently_used(server, client, monkeypatch):
    store = store_of(server.app.state)
    monkeypatch.setattr(store, "max_count", 2)
    server.script("ok")
    a, b = (client.responses.create(model=MODEL, input="x", max_output_tokens=4) for _ in range(2))
    client.responses.retrieve(a.id)  # a is now the most recently used: b goes first
    c = client.responses.create(model=MODEL, input="x", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(b.id)
    assert client.responses.retrieve(a.id).id == a.id and client.responses.retrieve(c.id).id == c.id
    monkeypatch.setattr(store, "max_count", 100)
    monkeypatch.setattr(store, "max_bytes", store.bytes + 10)  # room for nothing more: the next evicts the oldest
    d = client.responses.create(model=MODEL, input="x", max_output_tokens=4)
    assert len(store) <= 2 and store.bytes <= store.max_bytes
    assert client.responses.retrieve(d.id).id == d.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(a.id)


@pytest.mark.parametrize(("fields", "status", "param"), [
    ({"background": True}, 400, "background"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, 400, "tools[0].type"),
    ({"frobnicate": 1}, 400, "frobnicate"),
    ({"max_output_tokens": 10**9}, 400, "max_output_tokens"),
    ({"temperature": 5}, 400, "temperature"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": None}, 400, "input"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, 400, "tool_choice"),
    ({"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({"previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"store": "yes"}, 400, "store"),
    ({"metadata": {"k": 1}}, 400, "metadata"),
    ({"instructions": ["x"]}, 400, "instructions"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include"),
])  # fmt: skip
def test_unsupported_and_bad_fields_name_the_param(server, fields, status, param):
    error = post(server, {"input": "x", **fields}, status).json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    if param in ("background", "conversation"):  # refused on purpose, not merely unknown: the message says so
        assert "is not supported by this server" in error["message"]


def test_error_after_the_stream_began_is_an_error_event(server):
    """A failure mid-stream (the engine died, a constraint failed) ends the stream with the SDK's `error` event,
    numbered after the last event sent and naming the Responses field."""

    async def failing():
        yield {"type": "response.created", "sequence_number": 0}
        raise APIError(400, "the grammar reached a dead end", param="response_format")

    async def frames():
        return [f async for f in _framed(server.app.state, failing())]

    *_, last = asyncio.run(frames())
    assert last.startswith("event: error\n")
    error = rt.ResponseErrorEvent.model_validate(json.loads(last.split("data: ", 1)[1]))
    assert error.sequence_number == 1 and error.param == "text.format" and "dead end" in error.message


def test_get_and_delete_unknown_are_404(server, client):
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{server.base_url}/v1/responses/resp_nope", headers=HEADERS, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_stream_disconnect_aborts(server):
    server.script("word " * 400)
    body = {"model": MODEL, "input": "x", "stream": True, "max_output_tokens": 400}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, headers=HEADERS, timeout=30) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break
    server.wait_idle()
    assert server.kv_in_use() == 0


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_default_agent_finishes_a_tool_loop(server, monkeypatch, streamed):
    """The agents SDK's default model is the Responses API: its Agent calls the tool, then answers with its result."""
    agents = pytest.importorskip("agents")
    said, submit, seen = [CALL, "It is sunny in Paris."], server.engine.submit, []

    def scripted(prompt, params=None, **kw):  # each engine request says the next line
        server.script(said[min(len(seen), len(said) - 1)])
        seen.append(server.tokenizer.decode(list(prompt), skip_special_tokens=False))
        return submit(prompt, params, **kw)

    monkeypatch.setattr(server.engine, "submit", scripted)
    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        cities.append(city)
        return "sunny"

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as oai:
            model = agents.OpenAIResponsesModel(model=MODEL, openai_client=oai)
            agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model)
            if not streamed:
                return await agents.Runner.run(agent, "Weather in Paris?")
            result = agents.Runner.run_streamed(agent, "Weather in Paris?")
            async for _ in result.stream_events():
                pass
            return result

    result = asyncio.run(run())
    assert cities == ["Paris"] and result.final_output == "It is sunny in Paris."
    assert len(seen) == 2 and "sunny" in seen[1] and "get_weather" in seen[1]  # the tool's result reached turn 2

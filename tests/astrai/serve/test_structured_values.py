"""What the OpenAI routes say about how an output ended and where tool calls go (issue 41, item 6).

- `stop_reason` as vLLM sends it: the matched stop string, the `stop_token_ids` id, null for EOS and for
  `max_tokens`; in every non-streamed choice, and in a stream's final chunk of each choice.
- `content` is null beside tool calls when the message holds nothing else (OpenAI's shape).
- Under tool_choice "auto", a call that `max_tokens` cuts short never reaches `content` (it used to come back as
  `<tool_call>…` text), streamed or not, on the chat and Anthropic routes; the complete call before it is kept.

`server.script(text)` makes the model write `text`; the expectations come from the script, not from the server.
The negative control of the cut call is the parser without `cut` (the behaviour before): markup in the content.
"""

from __future__ import annotations

import json

import httpx
import pytest

from astrai.serve.tool_parsers import parse

MODEL = "tiny-test"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = "Hello world. Goodbye world."


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=60,
                   headers={"Authorization": "Bearer test-key"})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path: str, body: dict) -> list[dict]:
    """Every choice of every chunk of a streamed reply."""
    with httpx.stream("POST", server.base_url + path, json={"model": MODEL, "stream": True, **body}, timeout=60,
                      headers={"Authorization": "Bearer test-key"}) as r:  # fmt: skip
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    return [c for x in lines for c in json.loads(x)["choices"]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stop_reason_is_what_ended_the_output(server, path):
    server.script(TEXT)
    body = {"messages": USER} if path.endswith("chat/completions") else {"prompt": "hi", "max_tokens": 64}
    ids = server.tokenizer.encode(TEXT, add_special_tokens=False)
    cases = [  # (request fields, finish_reason, stop_reason)
        ({"stop": [". G", "zzz"]}, "stop", ". G"),
        ({"stop_token_ids": [ids[3]]}, "stop", ids[3]),
        ({}, "stop", None),  # EOS
        ({"max_tokens": 2}, "length", None),
    ]
    for extra, finish, reason in cases:
        (choice,) = _post(server, path, {**body, **extra})["choices"]
        assert (choice["finish_reason"], choice["stop_reason"]) == (finish, reason), extra
        assert "stop_reason" in choice  # null is sent, not left out
        chunks = _stream(server, path, {**body, **extra})
        last = [c for c in chunks if c.get("finish_reason")]
        assert len(last) == 1 and (last[0]["finish_reason"], last[0]["stop_reason"]) == (finish, reason), extra
        assert all("stop_reason" not in c for c in chunks if not c.get("finish_reason"))


def test_content_is_null_beside_tool_calls(server):
    server.script(CALL)
    (choice,) = _post(server, "/v1/chat/completions", {"messages": USER, "tools": [TOOL]})["choices"]
    assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1
    assert choice["finish_reason"] == "tool_calls"
    server.script("Let me look.\n" + CALL)  # text and a call: both
    (choice,) = _post(server, "/v1/chat/completions", {"messages": USER, "tools": [TOOL]})["choices"]
    assert choice["message"]["content"] == "Let me look." and len(choice["message"]["tool_calls"]) == 1


CUT = "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Lyon")


def _cut_budget(server) -> int:
    """A budget that ends inside the second call (after its `{"name": "get_`)."""
    whole = len(server.tokenizer.encode(CUT, add_special_tokens=False))
    first = len(server.tokenizer.encode("Let me look.\n" + CALL + '\n<tool_call>\n{"name": "get_',
                                        add_special_tokens=False))  # fmt: skip
    assert first < whole
    return first


def test_a_call_cut_by_max_tokens_never_reaches_content(server):
    server.script(CUT)
    body = {"messages": USER, "tools": [TOOL], "tool_choice": "auto", "max_tokens": _cut_budget(server)}
    (choice,) = _post(server, "/v1/chat/completions", body)["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "length" and message["content"] == "Let me look.", message
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}]
    chunks = _stream(server, "/v1/chat/completions", body)
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    calls = [t for c in chunks for t in c["delta"].get("tool_calls") or []]
    assert content == "Let me look." and [t["function"]["name"] for t in calls if "id" in t] == ["get_weather"]
    assert [c["finish_reason"] for c in chunks if c.get("finish_reason")] == ["length"]


def test_a_cut_call_never_reaches_anthropic_text(server, anth):
    server.script(CUT)
    tools = [{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]
    reply = anth.messages.create(model=MODEL, max_tokens=_cut_budget(server), messages=USER, tools=tools)
    texts = [b.text for b in reply.content if b.type == "text"]
    uses = [b.input for b in reply.content if b.type == "tool_use"]
    assert texts == ["Let me look."] and uses == [{"city": "Paris"}] and reply.stop_reason == "max_tokens"


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "mistral", "deepseek_v3"])
def test_parsers_drop_a_cut_call_only_when_told(server, fmt):
    """Each marked format: with `cut` the unterminated call (or a half-written marker) is dropped and the call
    before it kept; without `cut` (the negative control: the behaviour before) the markup comes back as text."""
    calls = {
        "hermes": ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', '<tool_call>\n{"name": "f"'),
        "qwen3_coder": ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
                        "<tool_call>\n<function=f>\n<param"),
        "mistral": ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', None),
        "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```"
                        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>func"),
    }[fmt]  # fmt: skip
    tools = {"f": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    whole, cut = calls
    if cut is None:  # mistral: one region to the end of the output; cut inside its second call
        texts = ['Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "f", "argu']
    else:
        texts = [f"Sure. {whole}{cut}", f"Sure. {cut}", "Sure. " + cut[:3]]
    for text in texts:
        content, got = parse(fmt, text, ["f"], tools, cut=True)
        assert content == "Sure." and all(json.loads(c.arguments) == {"a": 1} for c in got), (text, content)
        assert len(got) == (1 if cut is None or whole in text else 0), (text, got)
        before, _ = parse(fmt, text, ["f"], tools)
        assert before.strip() != "Sure.", text  # the markup stayed text

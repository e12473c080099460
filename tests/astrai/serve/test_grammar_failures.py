"""Constraints that admit no complete output, and grammars that fail mid-sequence, through the live HTTP server.

A red-team's request bodies (a schema that is only a `$ref` to itself, GBNF/Lark rules that only recur, a regex
that matches nothing or exhausts llguidance's lexer, a schema whose arrays must hold such arrays) once ended the
engine thread (503 for every later request) or came back as invalid output with finish_reason "stop". Each is now
a 400 naming its field, on every route that takes a constraint, and the server then still serves a plain and a
constrained request whose output parses (the negative control: a satisfiable schema is not refused). A matcher
made to fail in the middle of one sequence ends only that request (a 400 naming the field, or an error event in
a stream after the text already sent), while a concurrent constrained request completes and later requests are
served; the same request without the injected fault succeeds. The engine's own death and /health are covered in
test_engine_health.py (a server of its own).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from astrai.inference import runner as runner_module
from astrai.inference import steer as steer_module

AUTH = {"Authorization": "Bearer test-key"}
USER = [{"role": "user", "content": "hi"}]
LOOP_DEFS = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
NESTED_ARRAYS = {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}},
                 "$ref": "#/$defs/n"}  # fmt: skip
GOOD = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}  # fmt: skip


# what the admission check says (`grammar_check`), as opposed to a sequence that failed while it ran
ADMISSION = re.compile(r"the grammar (accepts no complete output|allows no output at all|engine fails on the way)")


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# (route, body, the field the 400 names): the red-team's bodies as they sent them
REFUSED = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "response_format": _schema({"$ref": "#"})},
     "response_format"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "guided_grammar": "root ::= a\na ::= a"},
     "guided_grammar"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "guided_regex": r"[^\x00-\U0010FFFF]"},
     "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "guided_regex": r"[^\x00-\U0010FFFF]"}, "guided_regex"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "response_format": _schema(LOOP_DEFS)},
     "response_format"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "guided_regex": "a{1000000}"}, "guided_regex"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 100, "guided_grammar": 'start: "a" start'},
     "guided_grammar"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 200, "response_format": _schema({"$ref": "#"})},
     "response_format"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 100, "response_format": _schema(NESTED_ARRAYS)},
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 50, "guided_json": NESTED_ARRAYS}, "guided_json"),
]  # fmt: skip


def _post(server, route: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.base_url + route, json={"model": "tiny-test", **body}, headers=AUTH, timeout=60, **kw)


def _still_serving(server) -> None:
    """/health is 200, a plain request completes, and a constrained one returns JSON valid for its schema."""
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    plain = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 4})
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] in ("stop", "length")
    body = {"messages": USER, "max_tokens": 40, "temperature": 1.0, "seed": 3, "response_format": _schema(GOOD)}
    constrained = _post(server, "/v1/chat/completions", body)
    assert constrained.status_code == 200, constrained.text
    choice = constrained.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), GOOD)


@pytest.mark.parametrize(("route", "body", "param"), REFUSED, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSED)])
def test_a_constraint_with_no_complete_output_is_a_400_and_the_server_lives_on(server, route, body, param):
    for _ in range(2):  # the second identical request once found a cached grammar already failed (a{1000000})
        reply = _post(server, route, body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert ADMISSION.match(error["message"].removeprefix(f"{param}: ")), error  # refused before it ran
    _still_serving(server)


def test_satisfiable_recursive_constraints_are_served(server):
    # the negative control of the admission check: recursion that can stop (an empty array, an optional
    # property, an alternative that ends) is not refused, and the output satisfies the constraint
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
            "required": ["kids"], "additionalProperties": False}  # fmt: skip
    body = {"messages": USER, "max_tokens": 60, "temperature": 1.0, "seed": 1, "response_format": _schema(tree)}
    reply = _post(server, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    jsonschema.validate(json.loads(reply.json()["choices"][0]["message"]["content"]), tree)
    grammar = 'start: x\nx: "a" x | "b"'  # greedy rollout never ends it ("a" first); the analysis proves it can
    out = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 30, "guided_grammar": grammar})
    assert out.status_code == 200, out.text
    choice = out.json()["choices"][0]
    text = choice["text"]
    assert set(text[:-1]) <= {"a"} and (text.endswith("b") or choice["finish_reason"] == "length"), choice


def test_anthropic_forced_tool_whose_schema_has_no_finite_value_is_a_400(server):
    dead = {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"],
            "$defs": NESTED_ARRAYS["$defs"]}  # fmt: skip
    good = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    body = {"model": "tiny-test", "max_tokens": 64, "messages": USER, "tool_choice": {"type": "any"}}
    reply = httpx.post(server.base_url + "/v1/messages", headers=AUTH, timeout=60,
                       json={**body, "tools": [{"name": "f", "input_schema": dead}]})  # fmt: skip
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "invalid_request_error"
    assert "no complete output" in reply.json()["error"]["message"]
    control = httpx.post(server.base_url + "/v1/messages", headers=AUTH, timeout=60,
                         json={**body, "tools": [{"name": "f", "input_schema": good}]})  # fmt: skip
    assert control.status_code == 200, control.text
    uses = [b for b in control.json()["content"] if b["type"] == "tool_use"]
    assert uses and all(isinstance(u["input"]["x"], int) for u in uses)


# ---- a grammar that fails in the middle of one sequence ---------------------------------------------------------
TARGET = "[a-z]{40}"  # the request whose matcher the tests break; its grammar text holds this pattern


@pytest.fixture
def break_target(monkeypatch, server):
    """Make the TARGET request's matcher fail before its 4th mask (3 tokens in): it consumes EOS, which its grammar
    refuses, as a parser resource limit would fail it. Other requests' matchers are left alone."""
    fill, calls = runner_module.fill_bitmask_batch, {}
    eos = server.tokenizer.eos_token_id

    def failing(view, rows, bitmask):
        for matcher, _ in rows:
            if TARGET in matcher.grammar.source:
                calls[id(matcher)] = calls.get(id(matcher), 0) + 1
                if calls[id(matcher)] == 4:
                    assert not matcher.ll.consume_token(eos) and matcher.ll.is_error()
        fill(view, rows, bitmask)

    monkeypatch.setattr(runner_module, "fill_bitmask_batch", failing)
    return calls


@pytest.fixture
def raise_in_steering(monkeypatch):
    """Make the host work of the TARGET request's sequence raise 3 tokens in (as `path[0]` on an empty closing
    path once did, ending the engine thread)."""
    steered = steer_module.steered_token

    def raising(seq):
        if TARGET in seq.matcher.grammar.source and len(seq.outputs) >= 3:
            raise IndexError("list index out of range")
        return steered(seq)

    monkeypatch.setattr(steer_module, "steered_token", raising)


def _target(stream: bool = False) -> dict:
    return {"messages": USER, "max_tokens": 60, "temperature": 1.0, "seed": 0, "guided_regex": TARGET,
            "stream": stream}  # fmt: skip


def _concurrent_with_a_good_request(server, target: dict) -> tuple[httpx.Response, httpx.Response]:
    good = {"prompt": "hi", "max_tokens": 40, "temperature": 1.0, "seed": 2, "guided_json": GOOD}
    with ThreadPoolExecutor(2) as pool:
        failing = pool.submit(_post, server, "/v1/chat/completions", target)
        other = pool.submit(_post, server, "/v1/completions", good)
        return failing.result(), other.result()


@pytest.mark.parametrize("fault", ["break_target", "raise_in_steering"])
def test_a_sequence_whose_grammar_fails_ends_alone(server, fault, request):
    control = _post(server, "/v1/chat/completions", _target())  # without the fault: a complete, matching output
    assert control.status_code == 200 and len(control.json()["choices"][0]["message"]["content"]) == 40
    request.getfixturevalue(fault)
    failed, other = _concurrent_with_a_good_request(server, _target())
    assert failed.status_code == 400, failed.text
    error = failed.json()["error"]
    assert error["param"] == "guided_regex" and "after 3 token(s)" in error["message"], error
    assert other.status_code == 200, other.text
    jsonschema.validate(json.loads(other.json()["choices"][0]["text"]), GOOD)
    server.wait_idle()
    assert server.kv_in_use() == 0  # the failed request's KV was freed
    _still_serving(server)


def test_a_streamed_sequence_whose_grammar_fails_ends_with_an_error_event(server, break_target):
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": "tiny-test", **_target(stream=True)}) as reply:  # fmt: skip
        assert reply.status_code == 200
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    *chunks, last = [json.loads(e) for e in events]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(text) >= 3 and text.isalpha()  # the tokens before the failure went out
    assert last["error"]["param"] == "guided_regex" and "no way forward" in last["error"]["message"], last
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks if c["choices"])  # never labelled complete
    _still_serving(server)


def test_completions_whose_grammar_fails_end_with_a_400_or_an_error_event(server, break_target):
    body = {"prompt": "hi", "max_tokens": 60, "guided_regex": TARGET, "n": 2}
    reply = _post(server, "/v1/completions", body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "guided_regex", reply.text
    with httpx.stream("POST", server.base_url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "tiny-test", **body, "stream": True}) as streamed:  # fmt: skip
        events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events and json.loads(events[-1])["error"]["param"] == "guided_regex", events[-1]
    server.wait_idle()
    assert server.kv_in_use() == 0  # both sequences' KV freed (the one that failed and its aborted sibling)


def test_anthropic_request_whose_grammar_fails_is_a_400_in_its_shape(server, monkeypatch):
    steered = steer_module.steered_token

    def raising(seq):  # the forced tool call's host work fails 3 tokens in
        if seq.params.grammar.param == "tool_choice" and len(seq.outputs) >= 3:
            raise IndexError("list index out of range")
        return steered(seq)

    monkeypatch.setattr(steer_module, "steered_token", raising)
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    body = {"model": "tiny-test", "max_tokens": 64, "messages": USER, "tools": [tool], "tool_choice": {"type": "any"}}
    reply = httpx.post(server.base_url + "/v1/messages", headers=AUTH, timeout=60, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "invalid_request_error"
    assert "tool_choice" in reply.json()["error"]["message"]
    with httpx.stream("POST", server.base_url + "/v1/messages", headers=AUTH, timeout=60,
                      json={**body, "stream": True}) as streamed:  # fmt: skip
        lines = list(streamed.iter_lines())
    assert "event: error" in lines and "event: message_stop" not in lines
    error = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))
    assert error["error"]["type"] == "invalid_request_error" and "IndexError" in error["error"]["message"]
    monkeypatch.undo()
    _still_serving(server)

"""Forced tool calls through the grammar, on the tiny random model (it never writes a valid call by itself): OpenAI
`tool_choice` "required" / a named function and Anthropic `tool_choice` any / tool always return calls whose
arguments validate against the tool's parameters (jsonschema), streaming and not, at temperature 1 over several
seeds; `parallel_tool_calls: false` / `disable_parallel_tool_use` give exactly one call; "auto" (unconstrained) is
the negative control. Also the grammar's text itself, with `<tool_call>` as a special token.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from astrai.serve.tool_calls import parse_tool_calls
from astrai.serve.tools_common import call_schema, forced_call_grammar, function_tool

MODEL = "tiny-test"
USER = [{"role": "user", "content": "what is the weather?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -9, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
PARAMS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in PARAMS.items()]
SEEDS = range(8)
BUDGET = 400  # tokens: a few calls of the tiny tokenizer's short tokens


def _each_seed(fn) -> list:
    """`fn(seed)` for every seed, concurrently (the engine batches them)."""
    with ThreadPoolExecutor(len(SEEDS)) as pool:
        return list(pool.map(fn, SEEDS))


def _valid(name: str, arguments: dict) -> None:
    jsonschema.validate(arguments, PARAMS[name])


def _stream_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            reason = c.finish_reason or reason
    return calls, reason, content


@pytest.mark.parametrize("stream", [False, True])
def test_required_always_calls_a_tool_with_valid_arguments(oai, stream):
    def one(seed: int) -> None:
        kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                      max_tokens=BUDGET)  # fmt: skip
        if stream:
            calls, reason, content = _stream_calls(oai.chat.completions.create(**kwargs, stream=True))
            got = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
        else:
            choice = oai.chat.completions.create(**kwargs).choices[0]
            reason, content = choice.finish_reason, choice.message.content
            got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
        assert reason == "tool_calls" and got and not content, (seed, reason, content)
        for name, args in got:
            _valid(name, args)

    _each_seed(one)


def test_named_function_and_parallel_false_give_exactly_that_one_call(oai):
    def one(seed: int) -> set[str]:
        names = set()
        for choice, parallel in (({"type": "function", "function": {"name": "add"}}, False), ("required", False)):
            reply = oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice,
                                                parallel_tool_calls=parallel, temperature=1.0, seed=seed,
                                                max_tokens=BUDGET)  # fmt: skip
            (call,) = reply.choices[0].message.tool_calls
            assert reply.choices[0].finish_reason == "tool_calls"
            if isinstance(choice, dict):
                assert call.function.name == "add"
            names.add(call.function.name)
            _valid(call.function.name, json.loads(call.function.arguments))
        return names

    assert set().union(*_each_seed(one)) == {"add", "get_weather"}  # "required" picks among the tools


def test_auto_on_the_random_model_makes_no_valid_call(oai):
    def one(seed: int) -> bool:
        reply = oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="auto",
                                            temperature=1.0, seed=seed, max_tokens=64)  # fmt: skip
        return bool(reply.choices[0].message.tool_calls)

    assert sum(_each_seed(one)) <= 1


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_any_and_tool_are_constrained_the_same_way(anth, stream):
    tools = [{"name": n, "input_schema": p} for n, p in PARAMS.items()]

    def one(seed: int) -> None:
        choice = {"type": "any"} if seed % 2 else {"type": "tool", "name": "get_weather"}
        if seed % 4 == 3:
            choice = {**choice, "disable_parallel_tool_use": True}
        kwargs = dict(model="m", max_tokens=BUDGET, messages=USER, tools=tools, tool_choice=choice,
                      extra_body={"temperature": 1.0, "seed": seed})  # fmt: skip
        if stream:
            with anth.messages.stream(**kwargs) as s:
                reply = s.get_final_message()
        else:
            reply = anth.messages.create(**kwargs)
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and uses, (seed, reply)
        assert all(b.type == "tool_use" for b in reply.content)
        if choice.get("disable_parallel_tool_use"):
            assert len(uses) == 1
        for block in uses:
            assert choice["type"] == "any" or block.name == "get_weather"
            _valid(block.name, block.input)

    _each_seed(one)


def test_forced_grammar_with_a_response_format_is_still_a_400(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=4,
                                    response_format={"type": "json_object"})  # fmt: skip
    assert err.value.body["param"] == "response_format"


def test_grammar_text_and_special_tags():
    class Tok:  # `<tool_call>` / `</tool_call>` as special tokens 7 and 8
        special_token_ids = frozenset({7, 8})

        def encode(self, text, add_special_tokens=False):
            return {"<tool_call>": [7], "</tool_call>": [8]}.get(text, [1, 2])

    tools = [function_tool(n, None, p) for n, p in PARAMS.items()]
    plain, special = forced_call_grammar(tools, "add", parallel=False)
    assert not special and plain.count("%json") == 1 and '"<tool_call>"' in plain and "call (" not in plain
    text, special = forced_call_grammar(tools, tokenizer=Tok())
    assert special and "<[7]>" in text and "<[8]>" in text and text.count("%json") == 2
    with pytest.raises(ValueError):
        forced_call_grammar(tools, "missing")
    # $defs move to the root, so the parameters' references still resolve
    schema = call_schema("f", {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}},
                               "$defs": {"X": {"type": "integer"}}})  # fmt: skip
    jsonschema.validate({"name": "f", "arguments": {"x": 1}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "f", "arguments": {"x": "no"}}, schema)
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')[1][0].name == "f"

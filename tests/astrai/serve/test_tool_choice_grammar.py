"""Forced tool calls through the grammar, on the tiny random model (it never writes a valid call by itself): OpenAI
`tool_choice` "required" / a named function and Anthropic `tool_choice` any / tool always return calls whose
arguments validate against the tool's parameters (jsonschema), streaming and not, at temperature 1 over several
seeds; `parallel_tool_calls: false` / `disable_parallel_tool_use` give exactly one call. tool_choice "auto": its
grammar accepts text or text then well-formed calls (token by token, plain and special-token tags), and a model
pushed to open a call always finishes a valid one, where the same push without the grammar never does (the
negative control). Also the grammar's text itself, with `<tool_call>` as a special token.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import attrs
import jsonschema
import openai
import pytest

from astrai.serve.tool_calls import parse_tool_calls
from astrai.serve.tool_grammars import call_schema, forced_call_grammar
from astrai.serve.tools_common import function_tool
from helpers import engine_with_added_tokens, grammar_takes

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
        kwargs = dict(model="tiny-test", max_tokens=BUDGET, messages=USER, tools=tools, tool_choice=choice,
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
    plain, special, _ = forced_call_grammar(tools, "add", parallel=False)
    assert not special and plain.count("%json") == 1 and '"<tool_call>"' in plain and "call_rest)*" not in plain
    text, special, _ = forced_call_grammar(tools, tokenizer=Tok())
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


# ---- tool_choice "auto": text, or text then well-formed calls ------------------------------------------------
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
AUTO_CASES = [  # (output, allowed with parallel calls, allowed with one call)
    ("Plain text, no call at all.", True, True),
    ("", True, True),
    ("Let me add them.\n" + CALL, True, True),
    (CALL + "\n" + CALL, True, False),
    ("text that writes <tool_call> and goes on", False, False),  # the tag only ever starts a real call
    ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False, False),  # not a tool
    ('<tool_call>\n{"name": "add", "arguments": {"a": 100, "b": 2}}\n</tool_call>', False, False),  # a > 99
    (CALL + " and text after", False, False),
    ("an unfinished <tool", True, True),  # not the tag: text
]


@pytest.mark.parametrize("special_tags", [False, True])
def test_auto_grammar_takes_text_or_well_formed_calls(server, special_tags):
    from astrai.inference.grammar import build_view, compile_grammar
    from astrai.io.tokenizer import train_tokenizer
    from astrai.serve.tool_grammars import auto_call_grammar

    tok = server.tokenizer
    if special_tags:  # `<tool_call>` / `</tool_call>` as special tokens, as in real Qwen vocabularies
        corpus = [text for text, _, _ in AUTO_CASES] * 3
        tok = train_tokenizer(corpus, vocab_size=400, special_tokens=("<|endoftext|>", "<tool_call>", "</tool_call>"))
    view = build_view(tok, vocab_size=tok.vocab_size)
    tools = [function_tool(n, None, p) for n, p in PARAMS.items()]
    for parallel in (True, False):
        source, special, _ = auto_call_grammar(tools, parallel=parallel, tokenizer=tok)
        assert special == special_tags
        grammar = compile_grammar(view, source)
        for text, many, one in AUTO_CASES:
            if special_tags and "<tool_call> and" in text:
                continue  # with special tags that text is the plain-text spelling, which the grammar also refuses
            ids = tok.encode(text, add_special_tokens=False)
            assert grammar_takes(view, grammar, ids) == (many if parallel else one), (parallel, text)


@pytest.fixture(scope="module")
def tag_engine():
    """A tiny random model whose vocabulary has `<tool_call>` / `</tool_call>` as added plain (not special) tokens,
    as Qwen2.5's has, so a logit_bias can make it open a call at once; the grammar must then finish the call."""
    with engine_with_added_tokens([CALL, "plain words here"] * 20, ["<tool_call>", "</tool_call>"]) as engine:
        yield engine


@pytest.mark.parametrize("parallel", [False, True])
def test_a_call_the_model_starts_under_auto_is_always_finished_and_valid(tag_engine, parallel):
    from astrai.inference.params import GrammarSpec, SamplingParams
    from astrai.serve.tool_grammars import auto_call_grammar

    tok = tag_engine.model.tokenizer
    tag = tok.encode("<tool_call>", add_special_tokens=False)[0]
    source, _, _ = auto_call_grammar([function_tool(n, None, p) for n, p in PARAMS.items()], parallel=parallel)
    grammar = GrammarSpec(kind="lark", source=source, param="tool_choice")
    prompt = tok.encode("plain words", add_special_tokens=False)
    runs = [SamplingParams(max_tokens=BUDGET, temperature=1.0, seed=s, logit_bias={tag: 100.0}, grammar=grammar)
            for s in SEEDS]  # fmt: skip
    for out in tag_engine.generate([prompt] * len(runs), runs):
        text = out.outputs[0].text
        rest, calls = parse_tool_calls(text)
        assert text.startswith("<tool_call>") and calls and not rest.strip(), text  # the push worked
        assert out.outputs[0].finish_reason == "stop" and (parallel or len(calls) == 1), text
        for call in calls:
            _valid(call.name, json.loads(call.arguments))
    # negative control: the same push without the grammar opens calls it never finishes into valid ones
    free = [attrs.evolve(p, grammar=None, max_tokens=64) for p in runs]
    broken = [out.outputs[0].text for out in tag_engine.generate([prompt] * len(free), free)]
    assert all(t.startswith("<tool_call>") for t in broken)
    assert not any(parse_tool_calls(t)[1] for t in broken)


def test_anthropic_auto_is_constrained_too(anth, monkeypatch):
    from astrai.serve.anthropic_protocol import parse_request, sampling_params

    body = {"model": "tiny-test", "max_tokens": 64, "messages": USER,
            "tools": [{"name": n, "input_schema": p} for n, p in PARAMS.items()]}  # fmt: skip
    auto = sampling_params(parse_request(body))
    assert auto.grammar is not None and "lead[stop=" in auto.grammar.source and "call_rest)*" in auto.grammar.source
    single = sampling_params(
        parse_request({**body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}})
    )
    assert "call_rest)*" not in single.grammar.source
    assert "[TOOL_CALLS]" in sampling_params(parse_request(body), tool_parser="mistral").grammar.source
    assert sampling_params(parse_request({**body, "tool_choice": {"type": "none"}})).grammar is None
    reply = anth.messages.create(**body, extra_body={"temperature": 1.0, "seed": 1})  # the real route takes it
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")

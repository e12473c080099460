"""The admission check of grammars (`astrai.inference.grammar_check`) and the engine's per-sequence failure path.

`never_completes` proves a grammar's language empty (every derivation recurs for ever) for JSON schemas, Lark and
GBNF, and says nothing (None) for grammars that can end, including the ones the greedy closing rollout cannot
finish and every tool-call grammar of the server; `Engine.compile_grammar` refuses the empty ones with an
EngineInputError naming the field. A closing rollout from a failed matcher is None (it once returned [] and the
steering read `path[0]`). A matcher that fails mid-sequence ends only its request (RequestFailedError), frees its
KV and leaves a concurrent request's output intact.
"""

from __future__ import annotations

import json

import pytest

import astrai
from astrai.inference import closing
from astrai.inference.engine import Engine, EngineConfig, RequestFailedError
from astrai.inference.errors import EngineInputError
from astrai.inference.grammar import grammar_source, new_matcher
from astrai.inference.grammar_check import never_completes
from astrai.inference.params import GrammarSpec, SamplingParams
from astrai.serve.tool_grammars import FORMATS, tool_call_grammar
from helpers import tiny_model_dir

NESTED = {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}}, "$ref": "#/$defs/n"}
EMPTY = [  # (kind, source): languages with no finite string
    ("json_schema", {"$ref": "#"}),
    ("json_schema", {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    ("json_schema", NESTED),
    ("json_schema", {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}),
    ("json_schema", {"allOf": [{"type": "object"}, {"$ref": "#/$defs/x"}], "$defs": {"x": {"$ref": "#"}}}),
    ("json_schema", {"anyOf": [{"$ref": "#"}, {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}]}),
    ("lark", 'start: "a" start'),
    ("lark", 'start: ("a" | "b") start'),
    ("lark", 'start: x+\nx: "(" x ")"'),
    ("lark", "root ::= a\na ::= a"),  # GBNF
    ("lark", 'root ::= "[" root "]"'),
]
FINITE = [  # can end (some only after choices the greedy rollout does not make)
    ("json_schema", {"type": "array", "items": {"$ref": "#"}}),
    ("json_schema", {"type": "object", "properties": {"me": {"$ref": "#"}}}),
    ("json_schema", {"anyOf": [{"$ref": "#"}, {"type": "integer"}]}),
    ("json_schema", {"$ref": "https://example.com/remote.json"}),  # not modelled: never refused
    ("json_schema", {"required": ["me"], "properties": {"me": {"$ref": "#"}}}),  # no type: a number will do
    ("lark", 'start: x\nx: "a" x | "b"'),
    ("lark", 'start: ("a" | "b")* "c"'),
    ("lark", 'start: x*\nx: "(" x ")"'),
    ("lark", 'start: x ~ 0..3\nx: "(" x ")"'),
    ("lark", 'root ::= "a" root | "b"'),
    ("regex", r"\d{3}-\d{4}"),
]


def _source(kind: str, source) -> str:
    return grammar_source(GrammarSpec(kind=kind, source=json.dumps(source) if kind == "json_schema" else source))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("check") / "m"))


@pytest.mark.parametrize(("kind", "source"), EMPTY)
def test_empty_languages_are_proven_empty(kind, source):
    assert never_completes(_source(kind, source)) is not None


@pytest.mark.parametrize(("kind", "source"), FINITE)
def test_languages_that_can_end_are_not(kind, source):
    assert never_completes(_source(kind, source)) is None


def test_lark_the_analysis_does_not_read_is_never_refused():
    assert never_completes("start: _t{1}\n_t{x}: x") is None  # a template
    assert never_completes('start: "a" start | %lark { x }') is None  # a nested grammar
    assert never_completes('start: "a" start') is not None  # the same reader does refuse what it models


def test_every_tool_call_grammar_can_end(model):
    tools = [{"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "tree": {"$ref": "#/$defs/t"}},
        "required": ["city"], "$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}}]  # fmt: skip
    for fmt in FORMATS:
        for forced in (None, ""):
            spec, _ = tool_call_grammar(tools, forced, parallel=True, tokenizer=model.tokenizer, tool_parser=fmt)
            assert never_completes(grammar_source(spec)) is None, (fmt, forced)


def test_the_engine_refuses_empty_languages_naming_the_field(model):
    with Engine(model, EngineConfig(compile=False, background=False, kv_budget_tokens=2048)) as engine:
        for kind, source in EMPTY[:3] + [("regex", r"[^\x00-\U0010FFFF]")]:
            spec = GrammarSpec(kind=kind, source=json.dumps(source) if kind == "json_schema" else source,
                               param="response_format")  # fmt: skip
            with pytest.raises(EngineInputError, match="^response_format: the grammar") as err:
                engine.submit("hi", SamplingParams(max_tokens=4, grammar=spec))
            assert err.value.param == "response_format"
        assert not engine.scheduler.has_work()


def test_a_failed_matcher_has_no_closing_path_and_steers_nothing(model):
    with Engine(model, EngineConfig(compile=False, background=False, kv_budget_tokens=2048)) as engine:
        grammar = engine.compile_grammar(GrammarSpec(kind="regex", source="[a-z]{20}"))
    matcher = new_matcher(grammar)
    assert closing.closing_path(matcher, 100) is not None  # the negative control
    assert not matcher.ll.consume_token(model.tokenizer.eos_token_id) and matcher.ll.is_error()
    assert closing.closing_path(matcher, 100) is None  # was [] (then `path[0]`: IndexError)
    assert closing.Steering().next_token(matcher, produced=5, remaining=3) is None


def test_a_matcher_that_fails_mid_sequence_ends_only_its_request(model):
    config = EngineConfig(compile=False, background=False, kv_budget_tokens=2048, prefix_cache=False)
    with Engine(model, config) as engine:
        doomed = engine.submit("hi", SamplingParams(max_tokens=30, grammar=GrammarSpec(
            kind="regex", source="[a-z]{20}", param="guided_regex"), n=2))  # fmt: skip
        other = engine.submit("hi", SamplingParams(max_tokens=30, seed=1, grammar=GrammarSpec(
            kind="regex", source="[0-9]{10}")))  # fmt: skip
        seqs = engine._tracked[doomed.request_id].seqs
        for _ in range(4):  # prefill and a few tokens
            engine.step()
        assert all(len(s.outputs) >= 2 for s in seqs)
        seqs[1].matcher.ll.consume_token(model.tokenizer.eos_token_id)  # refused: the matcher is in error now
        with pytest.raises(RequestFailedError, match="^guided_regex: the grammar reached a state with no way") as err:
            doomed.result()
        assert err.value.param == "guided_regex"
        assert seqs[0].finish_reason == "abort" and seqs[1].finish_reason == "error"
        out = other.result().outputs[0]
        assert out.finish_reason == "stop" and len(out.text) == 10 and out.text.isdigit()
        assert not engine.scheduler.has_work() and engine.stats().kv_pages_used == 0
        assert engine.unavailable is None

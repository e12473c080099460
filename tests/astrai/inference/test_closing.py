"""Budget-aware closing (`astrai.inference.closing`): a constrained output that reaches `max_tokens` still parses.

On the tiny random model (which never writes JSON by itself) a schema with unbounded strings, arrays and numbers,
at temperature 1 over many seeds and budgets (2 to 70 tokens more than the schema's shortest document): with
closing, every output validates (jsonschema), finishes "stop" within its last `MARGIN` budget tokens, and those
that were steered say so in `stop_reason`; with closing switched off (the negative control) the same requests are
cut mid-JSON ("length", unparseable). Also the closing path on its own, and forced tool calls whose budget is
tight.
"""

from __future__ import annotations

import json

import pytest

import astrai
from astrai.inference import closing
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.grammar import accept, is_finished, new_matcher
from astrai.inference.params import GrammarSpec, SamplingParams
from helpers import tiny_model_dir, valid_json

SCHEMA = {  # unbounded on purpose: a weak model can stay in a string, an array or a number for ever
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
        "inner": {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]},
    },
    "required": ["name", "tags", "score", "inner"],
    "additionalProperties": False,
}
JSON = GrammarSpec(kind="json_schema", source=json.dumps(SCHEMA))
PROMPT = "the quick brown fox jumps over the lazy dog"
EXTRA = (2, 12, 30, 70)  # budgets: the schema's shortest document (in this tokenizer's tokens) plus these
SEEDS = range(6)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("closing") / "m"))


def _valid(text: str) -> bool:
    return valid_json(text, SCHEMA)


def _run(model, extra=EXTRA):
    with Engine(model, EngineConfig(compile=False, background=False, kv_budget_tokens=8192)) as engine:
        shortest = len(closing.closing_path(new_matcher(engine.compile_grammar(JSON)), limit=500))
        params = [SamplingParams(max_tokens=shortest + e, temperature=1.0, seed=s, grammar=JSON)
                  for e in extra for s in SEEDS]  # fmt: skip
        return [c.outputs[0] for c in engine.generate([PROMPT] * len(params), params)], params


def test_every_constrained_output_fits_its_budget_and_parses(model):
    outs, params = _run(model)
    for out, p in zip(outs, params, strict=True):
        assert out.finish_reason == "stop" and _valid(out.text), (p.max_tokens, out.text)
        # the budget is used up to its last MARGIN tokens: the model wrote freely until the end came near
        assert p.max_tokens - closing.MARGIN <= len(out.token_ids) <= p.max_tokens, (p.max_tokens, out.text)
    assert any(o.stop_reason == "budget" for o in outs) and all(o.stop_reason in (None, "budget") for o in outs)


def test_without_closing_the_same_requests_are_cut(model, monkeypatch):
    monkeypatch.setattr(closing, "WINDOW", 0)  # never steer: the behaviour before (and vLLM's)
    outs, _ = _run(model, extra=EXTRA[:2])
    cut = [o for o in outs if o.finish_reason == "length"]
    assert cut and not any(_valid(o.text) for o in cut)
    assert all(o.stop_reason is None for o in outs)


def test_closing_path_finishes_the_grammar(model):
    with Engine(model, EngineConfig(compile=False, background=False, kv_budget_tokens=4096)) as engine:
        grammar = engine.compile_grammar(JSON)
    tok = model.tokenizer
    matcher = new_matcher(grammar)
    for t in tok.encode('{"name":"abc', add_special_tokens=False):  # inside the first string
        assert accept(matcher, t)
    path = closing.closing_path(matcher, limit=200, prefix=b'{"name":"abc')
    assert path is not None and 0 < len(path) < 60
    for t in path:  # the path is a valid completion: a copy of the matcher takes it and finishes
        assert accept(matcher, t)
    assert is_finished(matcher)
    text = '{"name":"abc' + tok.decode([t for t in path if t not in model.eos_token_ids])
    assert _valid(text), text
    shortest = closing.closing_path(new_matcher(grammar), limit=500)
    assert _valid(tok.decode([t for t in shortest if t not in model.eos_token_ids]))  # the minimal document
    assert closing.closing_path(new_matcher(grammar), limit=len(shortest) - 1) is None  # too short a limit


def test_forced_tool_call_with_a_tight_budget_still_parses(model):
    from astrai.serve.tool_calls import parse_tool_calls
    from astrai.serve.tool_grammars import forced_call_grammar
    from astrai.serve.tools_common import function_tool

    tools = [function_tool("note", None, {"type": "object", "properties": {"text": {"type": "string"}},
                                          "required": ["text"]})]  # fmt: skip
    source, _, _ = forced_call_grammar(tools, parallel=False)
    spec = GrammarSpec(kind="lark", source=source, param="tool_choice")
    with Engine(model, EngineConfig(compile=False, background=False, kv_budget_tokens=8192)) as engine:
        # this tokenizer spells the markup nearly a character per token: the shortest call is longer than WINDOW
        shortest = len(closing.closing_path(new_matcher(engine.compile_grammar(spec)), limit=500))
        assert shortest > closing.WINDOW
        params = [SamplingParams(max_tokens=shortest + e, temperature=1.0, seed=s, grammar=spec)
                  for e in (1, 20) for s in SEEDS]  # fmt: skip
        outs = [c.outputs[0] for c in engine.generate([PROMPT] * len(params), params)]
    for out in outs:
        rest, calls = parse_tool_calls(out.text)
        assert out.finish_reason == "stop" and len(calls) == 1 and not rest.strip(), out.text
        assert "text" in json.loads(calls[0].arguments)


def test_free_text_under_tool_choice_auto_is_not_cut_early(model):
    """A grammar that may end where it stands (text under the "auto" tool grammar) is left alone: the budget
    runs out as usual ("length", every token used), no steering."""
    from astrai.serve.tool_grammars import auto_call_grammar
    from astrai.serve.tools_common import function_tool

    source, _, _ = auto_call_grammar([function_tool("note", None, {"type": "object"})])
    spec = GrammarSpec(kind="lark", source=source, param="tool_choice")
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, grammar=spec) for s in SEEDS]
    with Engine(model, EngineConfig(compile=False, background=False, kv_budget_tokens=8192)) as engine:
        outs = [c.outputs[0] for c in engine.generate([PROMPT] * len(params), params)]
    texts = [o for o in outs if "<tool_call>" not in o.text]
    assert texts and all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in texts)
    assert all(o.stop_reason is None for o in texts)


def _forced(model, fmt: str, params_schema: dict, extra: tuple[int, ...], *, parallel: bool, closers: bool = True):
    """Forced calls in `fmt` to one tool at budgets of the shortest call plus `extra`: (outputs, parsed calls)."""
    import attrs

    from astrai.serve.tool_grammars import tool_call_grammar
    from astrai.serve.tool_parsers import parse
    from astrai.serve.tools_common import function_tool

    tools = [function_tool("note", None, params_schema)]
    spec, _ = tool_call_grammar(tools, "", parallel=parallel, tool_parser=fmt)
    with Engine(model, EngineConfig(compile=False, background=False, kv_budget_tokens=16384)) as engine:
        shortest = len(closing.closing_path(new_matcher(engine.compile_grammar(spec)), limit=500, closers=spec.closers))
        spec = spec if closers else attrs.evolve(spec, closers=())
        params = [SamplingParams(max_tokens=shortest + e, temperature=1.0, seed=s, grammar=spec)
                  for e in extra for s in SEEDS]  # fmt: skip
        outs = [c.outputs[0] for c in engine.generate([PROMPT] * len(params), params)]
    parsed = [parse(fmt, o.text, ["note"], {"note": params_schema}) for o in outs]
    return outs, parsed


def test_parallel_forced_calls_end_where_no_further_call_fits(model):
    """Forced calls may go on after each complete call; when the rest of the budget could not hold another, the
    output ends there (EOS forced, stop_reason "budget"): every output is complete calls, never one cut short."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    outs, parsed = _forced(model, "hermes", schema, (1, 90), parallel=True)
    for out, (text, calls) in zip(outs, parsed, strict=True):
        assert out.finish_reason == "stop" and calls and not text, out.text
    assert any(len(calls) > 1 for _, calls in parsed)  # the model did write several calls
    assert any(o.stop_reason == "budget" for o in outs)


def test_a_qwen3_coder_text_value_is_closed_by_its_closer(model):
    """A qwen3_coder string parameter is free text up to `</parameter>`; the grammar names `\\n</parameter>` as its
    closer and the rollout writes it, so tight budgets still end in a complete call. Without the closer (the negative
    control) the rollout cannot leave the text and the same requests are cut."""
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    outs, parsed = _forced(model, "qwen3_coder", schema, (4,), parallel=False)
    for out, (text, calls) in zip(outs, parsed, strict=True):
        assert out.finish_reason == "stop" and len(calls) == 1 and not text, out.text
        assert isinstance(json.loads(calls[0].arguments)["text"], str)
    outs, parsed = _forced(model, "qwen3_coder", schema, (4,), parallel=False, closers=False)
    assert any(o.finish_reason == "length" and not calls for o, (_, calls) in zip(outs, parsed, strict=True))

"""Tool-call grammars in every format (`tool_grammars`): hermes, qwen3_coder, mistral (list, spaced list, v11
`[ARGS]`), llama3_json, deepseek_v3 (V3 fenced, V3.1).

- Reference outputs, written as each family's chat template renders an assistant's tool calls, are accepted token by
  token by the format's forced and auto grammars, and the format's own parser reads them back (grammar and parser
  agree); malformed or invalid calls, and text around forced calls, are refused.
- On the tiny random model (it never writes a call by itself), forced calls in every format parse with that
  format's parser and validate with `jsonschema`, at temperature 1 over several seeds, at a tight budget too.
- Under tool_choice "auto", a model pushed to open a call (logit_bias on the format's opening token) always finishes
  a valid one; without the grammar the same push never does (the negative control).
- Through the HTTP API (openai and anthropic SDKs) with the server's parser set to each format.
"""

from __future__ import annotations

import json

import attrs
import jsonschema
import openai
import pytest

from astrai.serve.tool_grammars import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    auto_call_grammar,
    forced_call_grammar,
    tool_call_grammar,
)
from astrai.serve.tool_parsers import parse, tool_schemas
from astrai.serve.tools_common import function_tool
from helpers import engine_with_added_tokens, grammar_takes

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "code"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]},
                          "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 9},
                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
                          "exact": {"type": "boolean"}, "note": {"type": "string"}}}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -9, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
PARAMS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [function_tool(n, None, p) for n, p in PARAMS.items()]
W = ("get_weather", {"city": "Paris", "unit": "c", "code": "CDG", "days": 3})
A = ("add", {"a": 1, "b": 2})
# (format, a chat template marker that picks the variant, or "")
VARIANTS = [("hermes", ""), ("qwen3_coder", ""), ("mistral", ""), ("mistral", '{{- "[TOOL_CALLS] [" }}'),
            ("mistral", "[TOOL_CALLS]{{ name }}[ARGS]"), ("llama3_json", ""), ("deepseek_v3", "```json"),
            ("deepseek_v3", "V3.1")]  # fmt: skip
IDS = [f"{f}-{t[:12]}" if t else f for f, t in VARIANTS]


def _json(args: dict) -> str:
    return json.dumps(args, separators=(", ", ": "))  # tojson's separators, as templates render


def reference(fmt: str, template: str, calls: list[tuple[str, dict]]) -> str:
    """The calls as the family's chat template writes an assistant's tool calls."""
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{_json({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if fmt == "qwen3_coder":

        def one(n: str, a: dict) -> str:
            ps = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else _json(v)}\n</parameter>\n" for k, v in a.items()
            )
            return f"<tool_call>\n<function={n}>\n{ps}</function>\n</tool_call>"

        return "\n".join(one(n, a) for n, a in calls)
    if fmt == "mistral" and "[ARGS]" in template:
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{_json(a)}" for n, a in calls)
    if fmt == "mistral":
        lead = " [" if "[TOOL_CALLS] [" in template else "["
        return "[TOOL_CALLS]" + lead + ", ".join(_json({"name": n, "arguments": a}) for n, a in calls) + "]"
    if fmt == "llama3_json":
        return "; ".join(_json({"name": n, "parameters": a}) for n, a in calls)
    if "```json" in template:
        body = "\n".join(f"{DS_CALL_BEGIN}function{DS_SEP}{n}\n```json\n{_json(a)}\n```{DS_CALL_END}" for n, a in calls)
    else:
        body = "".join(f"{DS_CALL_BEGIN}{n}{DS_SEP}{_json(a)}{DS_CALL_END}" for n, a in calls)
    return DS_CALLS_BEGIN + body + DS_CALLS_END


def _calls(fmt: str, text: str, forced: bool) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse(fmt, text, list(PARAMS), tool_schemas(TOOLS), forced=forced)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("fmt", "template"), VARIANTS, ids=IDS)
def test_reference_calls_are_what_the_grammars_take_and_the_parser_reads(server, fmt, template):
    from astrai.inference.grammar import build_view, compile_grammar, lark_grammar

    tok = server.tokenizer.with_chat_template(template or "{{ messages }}")
    view = build_view(tok, vocab_size=tok.vocab_size)

    def takes(source: str, text: str) -> bool:
        ids = tok.encode(text, add_special_tokens=False)
        return grammar_takes(view, compile_grammar(view, lark_grammar(source)), ids)

    one, two = reference(fmt, template, [W]), reference(fmt, template, [W, A])
    assert _calls(fmt, two, True) == ("", [W, A]) and _calls(fmt, one, False) == ("", [W])
    forced, _, _ = forced_call_grammar(TOOLS, tokenizer=tok, fmt=fmt)
    single, _, _ = forced_call_grammar(TOOLS, parallel=False, tokenizer=tok, fmt=fmt)
    named, _, _ = forced_call_grammar(TOOLS, "add", tokenizer=tok, fmt=fmt)
    auto, _, _ = auto_call_grammar(TOOLS, tokenizer=tok, fmt=fmt)
    assert takes(forced, one) and takes(forced, two) and takes(single, one) and not takes(single, two)
    assert takes(named, reference(fmt, template, [A])) and not takes(named, one)
    bad = [reference(fmt, template, [("add", {"a": 100, "b": 2})]),  # out of range
           reference(fmt, template, [("nope", {})]),  # not a tool
           reference(fmt, template, [("get_weather", {**W[1], "code": "cdg"})]),  # pattern
           reference(fmt, template, [("get_weather", {"city": "Paris"})]),  # required parameters missing
           one[:-3],  # cut short
           "Sure. " + one]  # fmt: skip
    for text in bad:
        assert not takes(forced, text), text
    # auto: text, or text then calls (llama3_json: a call is the whole output)
    assert takes(auto, "Plain text, no call.") and takes(auto, "") and takes(auto, two)
    assert takes(auto, "Let me check.\n" + two)  # llama3_json: all text (a call must be the whole output)
    assert not takes(auto, two + " and text after")
    lead = "" if fmt == "llama3_json" else "Let me check. "  # after text, llama3_json JSON is text
    for text in bad[:-1]:
        assert not takes(auto, lead + text), text
    if fmt == "llama3_json":
        assert not takes(auto, '{"not": "a call"}') and not takes(auto, "[1, 2]")


@pytest.mark.parametrize(("fmt", "template"), VARIANTS, ids=IDS)
def test_forced_calls_on_the_random_model_parse_in_every_format(server, fmt, template):
    from astrai.inference.params import SamplingParams

    tok = server.tokenizer.with_chat_template(template or "{{ messages }}")
    prompt = tok.encode("what is the weather?", add_special_tokens=False)
    runs = []
    for seed in range(6):  # any tool, several calls / the named one, exactly one; an ample and a tight budget
        named, parallel = ("add", False) if seed % 2 else (None, True)
        grammar, _ = tool_call_grammar(TOOLS, named or "", parallel=parallel, tokenizer=tok, tool_parser=fmt)
        runs.append((named, parallel, SamplingParams(max_tokens=400 if seed < 3 else 180, temperature=1.0, seed=seed,
                                                     grammar=grammar)))  # fmt: skip
    outs = server.engine.generate([prompt] * len(runs), [p for _, _, p in runs])
    for (named, parallel, _), out in zip(runs, outs, strict=True):
        text = out.outputs[0].text
        content, calls = _calls(fmt, text, True)
        assert calls and not content, text
        assert parallel or len(calls) == 1, text
        for name, args in calls:
            assert named in (None, name), text
            jsonschema.validate(args, PARAMS[name])


@pytest.fixture(scope="module")
def markup_engine():
    """A tiny random model whose vocabulary has every format's tool markup as added plain tokens (as real
    vocabularies have them), so a logit_bias can make it open a call at once."""
    corpus = [reference("hermes", "", [W, A]), "plain words here {}"] * 20
    markup = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN,
              DS_CALL_END, DS_SEP]  # fmt: skip
    with engine_with_added_tokens(corpus, markup) as engine:
        yield engine


@pytest.mark.parametrize(("fmt", "opener"), [("qwen3_coder", "<tool_call>"), ("mistral", "[TOOL_CALLS]"),
                                             ("llama3_json", "{"), ("deepseek_v3", DS_CALLS_BEGIN)])  # fmt: skip
def test_a_call_started_under_auto_is_finished_and_valid_in_every_format(markup_engine, fmt, opener):
    from astrai.inference.params import SamplingParams

    tok = markup_engine.model.tokenizer
    (tag,) = tok.encode(opener, add_special_tokens=False)
    grammar, _ = tool_call_grammar(TOOLS, None, parallel=True, tokenizer=tok, tool_parser=fmt)
    prompt = tok.encode("plain words", add_special_tokens=False)
    runs = [SamplingParams(max_tokens=300, temperature=1.0, seed=s, logit_bias={tag: 100.0}, grammar=grammar)
            for s in range(6)]  # fmt: skip
    for out in markup_engine.generate([prompt] * len(runs), runs):
        text = out.outputs[0].text
        content, calls = _calls(fmt, text, False)
        assert text.startswith(opener) and calls and not content, text  # the push worked, and the call parsed
        for name, args in calls:
            jsonschema.validate(args, PARAMS[name])
    # negative control: the same push without the grammar opens calls that never parse
    free = [attrs.evolve(p, grammar=None, max_tokens=64) for p in runs]
    for out in markup_engine.generate([prompt] * len(free), free):
        assert out.outputs[0].text.startswith(opener) and not _calls(fmt, out.outputs[0].text, False)[1]


@pytest.mark.parametrize("fmt", ["qwen3_coder", "mistral", "llama3_json", "deepseek_v3"])
def test_forced_calls_through_the_sdks_in_every_format(server, oai, anth, monkeypatch, fmt):
    monkeypatch.setattr(server.app.state, "tool_parser", fmt)
    user = [{"role": "user", "content": "what is the weather?"}]
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in PARAMS.items()]
    kwargs = dict(
        model="tiny-test", messages=user, tools=tools, tool_choice="required", temperature=1.0, max_tokens=400
    )
    choice = oai.chat.completions.create(**kwargs, seed=1).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and not choice.message.content
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    streamed: dict[int, list[str]] = {}
    for chunk in oai.chat.completions.create(**kwargs, seed=2, stream=True, parallel_tool_calls=False):
        for tc in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            part = streamed.setdefault(tc.index, ["", ""])
            part[0] += tc.function.name or ""
            part[1] += tc.function.arguments or ""
    ((name, arguments),) = streamed.values()
    jsonschema.validate(json.loads(arguments), PARAMS[name])
    reply = anth.messages.create(model="tiny-test", max_tokens=400, messages=user,
                                 tool_choice={"type": "tool", "name": "add"},
                                 tools=[{"name": n, "input_schema": p} for n, p in PARAMS.items()],
                                 extra_body={"temperature": 1.0, "seed": 3})  # fmt: skip
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and uses and all(b.type == "tool_use" for b in reply.content)
    for block in uses:
        assert block.name == "add"
        jsonschema.validate(block.input, ADD)
    if fmt == "qwen3_coder":  # a parameter name its markup cannot write: a 400 naming the tools, not a 500
        odd = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["a>b"],
                                                                              "properties": {"a>b": {}}}}}]  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(**{**kwargs, "tools": odd})
        assert err.value.body["param"] == "tools" and "cannot be written" in err.value.body["message"]


def test_special_token_markup_is_named_by_id():
    class Tok:  # every format's markup as special tokens 7..15
        special_token_ids = frozenset(range(7, 16))
        chat_template = "```json [ARGS]"
        marks = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", DS_CALLS_BEGIN, DS_CALLS_END,
                 DS_CALL_BEGIN, DS_CALL_END, DS_SEP]  # fmt: skip

        def encode(self, text, add_special_tokens=False):
            return [7 + self.marks.index(text)] if text in self.marks else [1, 2]

    for fmt in ("hermes", "qwen3_coder", "mistral", "deepseek_v3"):
        for source, special, _ in (forced_call_grammar(TOOLS, tokenizer=Tok(), fmt=fmt),
                                   auto_call_grammar(TOOLS, tokenizer=Tok(), fmt=fmt)):  # fmt: skip
            assert special and "<[" in source, fmt
    grammar, special = tool_call_grammar(TOOLS, "", parallel=True, tokenizer=Tok(), tool_parser="llama3_json")
    assert not special and grammar.closers == ()
    grammar, _ = tool_call_grammar(TOOLS, "", parallel=True, tool_parser="qwen3_coder")
    assert grammar.closers == ("\n</parameter>",)  # budget-aware closing leaves a text value with it
    with pytest.raises(ValueError, match="cannot be written"):
        forced_call_grammar([function_tool("f", None, {"type": "object", "properties": {"a>b": {}},
                                                       "required": ["a>b"]})], fmt="qwen3_coder")  # fmt: skip
    with pytest.raises(ValueError, match="no tool named"):
        forced_call_grammar(TOOLS, "missing", fmt="mistral")


@pytest.mark.parametrize("pattern", ["([", "(?=a)b", "\\", "x{99999}"])
def test_a_qwen3_coder_pattern_the_engine_cannot_take_is_a_400(server, oai, monkeypatch, pattern):
    """A string parameter's `pattern` becomes part of the qwen3_coder grammar's regex; one the grammar engine
    rejects (bad syntax, a lookahead, a repetition too large) is a 400 naming tool_choice, and the server serves on."""
    monkeypatch.setattr(server.app.state, "tool_parser", "qwen3_coder")
    params = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny-test", messages=user, tools=tools, tool_choice="required", max_tokens=8)
    assert err.value.body["param"] == "tool_choice"
    assert oai.chat.completions.create(model="tiny-test", messages=user, max_tokens=2).choices[0].finish_reason

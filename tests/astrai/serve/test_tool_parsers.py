"""The tool-call parser registry (`astrai.serve.tool_parsers`): each format on reference outputs in its model
family's markup, whole and streamed in random-size chunks (same events); malformed markup comes back as text;
detection from chat templates; the server setting and the `astrai serve --tool-call-parser` flag.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from astrai.serve.anthropic_api import Generation, assemble
from astrai.serve.anthropic_protocol import parse_request
from astrai.serve.state import ServerState
from astrai.serve.tool_calls import TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from astrai.serve.tool_parsers import PARSERS, detect_parser, new_parser, parse

NAMES = ["get_weather", "add"]
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
           "add": {"type": "object", "properties": {"a": {"type": "number"}, "xs": {"type": "array"},
                                                     "s": {"type": "string"}}}}  # fmt: skip
W = ("get_weather", {"city": "Paris", "days": 3})
A = ("add", {"a": 1.5, "xs": [1, 2]})
DS_B, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_SEP, DS_CE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def ds_call(name: str, args: dict) -> str:
    return f"{DS_CB}function{DS_SEP}{name}\n```json\n{json.dumps(args)}\n```{DS_CE}"


def coder_call(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in args.items())  # fmt: skip
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


# (parser, model output, expected content, expected calls)
GOOD = [
    ("hermes", f'Checking.\n<tool_call>\n{json.dumps({"name": W[0], "arguments": W[1]})}\n</tool_call>', "Checking.",
     [W]),
    ("mistral", f'[TOOL_CALLS][{json.dumps({"name": W[0], "arguments": W[1]})}, '
                f'{json.dumps({"name": A[0], "arguments": A[1]})}]', "", [W, A]),
    ("mistral", f"Sure.[TOOL_CALLS]get_weather[ARGS]{json.dumps(W[1])}[TOOL_CALLS]add[ARGS]{json.dumps(A[1])}",
     "Sure.", [W, A]),
    ("mistral", "no call, just [brackets] and {braces}", "no call, just [brackets] and {braces}", []),
    ("llama3_json", f'<|python_tag|>{json.dumps({"name": W[0], "parameters": W[1]})}', "", [W]),
    ("llama3_json", json.dumps({"name": W[0], "parameters": W[1]}) + "; "
                    + json.dumps({"name": A[0], "parameters": A[1]}),
     "", [W, A]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("qwen3_coder", f"Let me check.\n{coder_call(*W)}\n{coder_call(*A)}", "Let me check.", [W, A]),
    ("qwen3_coder", coder_call("add", {"s": "two\nlines", "a": 2}), "", [("add", {"s": "two\nlines", "a": 2})]),
    ("qwen3_coder", coder_call(*W).removesuffix("\n</tool_call>"), "", [W]),  # stopped before the closing tag
    ("deepseek_v3", f"Hi{DS_B}{ds_call(*W)}\n{ds_call(*A)}{DS_E}", "Hi", [W, A]),
    ("deepseek_v3", f"{DS_B}{DS_CB}get_weather{DS_SEP}{json.dumps(W[1])}{DS_CE}{DS_E} done", "done", [W]),  # V3.1
    # markup quoted inside a JSON string is argument text, not a marker
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"s": "see [TOOL_CALLS] here"}}]', "",
     [("add", {"s": "see [TOOL_CALLS] here"})]),
    ("llama3_json", '{"name": "add", "parameters": {"s": "a <|python_tag|> b"}}', "",
     [("add", {"s": "a <|python_tag|> b"})]),
    ("deepseek_v3", f"{DS_B}{ds_call('add', {'s': f'x{DS_CE}{DS_E}y'})}{DS_E}", "",
     [("add", {"s": f"x{DS_CE}{DS_E}y"})]),
]  # fmt: skip

BAD = [  # malformed markup: the whole output comes back as text, no call
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS][{"name": "unknown", "arguments": {}}]'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}} and more'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>"),
    ("deepseek_v3", f"{DS_B}{DS_CB}function{DS_SEP}get_weather\n```json\n{{oops\n```{DS_CE}{DS_E}"),
    ("deepseek_v3", f"{DS_B}{DS_CB}function{DS_SEP}get_weather\n```json\n{{}}\n```"),
]


def stream(name: str, text: str, rng: random.Random, forced: bool = False) -> tuple[list, object]:
    parser = new_parser(name, NAMES, SCHEMAS, forced=forced)
    events, i = [], 0
    while i < len(text):
        step = rng.randint(1, 7)
        events += parser.feed(text[i : i + step])
        i += step
    return events + parser.finish(), parser


def summary(events: list) -> tuple[str, list]:
    """(concatenated text, [(name, arguments)]) of an event list, checking each call's start/args/end batch."""
    text, calls = "", []
    for k, e in enumerate(events):
        if isinstance(e, TextDelta):
            text += e.text
        elif isinstance(e, ToolCallStart):
            args, end = events[k + 1], events[k + 2]
            assert isinstance(args, ToolCallArgs) and isinstance(end, ToolCallEnd) and e.index == end.index
            calls.append((e.name, json.loads(args.text)))
    return text, calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), GOOD)
def test_each_format_whole_and_streamed(name, text, content, calls):
    got_text, got_calls = parse(name, text, NAMES, SCHEMAS)
    assert got_text == content and [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for seed in range(20):
        events, parser = stream(name, text, random.Random(seed))
        assert summary(events) == (content, calls) and parser.text == content


@pytest.mark.parametrize(("name", "text"), BAD)
def test_malformed_markup_is_text(name, text):
    assert parse(name, text, NAMES, SCHEMAS) == (text, [])
    for seed in range(10):
        assert summary(stream(name, text, random.Random(seed))[0]) == (text, [])


ADD1 = ("add", {"a": 1})
CUT = {  # format: (one complete forced call as that format's grammar writes it, tails the budget may cut it at)
    "hermes": (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
        ('\n<tool_call>\n{"name": "get_we', "\n<tool_", "\n"),
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        ("\n<tool_call>\n<function=get_weather>\n<parameter=ci", "\n<tool_"),
    ),
    "mistral": ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}', (', {"name": "get_we', ", ", "")),
    "llama3_json": ('{"name": "add", "parameters": {"a": 1}}', ('; {"name": "get_we', "; ")),
    "deepseek_v3": (f"{DS_B}{ds_call('add', {'a': 1})}", (f"\n{DS_CB}function{DS_SEP}get_", "\n", "")),
}


@pytest.mark.parametrize("name", sorted(CUT))
def test_a_forced_output_drops_a_call_cut_short_by_the_budget(name):
    done, tails = CUT[name]
    for tail in tails:
        for seed in range(3):
            events, parser = stream(name, done + tail, random.Random(seed), forced=True)
            assert summary(events) == ("", [ADD1]) and parser.text == "", (tail, summary(events))
        text, calls = parse(name, done + tail, NAMES, SCHEMAS, forced=True)
        assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [ADD1]
    text, calls = parse("hermes", CUT["hermes"][0] + "\n<tool_")
    assert text == "<tool_" and len(calls) == 1  # unforced: the tail is text


def test_qwen3_coder_types_values_by_the_schema():
    out = coder_call("add", {"s": "42", "a": "1e3", "xs": "[1, 2]"})
    (call,) = parse("qwen3_coder", out, NAMES, SCHEMAS)[1]
    assert json.loads(call.arguments) == {"s": "42", "a": 1000.0, "xs": [1, 2]}
    (call,) = parse("qwen3_coder", out.replace("<function=add>", "<function=get_weather>"), NAMES, {})[1]
    assert json.loads(call.arguments) == {"s": "42", "a": "1e3", "xs": "[1, 2]"}  # no schema: text


def test_detection_from_chat_templates():
    assets = Path(__file__).parents[2] / "assets"
    assert detect_parser((assets / "chatml_tools.jinja").read_text()) == "hermes"
    assert detect_parser(None) == "hermes"
    assert detect_parser("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' + calls | tojson }}") == "mistral"
    assert detect_parser("<tool_call>\n<function={{ name }}>\n<parameter=") == "qwen3_coder"
    assert detect_parser("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert detect_parser("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}") == "deepseek_v3"
    assert set(PARSERS) == {"hermes", "mistral", "llama3_json", "qwen3_coder", "deepseek_v3"}


def test_server_setting_and_cli_flag(server):
    assert ServerState(engine=server.engine, model_name="m").tool_parser == "hermes"  # the test template's
    assert ServerState(engine=server.engine, model_name="m", tool_call_parser="mistral").tool_parser == "mistral"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ServerState(engine=server.engine, model_name="m", tool_call_parser="nope")
    from astrai.cli._common import parse as cli_parse
    from astrai.cli.serve import ServeConfig

    assert cli_parse(ServeConfig, ["m", "--tool-call-parser", "qwen3_coder"]).tool_call_parser == "qwen3_coder"
    assert cli_parse(ServeConfig, ["m"]).tool_call_parser is None
    with pytest.raises(SystemExit):
        cli_parse(ServeConfig, ["m", "--tool-call-parser", "nope"])


def test_anthropic_stream_with_another_format():
    # the Anthropic writer turns any parser's events into tool_use blocks whose input_json_delta is valid JSON
    req = parse_request({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                         "tools": [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()]})  # fmt: skip
    gen, events = Generation(req, "qwen3_coder"), []
    text = f"Sure.\n{coder_call(*W)}"
    for k in range(0, len(text), 5):
        delta = type("D", (), {"text": text[k : k + 5], "token_ids": (1,), "finish_reason": None})()
        events += gen.feed(delta)
    events += gen.feed(type("D", (), {"text": "", "token_ids": (), "finish_reason": "stop"})())
    blocks = assemble(events)
    assert [b["type"] for b in blocks] == ["text", "tool_use"] and blocks[1]["input"] == W[1]
    assert gen.stop_reason == "tool_use"

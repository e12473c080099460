"""The tool-call parser on its own: formats, edge cases, and streaming == one-shot parsing at every split.

Expected calls come from the Python dicts the test text was built from (json.dumps), never from a parser run.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from astrai.serve.tool_calls import (
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
    parse_tool_calls,
)


def hermes(name: str, args, *, indent: str = "\n") -> str:
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>{indent}{body}{indent}</tool_call>"


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def stream(chunks, tool_names=None, prefix=""):
    """Feed `chunks`; returns (events, parser) after checking the event stream is well formed."""
    parser = ToolCallParser(tool_names, prefix)
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == parser.text
    started, args, ended = {}, {}, []
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index == len(started) and e.index not in ended
            started[e.index] = e
        elif isinstance(e, ToolCallArgs):
            assert e.index in started and e.index not in ended
            args[e.index] = args.get(e.index, "") + e.text
        elif isinstance(e, ToolCallEnd):
            assert e.index in started and e.index not in ended
            ended.append(e.index)
    assert ended == list(range(len(parser.calls)))
    for i, call in enumerate(parser.calls):
        assert (started[i].id, started[i].name, args[i]) == (call.id, call.name, call.arguments)
        assert call.id.startswith("call_") and len(call.id) == 5 + 24
        assert isinstance(json.loads(call.arguments), dict)
    return events, parser


WEATHER = {"city": "Paris", "units": "metric"}
TRICKY = {
    "code": 'print("}{") # </tool_call> <tool_call>',
    "quote": 'she said "hi" \\ bye',
    "unicode": "naïve 東京 🙂",
    "nested": {"a": [1, {"b": None, "c": [True, False]}], "e": -1.5e-3},
    "empty": {},
}

CASES = [  # (text, expected content, expected calls)
    (hermes("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("Let me check.\n\n" + hermes("get_weather", WEATHER), "Let me check.", [("get_weather", WEATHER)]),
    (hermes("a", {"x": 1}) + "\n" + hermes("b", {}) + "\nDone.", "Done.", [("a", {"x": 1}), ("b", {})]),
    ("Before " + hermes("f", TRICKY, indent="") + " after", "Beforeafter", [("f", TRICKY)]),
    ('<tool_call>  {"name": "f", "arguments": "{\\"k\\": [1, 2]}"}  </tool_call>', "", [("f", {"k": [1, 2]})]),
    ('<tool_call>[{"name": "f", "arguments": {}}, {"name": "g"}]</tool_call>', "", [("f", {}), ("g", {})]),
    ('<tool_call>{"name": "f", "parameters": {"p": 1}}', "", [("f", {"p": 1})]),  # Llama key, no closing tag
    (json.dumps({"name": "f", "arguments": TRICKY}), "", [("f", TRICKY)]),  # bare object
    ('  [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": null}]\n', "", [("f", {"a": 1}), ("g", {})]),
    ('{"name": "f", "arguments": {"a": 1}} and more', '{"name": "f", "arguments": {"a": 1}} and more', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("plain text, no calls at all  ", "plain text, no calls at all  ", []),
    ("x < y and <tool_ but not a tag", "x < y and <tool_ but not a tag", []),
    ("dangling <tool_", "dangling <tool_", []),
    ('see <tool_call>{"name": "f", "argu', 'see <tool_call>{"name": "f", "argu', []),  # unterminated
    ('see\n<tool_call>\n{"name": f}\n</tool_call> ok', 'see\n<tool_call>\n{"name": f}\n</tool_call> ok', []),
    ("<tool_call> not json </tool_call>", "<tool_call> not json </tool_call>", []),
    (
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
    ),  # fmt: skip
    (
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        [],
    ),  # fmt: skip
    (
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        [],
    ),
    # a broken call, then a good one: the first stays text, the second is found
    ('<tool_call>{"oops"}</tool_call>' + hermes("f", {"a": 1}), '<tool_call>{"oops"}</tool_call>', [("f", {"a": 1})]),
]


@pytest.mark.parametrize(("text", "content", "expected"), CASES)
def test_parse(text, content, expected):
    got_text, calls = parse_tool_calls(text)
    assert got_text == content
    assert calls_of(calls) == expected
    assert all(c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False) for c in calls)


@pytest.mark.parametrize(("text", "content", "expected"), CASES)
def test_stream_every_split_point(text, content, expected):
    for k in range(len(text) + 1):
        _, parser = stream([text[:k], text[k:]])
        assert (parser.text, calls_of(parser.calls)) == (content, expected), k
    _, parser = stream(list(text))  # one character at a time
    assert (parser.text, calls_of(parser.calls)) == (content, expected)


def test_call_events_come_once_the_json_is_complete():
    text = hermes("get_weather", WEATHER)
    parser = ToolCallParser()
    end = text.index("}}") + 2
    assert parser.feed(text[: end - 1]) == []  # nothing about the call before its JSON closes
    events = parser.feed(text[end - 1 :])
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgs, ToolCallEnd]
    assert events[0].name == "get_weather" and json.loads(events[1].text) == WEATHER
    assert parser.finish() == []


def test_held_back_tag_prefix_is_released_as_text():
    parser = ToolCallParser()
    assert parser.feed("Hello <tool_") == [TextDelta("Hello")]  # the space may precede a tag: held too
    assert parser.feed("box> ok") == [TextDelta(" <tool_box> ok")]
    assert parser.finish() == [] and parser.text == "Hello <tool_box> ok"
    parser = ToolCallParser()
    assert parser.feed("tail <tool_c") == [TextDelta("tail")]
    assert parser.finish() == [TextDelta(" <tool_c")]


def test_tool_names_filter():
    text = "a" + hermes("known", {"x": 1}) + hermes("unknown", {"y": 2})
    got_text, calls = parse_tool_calls(text, tool_names=["known"])
    assert calls_of(calls) == [("known", {"x": 1})]
    assert got_text == "a" + hermes("unknown", {"y": 2})
    assert parse_tool_calls(json.dumps({"name": "unknown", "arguments": {}}), tool_names=["known"])[1] == []


@pytest.mark.parametrize(
    ("prefix", "generated"),
    [
        ('<tool_call>\n{"name": "', 'get_weather", "arguments": {"city": "Paris", "units": "metric"}}\n</tool_call>'),
        ('<tool_call>\n{"name": "get_weather", "arguments": ', '{"city": "Paris", "units": "metric"}}</tool_call>'),
    ],
)
def test_prefix_is_parsed_never_emitted(prefix, generated):
    for k in range(len(generated) + 1):
        _, parser = stream([generated[:k], generated[k:]], tool_names=["get_weather"], prefix=prefix)
        assert (parser.text, calls_of(parser.calls)) == ("", [("get_weather", WEATHER)])
    # when the model does not complete the call, its own text comes out and the pre-filled markup does not
    assert parse_tool_calls("no call here", prefix=prefix) == ("no call here", [])
    assert parse_tool_calls(" Then text.", prefix=prefix + generated)[0] == "Then text."


def test_bare_json_is_not_recognised_after_a_prefix():
    body = json.dumps({"name": "f", "arguments": {}})
    assert parse_tool_calls(body, prefix="Sure: ") == (body, [])


def test_deeply_nested_arguments_stay_text_without_crashing():
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>"
    text, calls = parse_tool_calls(deep)
    assert calls == [] and text == deep


def test_long_streams_are_linear():
    # a 20 kB argument fed one character at a time, then 20 kB of text: quadratic buffering would take seconds
    big = {"content": "x" * 20_000}
    text = hermes("write", big) + "y" * 20_000
    start = time.perf_counter()
    _, parser = stream(list(text))
    assert time.perf_counter() - start < 5.0
    assert calls_of(parser.calls) == [("write", big)] and parser.text == "y" * 20_000


# ---- random texts, random split points ----------------------------------------------------------------------
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_args = st.dictionaries(st.text(max_size=6), _json_values, max_size=4)
_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_-]{0,10}", fullmatch=True)
_plain = (
    st.text(alphabet=st.sampled_from(list('ab <>{}[]"\\:,\n_é🙂')), max_size=12)
    .map(str.strip)
    .filter(lambda s: "tool_call>" not in s)
)
_segment = st.one_of(st.tuples(st.just("text"), _plain), st.tuples(st.just("call"), st.tuples(_names, _args)))


@settings(max_examples=150, deadline=None)
@given(segments=st.lists(_segment, min_size=1, max_size=5), data=st.data())
def test_stream_random_splits_match_the_construction(segments, data):
    text, content, expected = "", "", []
    for kind, value in segments:
        if kind == "text":
            text, content = text + value, content + value
        else:
            text += hermes(*value, indent=data.draw(st.sampled_from(["", "\n", " \n "])))
            expected.append(value)
    assume("tool_call>" not in content)  # adjacent text segments could spell a tag
    if not expected:  # text alone may happen to look like bare JSON: compare to the one-shot parse only
        content, calls = parse_tool_calls(text)
        expected = calls_of(calls)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    _, parser = stream(chunks)
    assert parser.text == content
    assert calls_of(parser.calls) == [(n, a) for n, a in expected]
    assert parse_tool_calls(text)[0] == content

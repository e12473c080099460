"""Structured values every validator accepts (issue 41, item 6): `format` strings and ECMA-262 `\\d`.

Budget-aware closing fills a string it must end with the shortest completion its grammar allows, so what the
grammar admits for `date`, `time`, `date-time` and `email` decides whether pydantic takes the value. The checks
use independent validators: pydantic's `date`/`time`/`datetime`/`EmailStr`/`AnyUrl`/`UUID` and jsonschema's
FormatChecker (date-time and time need `rfc3339-validator`, uri `rfc3986-validator`, email through pydantic needs
`email-validator`; a check whose validator is missing is skipped, not passed). Negative controls: llguidance's own
format regexes (the rewrite switched off) close a date as `0000-01-01` and admit second 60, and `\\d` as llguidance
reads it admits the Arabic-Indic digit '٣'.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import uuid

import jsonschema
import pydantic
import pytest

import astrai
from astrai.inference import closing, grammar
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.grammar import (
    accept,
    build_view,
    compile_grammar,
    json_schema_grammar,
    new_matcher,
    regex_grammar,
)
from astrai.inference.params import GrammarSpec, SamplingParams
from astrai.inference.schema_rewrite import ecma_regex
from astrai.io.tokenizer import train_tokenizer
from helpers import grammar_takes, tiny_model_dir

VALIDATORS = ("email_validator", "rfc3339_validator", "rfc3986_validator")
HAS = {m: importlib.util.find_spec(m) is not None for m in VALIDATORS}
FORMATS = {  # format -> the pydantic type that must take a value of it
    "date": datetime.date,
    "time": datetime.time,
    "date-time": datetime.datetime,
    "uuid": uuid.UUID,
    "uri": pydantic.AnyUrl,
    **({"email": pydantic.EmailStr} if HAS["email_validator"] else {}),
}
CHECKED = {"date", "uuid"} | ({"date-time", "time"} if HAS["rfc3339_validator"] else set())
CHECKED |= {"email"} | ({"uri"} if HAS["rfc3986_validator"] else set())  # email: jsonschema checks the @
SCHEMA = {"type": "object", "properties": {f: {"type": "string", "format": f} for f in FORMATS},
          "required": list(FORMATS), "additionalProperties": False}  # fmt: skip
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER  # FormatChecker() would take draft 3's "time"
CORPUS = ["hello world, this is a tiny corpus", "the quick brown fox jumps over the lazy dog"] * 4


def _errors(value: str, fmt: str) -> list[str]:
    """What pydantic and jsonschema's FormatChecker say against `value` as `fmt` ([] = both accept it)."""
    out = []
    try:
        pydantic.TypeAdapter(FORMATS[fmt]).validate_python(value)
    except pydantic.ValidationError as e:
        out.append(f"pydantic: {e.errors()[0]['msg']}")
    if fmt in CHECKED and not CHECKER.conforms(value, fmt):
        out.append("jsonschema FormatChecker")
    return out


@pytest.fixture(scope="module")
def view():
    return build_view(train_tokenizer(CORPUS, vocab_size=300))


def _close(view, schema: dict, written: str = "") -> str:
    """The closing path's text from the start of `schema`'s grammar after the model wrote `written`."""
    matcher = new_matcher(compile_grammar(view, json_schema_grammar(schema)))
    data = written.encode()
    for token in view.ll.tokenize_bytes(data):
        assert accept(matcher, token), written
    path = closing.closing_path(matcher, 200, data)
    assert path is not None, f"no closing path after {written!r}"
    return written + b"".join(view.token_bytes[t] for t in path if t < len(view.token_bytes)).decode()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_closing_fill_of_each_format_validates(view, fmt):
    schema = {"type": "string", "format": fmt}
    starts = {"date": ["", "2", "1999-1", "2024-02-2"], "time": ["", "2", "23:5"], "date-time": ["", "2000-12-3"],
              "email": ["", "john", "john.doe@", "j@mail"], "uri": ["", "http", "https://x"],
              "uuid": ["", "1234"]}[fmt]  # fmt: skip
    for written in starts:
        value = json.loads(_close(view, schema, '"' + written))
        assert value.startswith(written) and not _errors(value, fmt), (written, value, _errors(value, fmt))


def test_llguidance_formats_alone_close_to_values_pydantic_refuses(view, monkeypatch):
    """The negative control: with llguidance's own format regexes (the rewrite off), a date closes as year 0000,
    an email as `a@a` (no dot in the domain) and a uri after `http` as `http:` (no host)."""
    monkeypatch.setattr(grammar, "rewrite_schema", lambda s: s)
    value = json.loads(_close(view, {"type": "string", "format": "date"}, '"'))
    assert value == "0000-01-01" and _errors(value, "date")
    value = json.loads(_close(view, {"type": "string", "format": "uri"}, '"http'))
    assert value == "http:" and _errors(value, "uri")
    value = json.loads(_close(view, {"type": "string", "format": "email"}, '"'))
    assert value == "a@a"
    if "email" in FORMATS:
        assert _errors(value, "email")


def test_date_and_time_grammars_admit_only_valid_values(view):
    good = {"date": ["2024-02-29", "0001-01-01", "9999-12-31", "2000-02-29"],
            "time": ["23:59:59Z", "00:00:00.123456+05:30"],
            "date-time": ["2024-02-29T23:59:59-23:59", "1970-01-01T00:00:00Z"]}  # fmt: skip
    bad = {"date": ["0000-01-01", "2023-02-29", "1900-02-29", "2024-04-31", "2024-13-01"],
           "time": ["23:59:60Z", "24:00:00Z", "00:00:00"],
           "date-time": ["2016-12-31T23:59:60Z", "0000-01-01T00:00:00Z"]}  # fmt: skip
    for fmt in good:
        g = compile_grammar(view, json_schema_grammar({"type": "string", "format": fmt}))
        for value in good[fmt]:
            assert grammar_takes(view, g, view.ll.tokenize_bytes(json.dumps(value).encode())), value
            assert not _errors(value, fmt), value
        for value in bad[fmt]:
            assert not grammar_takes(view, g, view.ll.tokenize_bytes(json.dumps(value).encode())), value
            assert _errors(value, fmt), value  # the validators agree that these are invalid
    # llguidance's own date-time grammar (the rewrite off) takes second 60 and year 0000
    raw = compile_grammar(view, grammar.llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "string", "format": "date-time"}))  # fmt: skip
    assert grammar_takes(view, raw, view.ll.tokenize_bytes(b'"2016-12-31T23:59:60Z"'))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("formats") / "m"))


def test_outputs_cut_at_many_budgets_hold_valid_formats(model):
    """The tiny random model at temperature 1, budgets of the shortest document and 12 tokens more: every
    output is complete ("stop"), valid JSON of the schema, and every value passes pydantic and jsonschema."""
    names = ["date", "date-time", "email" if "email" in FORMATS else "uri"]  # each format's fill: the test above
    schema = {**SCHEMA, "properties": {f: SCHEMA["properties"][f] for f in names}, "required": names}
    spec = GrammarSpec(kind="json_schema", source=json.dumps(schema))
    with Engine(model, EngineConfig(compile=False, background=False, kv_budget_tokens=16384)) as engine:
        shortest = len(closing.closing_path(new_matcher(engine.compile_grammar(spec)), limit=500))
        params = [SamplingParams(max_tokens=shortest + e, temperature=1.0, seed=s, grammar=spec)
                  for e in (0, 12) for s in range(3)]  # fmt: skip
        outs = [c.outputs[0] for c in engine.generate(["the quick brown fox"] * len(params), params)]
    for out in outs:
        assert out.finish_reason == "stop", out.text
        doc = json.loads(out.text)
        jsonschema.validate(doc, schema, format_checker=CHECKER)
        for fmt, value in doc.items():
            assert not _errors(value, fmt), (fmt, value)
    assert any(o.stop_reason == "budget" for o in outs)


# ---- \d is [0-9] ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"\d{3}", "[0-9]{3}"),
        (r"[\d]", "[0-9]"),
        (r"[\da-f-]", "[0-9a-f-]"),
        (r"[^\d]", "[^0-9]"),
        (r"\D", "[^0-9]"),
        (r"[a\D]", "[a[^0-9]]"),
        (r"\\d", r"\\d"),  # an escaped backslash, then the letter d
        (r"\\\d", r"\\[0-9]"),
        (r"\w+", "[0-9A-Za-z_]+"),
        (r"[]\d]", "[]0-9]"),  # a leading ] is a literal
        (r"\p{L}\.\d", r"\p{L}\.[0-9]"),
    ],
)
def test_ecma_regex_spells_ascii_classes(pattern, expected):
    assert ecma_regex(pattern) == expected


@pytest.mark.parametrize("how", ["regex", "tool_text", "schema", "class", "property_names"])
def test_backslash_d_refuses_non_ascii_digits(view, how, monkeypatch):
    """'٣' (ARABIC-INDIC DIGIT THREE) is a Unicode digit: Rust's `\\d` takes it, ECMA-262's does not. llguidance
    already reads a JSON schema's own patterns as ASCII, so the negative control (the rewrite off) turns only
    `guided_regex` and a tool call's text value (a Lark regex, qwen3_coder) red."""
    from astrai.serve import tool_grammars

    def source():
        if how == "regex":
            return regex_grammar(r"a\d+")
        if how == "tool_text":
            return grammar.lark_grammar("start: /" + tool_grammars._text_regex({"pattern": r"^a\d+$"}) + "/")
        if how == "property_names":
            return json_schema_grammar({"type": "object", "patternProperties": {r"^a\d$": {"type": "integer"}},
                                        "additionalProperties": False})  # fmt: skip
        pattern = r"^a\d+$" if how == "schema" else r"^a[\d]+$"
        return json_schema_grammar({"type": "string", "pattern": pattern})

    wrap = {"property_names": '{{"{}":1}}', "schema": '"{}"', "class": '"{}"'}.get(how, "{}")

    def takes(text: str) -> bool:
        g = compile_grammar(view, source())
        return grammar_takes(view, g, view.ll.tokenize_bytes(wrap.format(text).encode()))

    assert takes("a3") and takes("a0") and not takes("a٣") and not takes("ab")
    if how in ("regex", "tool_text"):
        monkeypatch.setattr(grammar, "ecma_regex", lambda p: p)  # the negative control: Rust's Unicode \d
        monkeypatch.setattr(tool_grammars, "ecma_regex", lambda p: p)
        assert takes("a٣")

"""Tool-call grammars: a forced call and tool_choice "auto", constrained in the server's tool-call format.

A forced call (OpenAI tool_choice "required" / a named function, Anthropic "any" / "tool") must be a well-formed
call in the markup the model's chat template taught it, with arguments valid for the tool's parameters; under
tool_choice "auto" the output is free text, or text then such calls, so text never holds a broken call. Each
format (`tool_parsers.PARSERS`) has its grammar (Lark, llguidance's dialect, one `%json` schema per tool), and the
format's own parser reads what it produces:

- `hermes`: `<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>`, calls separated by a newline.
- `qwen3_coder`: `<tool_call>\\n<function=N>\\n<parameter=P>\\nV\\n</parameter>\\n</function>\\n</tool_call>`; a
  string parameter's value is text (bounded by `minLength`/`maxLength`, `pattern`, `enum`; never holding
  `</parameter>`, `</function>` or `</tool_call>`), other values are JSON for their schema; required parameters
  always appear, in the schema's order, optional ones may.
- `mistral`: `[TOOL_CALLS][{"name": N, "arguments": A}, ...]` (`[TOOL_CALLS] [` when the template writes that
  space), or `[TOOL_CALLS]N[ARGS]A` per call when the chat template uses `[ARGS]` (Mistral's tokenizer v11+).
- `llama3_json`: the whole output is `{"name": N, "parameters": A}`, several separated by `; `; under "auto" the
  text must then not start with `{` or `[` (the parser would read it as a call).
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\nA\\n```
  <｜tool▁call▁end｜>` (calls separated by a newline) then `<｜tool▁calls▁end｜>`; without "```json" in the chat
  template, V3.1's `<｜tool▁call▁begin｜>N<｜tool▁sep｜>A<｜tool▁call▁end｜>`.

JSON inside calls is written as chat templates render it (`tojson`'s `, ` and `: `) with no free whitespace, so a
weak model cannot pad forever inside a forced call. A markup string that is one special token in the vocabulary
is named by id (`<[id]>`), since special tokens match no text, and the request must keep special tokens' text in
the output for the parser to see it (`tool_call_grammar` says so).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from astrai.inference.params import GrammarSpec
from astrai.inference.schema_rewrite import ecma_regex, rewrite_schema
from astrai.serve.tool_parsers import value_kinds

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HOISTED = ("$defs", "definitions")  # `#/$defs/X` refs in a tool's parameters keep working in a sub-schema
PARAM_CLOSE = "\n</parameter>"  # what ends a qwen3_coder text value (budget-aware closing writes it)
# a qwen3_coder text value runs to the first `</parameter>` and never holds the closing tags around it (the parser
# would end the function or the call there)
_TEXT_VALUE_END = "\\n?<\\/parameter>/ & ~/(?s:.*<\\/(?:function|tool_call)>.*)/"
Rules = tuple[str | None, list[str], tuple[str, ...]]  # (the markup that opens the calls, rules, closers)


def _lit(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _regex_lit(text: str) -> str:
    """`text` as a piece of a Lark `/regex/` literal that matches it exactly."""
    controls = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return "".join(controls.get(c) or re.escape(c) for c in text).replace("/", "\\/")


def _json(rule: str, schema: dict[str, Any]) -> str:
    # ECMA-262 \d and validator-safe formats, as `grammar.json_schema_grammar` compiles a schema
    return f"{rule}: %json " + json.dumps({**rewrite_schema(schema), "x-guidance": _CALL_JSON})


def call_schema(name: str, parameters: dict[str, Any] | None, arguments_key: str = "arguments") -> dict[str, Any]:
    """JSON schema of one call object `{"name": NAME, arguments_key: ARGS}`, ARGS valid for `parameters`.

    A tool without parameters takes any object. The parameters' `$defs` / `definitions` move to the root, so
    their `#/$defs/...` references still resolve.
    """
    params = dict(parameters) if isinstance(parameters, dict) and parameters else {"type": "object"}
    hoisted = {k: params.pop(k) for k in _HOISTED if k in params}
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False, **hoisted}  # fmt: skip


def _arguments(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's parameter schema as its own document (any object when it has none)."""
    return dict(parameters) if isinstance(parameters, dict) and parameters else {"type": "object"}


def tag_terminal(tokenizer: Any, text: str) -> tuple[str, bool]:
    """(the Lark terminal for the markup `text`, whether it is a special token).

    Real vocabularies have tool markup (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`) as added tokens; one
    marked special matches no text in the grammar engine, so the grammar names its id (`<[id]>`).
    """
    if tokenizer is not None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in tokenizer.special_token_ids:
            return f"<[{ids[0]}]>", True
    return _lit(text), False


class _Tags:
    """Markup -> terminal for one grammar, remembering whether any was a special token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.special_texts = tokenizer, set()

    @property
    def special(self) -> bool:
        return bool(self.special_texts)

    def __call__(self, text: str) -> str:
        terminal, special = tag_terminal(self.tokenizer, text)
        if special:
            self.special_texts.add(text)
        return terminal


def _body(functions: Sequence[dict[str, Any]], rule: Callable[[int, dict[str, Any]], list[str]]) -> list[str]:
    """`body`: one alternative per function, each defined by `rule(i, function)`."""
    out = ["body: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        out += rule(i, fn)
    return out


# ---- the formats ----------------------------------------------------------------------------------------------
def _tool_call_tags(tag: _Tags, parallel: bool) -> list[str]:
    """Calls each wrapped in `<tool_call>\\n...\\n</tool_call>`, separated by a newline (hermes, qwen3_coder)."""
    more = f' ("\\n" {tag(OPEN_TAG)} call_rest)*' if parallel else ""
    return [f"calls_rest: call_rest{more}", f'call_rest: "\\n" body "\\n" {tag(CLOSE_TAG)}']


def _hermes(functions: Sequence[dict[str, Any]], tag: _Tags, parallel: bool, template: str) -> Rules:
    rules = _tool_call_tags(tag, parallel)
    rules += _body(functions, lambda i, fn: [_json(f"call_{i}", call_schema(fn["name"], fn.get("parameters")))])
    return OPEN_TAG, rules, ()


def _qwen3_coder(functions: Sequence[dict[str, Any]], tag: _Tags, parallel: bool, template: str) -> Rules:
    return OPEN_TAG, _tool_call_tags(tag, parallel) + _body(functions, _coder_function), (PARAM_CLOSE,)


def _coder_function(i: int, fn: dict[str, Any]) -> list[str]:
    """`call_i`: `<function=NAME>\\n`, its parameters (required ones always, in the schema's order), `</function>`."""
    params = _arguments(fn.get("parameters"))
    props = params.get("properties")
    defs = {k: params[k] for k in _HOISTED if k in params}
    required = set(params.get("required") or ())
    rules, parts = [], []
    if isinstance(props, dict) and props:
        for k, (key, schema) in enumerate(props.items()):
            if not re.fullmatch(r"[^>\n]+", key):  # the markup cannot carry this name
                if key in required:
                    raise ValueError(f"parameter name {key!r} of tool {fn['name']!r} cannot be written in "
                                     "qwen3_coder markup")  # fmt: skip
                continue
            rule = f"p{i}_{k}"
            rules += _coder_parameter(rule, key, schema if isinstance(schema, dict) else {}, defs)
            parts.append(rule if key in required else rule + "?")
    elif params.get("additionalProperties", True) is not False:  # no declared parameters: any names, text values
        rules += [f"p{i}_any: \"<parameter=\" /[a-zA-Z_][a-zA-Z0-9_.-]{{0,63}}/ \">\\n\" v{i}_any \"\\n\"",
                  f"v{i}_any[lazy]: /(?s:.*){_TEXT_VALUE_END}"]  # fmt: skip
        parts.append(f"p{i}_any*")
    rules.append(f'call_{i}: {_lit("<function=" + fn["name"] + ">" + chr(10))} {" ".join(parts)} "</function>"')
    return rules


def _coder_parameter(rule: str, key: str, schema: dict[str, Any], defs: dict[str, Any]) -> list[str]:
    """One qwen3_coder parameter: text for a string (or untyped) one, as the parser reads it, else JSON."""
    head = _lit(f"<parameter={key}>\n")
    kinds = value_kinds(schema)
    if kinds and "string" not in kinds:
        return [f"{rule}: {head} {rule}_v {_lit(PARAM_CLOSE + chr(10))}", _json(f"{rule}_v", {**schema, **defs})]
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return [f"{rule}: {head} ({' | '.join(map(_lit, choices))}) {_lit(PARAM_CLOSE + chr(10))}"]
    # the value runs to the first `</parameter>` (the parser's rule); the newline before it is optional there
    return [f'{rule}: {head} {rule}_v "\\n"', f"{rule}_v[lazy]: /{_text_regex(schema)}{_TEXT_VALUE_END}"]


def _text_regex(schema: dict[str, Any]) -> str:
    """The regex of a text value: its `pattern` (anchored as JSON schema reads it: a search; `\\d` ASCII, as
    ECMA-262 reads it, where a Lark regex is Rust's Unicode class), else any text of `minLength`..`maxLength`
    characters."""
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and pattern:
        start = "" if pattern.startswith("^") else "(?s:.*)"
        end = "" if pattern.endswith("$") and not pattern.endswith("\\$") else "(?s:.*)"
        inner = pattern.removeprefix("^").removesuffix("$") if end == "" else pattern.removeprefix("^")
        return f"{start}(?:{ecma_regex(inner).replace('/', chr(92) + '/')}){end}"
    low = schema.get("minLength", 0)
    high = schema.get("maxLength")
    low = low if isinstance(low, int) and low >= 0 else 0
    if isinstance(high, int) and high >= low:
        return f"(?s:.{{{low},{high}}})"
    return f"(?s:.{{{low},}})" if low else "(?s:.*)"


def _mistral(functions: Sequence[dict[str, Any]], tag: _Tags, parallel: bool, template: str) -> Rules:
    if "[ARGS]" in template:  # tokenizer v11+: [TOOL_CALLS]NAME[ARGS]{...} per call
        args = tag("[ARGS]")
        rules = ["calls_rest: body" + (f" ({tag('[TOOL_CALLS]')} body)*" if parallel else "")]

        def call(i: int, fn: dict[str, Any]) -> list[str]:
            return [f"call_{i}: {_lit(fn['name'])} {args} call_{i}_args",
                    _json(f"call_{i}_args", _arguments(fn.get("parameters")))]  # fmt: skip

        rules += _body(functions, call)
        return "[TOOL_CALLS]", rules, ()
    lead = " [" if "[TOOL_CALLS] [" in template else "["
    rules = [f"calls_rest: {_lit(lead)} body" + (' (", " body)*' if parallel else "") + ' "]"']
    rules += _body(functions, lambda i, fn: [_json(f"call_{i}", call_schema(fn["name"], fn.get("parameters")))])
    return "[TOOL_CALLS]", rules, ()


def _llama3_json(functions: Sequence[dict[str, Any]], tag: _Tags, parallel: bool, template: str) -> Rules:
    rules = ["calls_rest: body" + (' ("; " body)*' if parallel else "")]
    rules += _body(functions, lambda i, fn: [_json(f"call_{i}", call_schema(fn["name"], fn.get("parameters"),
                                                                            "parameters"))])  # fmt: skip
    return None, rules, ()


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def _deepseek_v3(functions: Sequence[dict[str, Any]], tag: _Tags, parallel: bool, template: str) -> Rules:
    sep = tag(DS_SEP)
    fenced = "```json" in template or not template  # V3; V3.1's template has no fence
    more = (' ("\\n" call)*' if fenced else " call*") if parallel else ""
    rules = [f"calls_rest: call{more} {tag(DS_CALLS_END)}", f"call: {tag(DS_CALL_BEGIN)} body {tag(DS_CALL_END)}"]

    def call(i: int, fn: dict[str, Any]) -> list[str]:
        args = _json(f"call_{i}_args", _arguments(fn.get("parameters")))
        if fenced:
            return [f'call_{i}: "function" {sep} {_lit(fn["name"] + chr(10) + "```json" + chr(10))} call_{i}_args '
                    f'"\\n```"', args]  # fmt: skip
        return [f"call_{i}: {_lit(fn['name'])} {sep} call_{i}_args", args]

    return DS_CALLS_BEGIN, rules + _body(functions, call), ()


FORMATS: dict[str, Callable[[Sequence[dict[str, Any]], _Tags, bool, str], Rules]] = {
    "hermes": _hermes,
    "mistral": _mistral,
    "llama3_json": _llama3_json,
    "qwen3_coder": _qwen3_coder,
    "deepseek_v3": _deepseek_v3,
}


# ---- forced and auto --------------------------------------------------------------------------------------------
def _chosen(tools: Sequence[dict[str, Any]], name: str | None) -> list[dict[str, Any]]:
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}")
    return chosen


def _template(tokenizer: Any) -> str:
    return (getattr(tokenizer, "chat_template", None) or "") if tokenizer is not None else ""


def forced_call_grammar(tools: Sequence[dict[str, Any]], name: str | None = None, *, parallel: bool = True,
                        tokenizer: Any = None, fmt: str = "hermes") -> tuple[str, bool, tuple[str, ...]]:  # fmt: skip
    """The grammar of a forced call in format `fmt`: the output is only calls to one of `tools`
    (`tools_common.function_tool` dicts), or to the tool `name` only, with valid arguments; then it ends.
    `parallel`: one or more calls, else exactly one.

    Returns:
        (the Lark grammar, whether it names special tokens, the closers of its free-text regions: strings that
        end them, for budget-aware closing).
    """
    tag = _Tags(tokenizer)
    open_text, rules, closers = FORMATS[fmt](_chosen(tools, name), tag, parallel, _template(tokenizer))
    start = f"start: {tag(open_text)} calls_rest" if open_text else "start: calls_rest"
    return "\n".join(["%llguidance {}", start, *rules]) + "\n", tag.special, closers


def auto_call_grammar(tools: Sequence[dict[str, Any]], *, parallel: bool = True, tokenizer: Any = None,
                      fmt: str = "hermes") -> tuple[str, bool, tuple[str, ...]]:  # fmt: skip
    """The grammar of tool_choice "auto" in format `fmt`: free text, or text then well-formed calls.

    Text may say anything except the markup that opens calls; once that is written, what follows must be complete
    calls to `tools` with valid arguments, then the end. So a model that starts a call always finishes one the
    parser reads, and text never holds a broken call. (llama3_json has no opening markup: a call is the whole
    output, so text may not start with `{` or `[`.) Returns what `forced_call_grammar` does.
    """
    tag = _Tags(tokenizer)
    open_text, rules, closers = FORMATS[fmt](_chosen(tools, None), tag, parallel, _template(tokenizer))
    if open_text is None:
        text = "TEXT: /(?s:.+)/ & ~/(?s:[ \\t\\r\\n]*[\\[{].*)/ & ~/(?s:.*<\\|python_tag\\|>.*)/"
        start = "start: TEXT? | calls_rest"
    else:
        open_t = tag(open_text)
        text = f"TEXT: /(?s:.+)/ & ~/(?s:.*{_regex_lit(open_text)}.*)/"  # never the opening markup's text
        if open_text in tag.special_texts:  # one token, which no text matches: text ends where it is sampled
            start = f"start: TEXT? | TEXT? {open_t} calls_rest"
        else:  # text up to and including the markup (a lazy lexeme that stops there), then the calls
            rules.append(f"lead[stop={_lit(open_text)}]: /(?s:.*)/")
            start = "start: TEXT? | lead calls_rest"
    return "\n".join(["%llguidance {}", start, text, *rules]) + "\n", tag.special, closers


def tool_call_grammar(tools: Sequence[dict[str, Any]], forced: str | None, *, parallel: bool, tokenizer: Any = None,
                      tool_parser: str = "hermes") -> tuple[GrammarSpec | None, bool]:  # fmt: skip
    """What both APIs constrain a tool request with, in the server's format `tool_parser`: `forced` None
    (tool_choice auto) gives `auto_call_grammar` (None without tools: unconstrained), "" any tool and a name that
    tool (`forced_call_grammar`). Also whether the grammar names special tokens (the request must then keep their
    text in the output)."""
    if forced is None:
        if not tools:
            return None, False
        source, special, closers = auto_call_grammar(tools, parallel=parallel, tokenizer=tokenizer, fmt=tool_parser)
    else:
        source, special, closers = forced_call_grammar(tools, forced or None, parallel=parallel, tokenizer=tokenizer,
                                                       fmt=tool_parser)  # fmt: skip
    return GrammarSpec(kind="lark", source=source, param="tool_choice", closers=closers), special

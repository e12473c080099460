"""Tool-call parsers by name (vLLM's `--tool-call-parser` names), streaming and not, and their detection.

- `hermes`: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Qwen2.5/3, Hermes; `tool_calls.py`).
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (or one object), or, from Mistral's
  tokenizer v11 on, `[TOOL_CALLS]NAME[ARGS]{...}` per call (`NAME[CALL_ID]ID[ARGS]{...}` as Mistral-Small-3.2's
  template renders calls; the id is not kept).
- `llama3_json`: an optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` (several separated by
  `;`); without the tag the whole output must be the JSON.
- `qwen3_coder`: `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`;
  values are typed by the tool's parameter schema (a string parameter stays text, other types are JSON, or the
  `True` / `False` / `None` that the template's `| string` writes for a boolean / null value).
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
  <｜tool▁call▁end｜><｜tool▁calls▁end｜>` (one line; V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>` too).

Every parser keeps `tool_calls.ToolCallParser`'s contract: `feed(text)` / `finish()` return `TextDelta`,
`ToolCallStart`, `ToolCallArgs`, `ToolCallEnd` events; `calls` and `text` hold the result; any split of the text
gives the same events as the whole; a call is announced only once its markup closed and decoded (one batch:
start, the whole arguments, end), so its `arguments` are always a JSON object's text; text that may start a
marker, and whitespace next to markup, is held back; markup that does not decode (malformed JSON, a name not in
`tool_names`, a missing parameter value) comes back as text, nothing lost. The non-Hermes formats share
`MarkupParser`: a start marker, then a region that runs to an end marker (or, for mistral / llama3_json, to the
end of the output) and is decoded whole.

`detect_parser(chat_template)` picks the format from the template's text (`[TOOL_CALLS]` -> mistral,
`<function=` -> qwen3_coder, `<|python_tag|>` -> llama3_json, `tool▁calls▁begin` -> deepseek_v3, else hermes);
`astrai serve --tool-call-parser NAME` (`build_app(tool_call_parser=...)`) overrides it. Forced calls
and tool_choice "auto" are grammar-constrained in the same format (`tool_grammars`), so the
format's parser reads them; a forced output's parser (`forced=True`) drops what is not a complete call.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from astrai.serve.tool_calls import (
    Event,
    TextDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
    _decode_calls,
    _partial_suffix,
    _reject_constant,
    _skip_ws,
    new_call_id,
)

_WS = " \t\r\n"
Decoded = list[tuple[str, str]] | None  # (name, arguments JSON) per call, or None: not a valid call region


class Parser(Protocol):
    """What the handlers use of a tool-call parser."""

    calls: list[ToolCall]
    text: str

    def feed(self, text: str) -> list[Event]: ...

    def finish(self, cut: bool = False) -> list[Event]: ...


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def _call(name: Any, args: Any, tool_names: frozenset[str] | None) -> tuple[str, str] | None:
    """(name, arguments JSON) for a valid name and an object (or its JSON text; None means {}), else None."""
    if not isinstance(name, str) or not name or (tool_names is not None and name not in tool_names):
        return None
    if isinstance(args, str):
        try:
            args = _loads(args)
        except (ValueError, RecursionError):
            return None
    args = {} if args is None else args
    return (name, json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _json_values(text: str, separators: str) -> list[Any] | None:
    """The JSON values of `text`, separated by whitespace and `separators` characters; None if anything else."""
    decoder, out, i = json.JSONDecoder(parse_constant=_reject_constant), [], 0
    while True:
        while i < len(text) and (text[i] in _WS or text[i] in separators):
            i += 1
        if i == len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        out.append(value)


class _Strings:
    """Where a marker first occurs outside JSON strings, scanned incrementally (a streaming region is scanned once,
    not again at every delta)."""

    def __init__(self, pos: int = 0) -> None:
        self.pos, self.in_string, self.escaped = pos, False, False

    def find(self, text: str, marker: str) -> int:
        """Index of `marker` in `text` at or after the scan position, outside strings; -1 for none yet (a marker
        split at the end of `text` is looked at again when more text comes)."""
        i = self.pos
        while i < len(text):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c == marker[0] and (text.startswith(marker, i) or marker.startswith(text[i:])):
                self.pos = i
                return i if text.startswith(marker, i) else -1
            i += 1
        self.pos = i
        return -1


def _split_outside_strings(text: str, marker: str) -> list[str]:
    """`text.split(marker)`, except where the marker is inside a JSON string (an argument may quote markup)."""
    pieces, start, scan = [], 0, _Strings()
    while (i := scan.find(text, marker)) >= 0:
        pieces.append(text[start:i])
        start = scan.pos = i + len(marker)
    return [*pieces, text[start:]]


class MarkupParser(abc.ABC):
    """Streaming parser for a format with a start marker and a region decoded whole (see the module docstring).

    Subclasses set OPEN, CLOSE (None: the region runs to the end of the output), BARE (an output that starts
    with `{` / `[` is a region too), CALL_ENDS / REPAIRS (how a cut region's complete calls are found) and
    `decode`.
    """

    OPEN: str = ""
    CLOSE: str | None = None
    BARE: bool = False
    JSON: bool = True  # markers inside a region's JSON strings are text (False: the region is not JSON)
    CALL_ENDS: tuple[str, ...] = ("}",)  # where a call can end inside a region (a forced output's salvage)
    REPAIRS: tuple[str, ...] = ()  # what closes a region cut after a complete call

    def __init__(self, tool_names: Sequence[str] | None = None, tools: Mapping[str, Any] | None = None, *,
                 forced: bool = False) -> None:  # fmt: skip
        """Start a parse.

        Args:
            tool_names: allowed function names (None: any); a call to another name stays text.
            tools: name -> the tool's parameter schema (qwen3_coder types its values by it).
            forced: the output is grammar-forced calls (`tool_grammars.forced_call_grammar`): it holds no text, so
                whatever is not a complete call (one the token budget cut short) is dropped, not given back as text.
        """
        self._forced = forced
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.tools = dict(tools or {})
        self.calls: list[ToolCall] = []
        self.text = ""
        self._buf, self._cur, self._tag_at, self._mode = "", 0, 0, "start"  # start | text | region | after
        self._strings: _Strings | None = None  # the open region's scan for CLOSE (JSON formats)
        self._events: list[Event] = []
        self._cut = False  # finish(cut=True): the budget ended the output

    @abc.abstractmethod
    def decode(self, region: str) -> Decoded:
        """The calls in one region's text (between OPEN and CLOSE), or None when it does not decode (the region
        then comes back as text). Each format implements it."""

    def feed(self, text: str) -> list[Event]:
        """Add generated text; returns the events it completes."""
        self._buf += text
        self._run(final=False)
        if self._mode == "text" and self._cur:  # keep only the undecided window
            self._buf, self._cur, self._tag_at = self._buf[self._cur :], 0, 0
        return self._take()

    def finish(self, cut: bool = False) -> list[Event]:
        """End of generation: release held text, decode an open region (or give it back as text).

        `cut`: the token budget ended the output (finish_reason "length"): a marked region it left unterminated
        keeps its complete calls (as a forced output's) and the rest is dropped, as is a half-written start
        marker, so under tool_choice "auto" no markup reaches the content. A bare region (an output that is only
        JSON, no marker) stays text: nothing marked it as a call."""
        self._cut = cut
        if cut and self._mode == "text" and _partial_suffix(self._buf[self._cur :], self.OPEN):
            self._buf = self._buf[: self._cur]  # the held-back marker and the whitespace before it
        self._run(final=True)
        self._mode = "done"
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        merged: list[Event] = []
        for event in events:
            if isinstance(event, TextDelta) and merged and isinstance(merged[-1], TextDelta):
                merged[-1] = TextDelta(merged[-1].text + event.text)
            else:
                merged.append(event)
        return merged

    def _emit_text(self, piece: str) -> None:
        if piece and not self._forced:
            self.text += piece
            self._events.append(TextDelta(piece))

    def _run(self, final: bool) -> None:
        steps = {"start": self._start, "text": self._text, "region": self._region, "after": self._after}
        while self._mode in steps and steps[self._mode](final):
            pass

    def _start(self, final: bool) -> bool:
        j = _skip_ws(self._buf, 0)
        if j == len(self._buf) and not final:
            return False
        if self.BARE and j < len(self._buf) and self._buf[j] in "{[":
            self._mode, self._tag_at, self._cur, self._bare = "region", 0, j, True
        else:
            self._mode = "text"
        return True

    def _text(self, final: bool) -> bool:
        rest = self._buf[self._cur :]
        i = rest.find(self.OPEN)
        if i >= 0:
            self._tag_at = self._cur + len(rest[:i].rstrip(_WS))
            self._emit_text(self._buf[self._cur : self._tag_at])
            self._cur += i + len(self.OPEN)
            self._mode, self._bare = "region", False
            return True
        if final:
            self._emit_text(rest)
            self._cur = len(self._buf)
            return False
        keep = rest[: len(rest) - _partial_suffix(rest, self.OPEN)].rstrip(_WS)
        self._emit_text(keep)
        self._cur += len(keep)
        return False

    def _region(self, final: bool) -> bool:
        close = None if self._bare else self.CLOSE
        if close is None:
            end = -1
        elif self.JSON:
            if self._strings is None or self._strings.pos < self._cur:
                self._strings = _Strings(self._cur)
            end = self._strings.find(self._buf, close)
        else:
            end = self._buf.find(close, self._cur)
        if end < 0 and not final:
            return False
        region = self._buf[self._cur : end if end >= 0 else len(self._buf)]
        stop = end + len(close) if end >= 0 and close is not None else len(self._buf)
        decoded = self.decode(region)
        dropped = final and end < 0 and self._cut and not self._bare  # a marked call the budget cut short
        if decoded is None and final and (self._forced or dropped):
            decoded = self._salvage(region)
        if decoded is None:  # the markup becomes text, as written (dropped from a forced output, or a cut one)
            if not dropped:
                self._emit_text(self._buf[self._tag_at : stop])
            self._cur, self._mode, self._strings = stop, "text", None
            return True
        for name, args in decoded:
            call = ToolCall(id=new_call_id(), name=name, arguments=args)
            index = len(self.calls)
            self.calls.append(call)
            self._events += [ToolCallStart(index, call.id, name), ToolCallArgs(index, args), ToolCallEnd(index)]
        self._cur, self._mode, self._strings = stop, "after", None
        return True

    def _salvage(self, region: str) -> Decoded:
        """A forced output that the budget cut short: its complete calls, from the longest start of the region
        that decodes (ending after one of `CALL_ENDS`, with one of `REPAIRS` appended); the last 64 tried."""
        ends = sorted({m.end() for end in self.CALL_ENDS for m in re.finditer(re.escape(end), region)})
        for k in reversed(ends[-64:]):
            for repair in ("", *self.REPAIRS):
                decoded = self.decode(region[:k] + repair)
                if decoded:
                    return decoded
        return None

    def _after(self, final: bool) -> bool:
        j = _skip_ws(self._buf, self._cur)
        if j == len(self._buf) and not final:
            return False
        self._cur, self._mode = j, "text"  # whitespace next to the markup is dropped
        return True


class MistralParser(MarkupParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or `[TOOL_CALLS]NAME[ARGS]{...}` (v11+), with an
    optional `[CALL_ID]ID` before `[ARGS]`."""

    OPEN, REPAIRS = "[TOOL_CALLS]", ("]",)
    _NAMED = re.compile(r"\s*([a-zA-Z0-9_.-]{1,64})(?:\[CALL_ID\][a-zA-Z0-9]{1,64})?(?:\[ARGS\]|(?=\{))(.*)\Z", re.S)

    def decode(self, region: str) -> Decoded:
        out: list[tuple[str, str]] = []
        for piece in _split_outside_strings(region, self.OPEN):  # several calls may each carry the marker
            if not piece.strip():
                continue
            named = self._NAMED.match(piece)
            if named:
                values = _json_values(named.group(2), "")
                call = _call(named.group(1), values[0], self.tool_names) if values and len(values) == 1 else None
                if call is None:
                    return None
                out.append(call)
                continue
            values = _json_values(piece, ",")
            for value in values or [None]:
                decoded = _decode_calls(json.dumps(value), self.tool_names) if value is not None else None
                if decoded is None:
                    return None
                out += decoded
        return out or None


class Llama3JsonParser(MarkupParser):
    """`<|python_tag|>{"name": ..., "parameters": {...}}` (`;`-separated for several), or the bare JSON."""

    OPEN, BARE = "<|python_tag|>", True

    def decode(self, region: str) -> Decoded:
        values = _json_values(";".join(_split_outside_strings(region, self.OPEN)), ";")
        out = []
        for value in values or [None]:
            if not isinstance(value, dict):
                return None
            call = _call(value.get("name"), value.get("parameters", value.get("arguments")), self.tool_names)
            if call is None:
                return None
            out.append(call)
        return out


class DeepSeekV3Parser(MarkupParser):
    """DeepSeek V3's tool tokens: the calls region, each call `function<｜tool▁sep｜>NAME` and a ```json fence
    (V3.1: `NAME<｜tool▁sep｜>{...}`)."""

    OPEN, CLOSE, CALL_ENDS = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", ("<｜tool▁call▁end｜>",)
    _BEGIN, _SEP, _END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    _FENCED = re.compile(r"([^\n]+)\n```(?:json)?\n(.*)\n```\Z", re.S)

    def decode(self, region: str) -> Decoded:
        out = []
        rest = region.strip(_WS)
        while rest:
            end = _Strings(len(self._BEGIN)).find(rest, self._END) if rest.startswith(self._BEGIN) else -1
            if end < 0:
                return None
            body, rest = rest[len(self._BEGIN) : end], rest[end + len(self._END) :]
            rest = rest.lstrip(_WS)
            left, sep, right = body.partition(self._SEP)
            if not sep:
                return None
            fenced = self._FENCED.match(right.strip(_WS)) if left.strip() == "function" else None
            name, args = (fenced.group(1), fenced.group(2)) if fenced else (left, right)
            try:
                call = _call(name.strip(), _loads(args), self.tool_names)
            except (ValueError, RecursionError):
                return None
            if call is None:
                return None
            out.append(call)
        return out or None


class Qwen3CoderParser(MarkupParser):
    """Qwen3-Coder's XML calls; parameter values are typed by the tool's schema (a string stays as written)."""

    OPEN, CLOSE, CALL_ENDS, JSON = "<tool_call>", "</tool_call>", ("</function>",), False
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def decode(self, region: str) -> Decoded:
        out = []
        functions = list(self._FUNCTION.finditer(region))
        if not functions or "".join(self._FUNCTION.split(region)[::3]).strip(_WS):
            return None  # no function, or text around the functions inside the tag
        for fn in functions:
            name, body = fn.group(1).strip(), fn.group(2)
            if "".join(self._PARAM.split(body)[::3]).strip(_WS):
                return None
            schema = self.tools.get(name) or {}
            props = schema.get("properties", {}) if isinstance(schema, dict) else {}
            args = {}
            for p in self._PARAM.finditer(body):
                key, value = p.group(1).strip(), p.group(2)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[key] = _typed(value, props.get(key))
            call = _call(name, args, self.tool_names)
            if call is None:
                return None
            out.append(call)
        return out


_JSON_KINDS = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"), (type(None), "null"))  # fmt: skip


def value_kinds(schema: Any) -> set[str]:
    """The JSON types a parameter schema names: its `type`, else those of its `enum` / `const` values (empty:
    unknown). A qwen3_coder value is text when this is empty or holds "string", else JSON."""
    if not isinstance(schema, dict):
        return set()
    kinds = schema.get("type")
    if kinds is not None:
        return {kinds} if isinstance(kinds, str) else {k for k in kinds if isinstance(k, str)}
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    values = values if isinstance(values, list) else []
    return {next(name for cls, name in _JSON_KINDS if isinstance(v, cls)) for v in values}


# Qwen3-Coder's template writes a scalar value with jinja's `| string`, i.e. Python's str(): True, False, None
_PYTHON_LITERALS = {"True": (True, "boolean"), "False": (False, "boolean"), "None": (None, "null")}


def _typed(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter value: text for string (or unknown) parameters, else its JSON value, or the Python
    literal the template renders for a boolean / null (text if neither parses, as vLLM keeps it)."""
    kinds = value_kinds(schema)
    if not kinds or "string" in kinds:
        return value
    try:
        return _loads(value.strip())
    except (ValueError, RecursionError):
        literal = _PYTHON_LITERALS.get(value.strip())
        return literal[0] if literal is not None and literal[1] in kinds else value


def _hermes(tool_names: Sequence[str] | None = None, tools: Mapping[str, Any] | None = None, *,
            forced: bool = False) -> Parser:  # fmt: skip
    return ToolCallParser(tool_names, forced=forced)


PARSERS: dict[str, Callable[..., Parser]] = {
    "hermes": _hermes,
    "mistral": MistralParser,
    "llama3_json": Llama3JsonParser,
    "qwen3_coder": Qwen3CoderParser,
    "deepseek_v3": DeepSeekV3Parser,
}
# template text -> parser, first match wins (qwen3_coder before hermes: both use <tool_call>)
_DETECT = (("[TOOL_CALLS]", "mistral"), ("<function=", "qwen3_coder"), ("<|python_tag|>", "llama3_json"),
           ("tool▁calls▁begin", "deepseek_v3"))  # fmt: skip


def check_parser_name(name: str) -> str:
    """`name` if it is a parser's, else ValueError listing them."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
    return name


def detect_parser(chat_template: str | None) -> str:
    """The parser a chat template's tool-call markup asks for (hermes when nothing else matches)."""
    for marker, name in _DETECT:
        if chat_template and marker in chat_template:
            return name
    return "hermes"


def new_parser(name: str, tool_names: Sequence[str] | None = None, tools: Mapping[str, Any] | None = None, *,
               forced: bool = False) -> Parser:  # fmt: skip
    """A fresh streaming parser of format `name` for one output; `forced`: a grammar-forced output (only calls:
    one that the budget cut short is dropped instead of returned as text)."""
    return PARSERS[check_parser_name(name)](tool_names, tools, forced=forced)


def parse(name: str, text: str, tool_names: Sequence[str] | None = None, tools: Mapping[str, Any] | None = None, *,
          forced: bool = False, cut: bool = False) -> tuple[str, list[ToolCall]]:  # fmt: skip
    """Parse a whole output at once: (content without tool-call markup, calls); `cut`: the budget ended it
    (`finish(cut=True)`: a call it cut short is dropped, not returned as text)."""
    parser = new_parser(name, tool_names, tools, forced=forced)
    parser.feed(text)
    parser.finish(cut)
    return parser.text, parser.calls


def tool_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """name -> parameter schema of `tools_common.function_tool` dicts (what qwen3_coder types values by)."""
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}

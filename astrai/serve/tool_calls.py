"""Tool calls in generated text: a streaming parser shared by the OpenAI and Anthropic APIs.

Formats recognised:
- Hermes / Qwen: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, any whitespace around the
  JSON, several calls in a row, text before, between and after them. A JSON list of calls inside one tag works
  too. The closing tag is optional (a model that stops right after the JSON still made the call).
- Bare JSON: the whole output is one call object, or a non-empty JSON list of them (Llama 3 / Mistral style).
  Decided only at the end of generation, because "whole output" cannot be known earlier.

A call object has a non-empty string `name` (in `tool_names` when given) and `arguments` (or Llama's
`parameters`): an object, or a JSON string holding an object (some models double-encode); missing or null means
`{}`. `ToolCall.arguments` is always the object's JSON text, so `json.loads(arguments)` is a dict (NaN and
Infinity are rejected: they are not JSON).

Streaming guarantees (the tests feed every text split at every character boundary):
- the events concatenate to the same text and calls as the one-shot `parse_tool_calls`;
- a call is announced only once its JSON is complete and valid: `ToolCallStart`, one `ToolCallArgs` with the
  whole `arguments`, `ToolCallEnd`, in one batch. The contract allowed the name earlier, but a call whose JSON
  then fails could not be taken back from a client, so correctness wins over a few tokens of eagerness;
- text that may be the start of `<tool_call>` is held back, and so is trailing whitespace (whitespace next to
  tool-call markup is dropped, so "Let me check.\\n\\n<tool_call>..." gives the content "Let me check.");
- a call whose JSON does not parse, or never completes, comes out as plain text: nothing is lost.

`prefix` is text pre-filled into the assistant turn: it is parsed as if the model had said it but never emitted as
text. `forced`: the output is grammar-forced calls (tool_choice "required" / named / any / tool); the one call
that the token budget may cut short at the end is dropped instead of becoming text.

Other markups (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`, Qwen3-Coder's XML, DeepSeek's tool tokens) are
`astrai.serve.tool_parsers`'s, which also holds the registry of parsers by name.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

import attrs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_WS = " \t\r\n"
_MAX_DEPTH = 256  # deeper JSON is treated as text rather than risking json's recursion limit


@attrs.frozen
class ToolCall:
    """A complete tool call: `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@attrs.frozen
class TextDelta:
    """Plain content (no tool-call markup)."""

    text: str


@attrs.frozen
class ToolCallStart:
    """A call begins: its index among this output's calls, id and function name."""

    index: int
    id: str
    name: str


@attrs.frozen
class ToolCallArgs:
    """A fragment of a call's arguments; a call's fragments concatenate to its `arguments`."""

    index: int
    text: str


@attrs.frozen
class ToolCallEnd:
    """A call is complete."""

    index: int


Event = TextDelta | ToolCallStart | ToolCallArgs | ToolCallEnd


def new_call_id() -> str:
    """An OpenAI-style call id, `call_<24 hex>`."""
    return "call_" + secrets.token_hex(12)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _decode_calls(raw: str, tool_names: frozenset[str] | None) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) for a call object or a non-empty list of them; None if `raw` is not that."""
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name = item.get("name")
        if not isinstance(name, str) or not name or (tool_names is not None and name not in tool_names):
            return None
        args = item.get("arguments", item.get("parameters"))
        if isinstance(args, str):  # double-encoded arguments, as in OpenAI's own wire format
            try:
                args = json.loads(args, parse_constant=_reject_constant)
            except (ValueError, RecursionError):
                return None
        args = {} if args is None else args
        if not isinstance(args, dict):
            return None
        out.append((name, json.dumps(args, ensure_ascii=False)))
    return out or None


class _Scanner:
    """Finds the end of one JSON object/array, incrementally, aware of strings and escapes (no regex)."""

    def __init__(self, start: int) -> None:
        self.start, self.pos, self.depth, self.in_str, self.esc = start, start, 0, False, False

    def scan(self, text: str) -> int | None:
        """Scan new characters; the index just past the value once it closed, -1 if too deep, else None."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
                if self.depth > _MAX_DEPTH:
                    return -1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        self.pos = len(text)
        return None


class ToolCallParser:
    """Streaming tool-call parser for one generated output (see the module docstring for the rules).

    Attributes:
        calls: the complete calls so far.
        text: the content emitted so far (no tool-call markup).
    """

    def __init__(self, tool_names: Sequence[str] | None = None, prefix: str = "", *, forced: bool = False) -> None:
        """Start a parse.

        Args:
            tool_names: allowed function names (None: any); a call to another name stays text.
            prefix: text pre-filled into the assistant turn: parsed, never emitted.
            forced: the output is grammar-forced calls (`tool_grammars.forced_call_grammar`): a call cut short by
                the token budget at the end is dropped rather than given back as text.
        """
        self._forced = forced
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.calls: list[ToolCall] = []
        self.text = ""
        self._all, self._hidden, self._cur = prefix, len(prefix), 0
        self._mode = "start"  # start | text | call | after | bare | bare_done | done
        self._bare_ok = not prefix  # bare JSON only when the model's output is the whole turn
        self._scanner: _Scanner | None = None
        self._tag_at = 0  # call mode: where the whitespace before `<tool_call>` began
        self._pending: list[tuple[str, str]] = []  # bare_done: the decoded calls, announced at finish
        self._events: list[Event] = []
        self._run(final=False)

    def feed(self, text: str) -> list[Event]:
        """Add generated text; returns the events it completes."""
        self._all += text
        self._run(final=False)
        self._compact()
        return self._take()

    def finish(self, cut: bool = False) -> list[Event]:
        """End of generation: release held text, announce bare calls, turn an unterminated call into text.

        `cut`: the token budget ended the output (finish_reason "length"): a call it cut short, and a half-written
        `<tool_call>` tag, are dropped rather than given back as text, so under tool_choice "auto" no markup reaches
        the content (a forced output always drops them)."""
        tail = self._all[self._cur :].strip(_WS)
        if self._forced or cut:  # drop the unfinished call (and a half-written tag)
            if self._mode == "call":
                self._all, self._cur, self._mode = self._all[: self._tag_at], self._tag_at, "text"
            elif self._mode in ("text", "after") and OPEN.startswith(tail) and (tail or self._forced):
                self._all = self._all[: self._cur]  # the held-back tag and the whitespace before it
            elif self._mode == "after" and tail and CLOSE.startswith(tail):
                self._all = self._all[: self._cur]  # a closing tag cut short after a complete call
        self._run(final=True)
        self._mode = "done"
        return self._take()

    # ---- internals ----------------------------------------------------------------------------------------
    def _take(self) -> list[Event]:
        merged: list[Event] = []
        for event in self._events:
            if isinstance(event, TextDelta) and merged and isinstance(merged[-1], TextDelta):
                merged[-1] = TextDelta(merged[-1].text + event.text)
            else:
                merged.append(event)
        self._events = []
        return merged

    def _compact(self) -> None:
        # keep only the undecided window, so a long output costs O(length) and not O(length^2)
        k = self._tag_at if self._mode == "call" else 0 if self._mode in ("bare", "bare_done") else self._cur
        if k <= 0:
            return
        self._all, self._cur, self._tag_at = self._all[k:], self._cur - k, self._tag_at - k
        self._hidden = max(0, self._hidden - k)
        if self._scanner is not None:
            self._scanner.start, self._scanner.pos = self._scanner.start - k, self._scanner.pos - k

    def _emit_text(self, start: int, end: int) -> None:
        piece = self._all[max(start, self._hidden) : end]  # the pre-filled prefix is never content
        if piece:
            self.text += piece
            self._events.append(TextDelta(piece))

    def _emit_calls(self, decoded: list[tuple[str, str]]) -> None:
        for name, args in decoded:
            call = ToolCall(id=new_call_id(), name=name, arguments=args)
            index = len(self.calls)
            self.calls.append(call)
            self._events += [ToolCallStart(index, call.id, name), ToolCallArgs(index, args), ToolCallEnd(index)]

    def _run(self, final: bool) -> None:
        steps = {"start": self._start, "text": self._text, "call": self._call, "after": self._after,
                 "bare": self._bare, "bare_done": self._bare_done}  # fmt: skip
        while self._mode in steps and steps[self._mode](final):
            pass  # each step returns True when it changed state and the next one should look again

    def _start(self, final: bool) -> bool:
        j = _skip_ws(self._all, self._cur)
        if j == len(self._all) and not final:
            return False
        if self._bare_ok and j < len(self._all) and self._all[j] in "{[":
            self._mode, self._scanner = "bare", _Scanner(j)
        else:
            self._mode = "text"
        return True

    def _text(self, final: bool) -> bool:
        rest = self._all[self._cur :]
        i = rest.find(OPEN)
        if i >= 0:
            self._tag_at = self._cur + len(rest[:i].rstrip(_WS))
            self._emit_text(self._cur, self._tag_at)
            self._cur += i + len(OPEN)
            self._mode, self._scanner = "call", None
            return True
        if final:
            self._emit_text(self._cur, len(self._all))
            self._cur = len(self._all)
            return False
        keep = rest[: len(rest) - _partial_suffix(rest, OPEN)]
        safe = self._cur + len(keep.rstrip(_WS))  # trailing whitespace may turn out to precede a tag
        self._emit_text(self._cur, safe)
        self._cur = safe
        return False

    def _call(self, final: bool) -> bool:
        if self._scanner is None:
            j = _skip_ws(self._all, self._cur)
            if j == len(self._all):
                return self._fail_call() if final else False
            if self._all[j] not in "{[":
                return self._fail_call()
            self._scanner = _Scanner(j)
        scanned = self._scan_json(final)
        if scanned is None:
            return False
        end, decoded = scanned
        if decoded is None:
            return self._fail_call()
        self._emit_calls(decoded)
        self._cur, self._mode = end, "after"
        return True

    def _scan_json(self, final: bool) -> tuple[int, list | None] | None:
        """Scan the JSON value the scanner started on: None while it may still grow; else (its end, the decoded
        calls, or None when it is incomplete at the end of the text or not a valid call)."""
        assert self._scanner is not None
        end = self._scanner.scan(self._all)
        if end is None:
            return (0, None) if final else None
        decoded = _decode_calls(self._all[self._scanner.start : end], self.tool_names) if end > 0 else None
        return end, decoded

    def _fail_call(self) -> bool:
        # the tag (and the whitespace before it) becomes text; what followed it is scanned again as text
        self._cur = self._all.index(OPEN, self._tag_at) + len(OPEN)
        self._emit_text(self._tag_at, self._cur)
        self._mode = "text"
        return True

    def _after(self, final: bool) -> bool:
        j = _skip_ws(self._all, self._cur)
        rest = self._all[j:]
        if rest.startswith(CLOSE):
            self._cur = j + len(CLOSE)
            return True
        if rest.startswith(OPEN):
            self._cur, self._mode = j, "text"  # text mode finds the tag at once
            return True
        if not final and (CLOSE.startswith(rest) or OPEN.startswith(rest)):  # may still become a tag
            return False
        self._cur, self._mode = j, "text"  # whitespace next to the markup is dropped
        return True

    def _bare(self, final: bool) -> bool:
        scanned = self._scan_json(final)
        if scanned is None:
            return False
        end, decoded = scanned
        if decoded is None:
            return self._fail_bare()
        self._pending, self._cur, self._mode = decoded, end, "bare_done"
        return True

    def _bare_done(self, final: bool) -> bool:
        if _skip_ws(self._all, self._cur) < len(self._all):  # more than the JSON: it was text after all
            return self._fail_bare()
        if final:
            self._emit_calls(self._pending)
            self._cur, self._mode = len(self._all), "done"
        return False

    def _fail_bare(self) -> bool:
        self._cur, self._mode, self._bare_ok, self._pending = 0, "text", False, []
        return True


def parse_tool_calls(
    text: str, tool_names: Sequence[str] | None = None, prefix: str = ""
) -> tuple[str, list[ToolCall]]:
    """Parse a whole output at once: (content without tool-call markup, calls); same rules as the stream."""
    parser = ToolCallParser(tool_names, prefix)
    parser.feed(text)
    parser.finish()
    return parser.text, parser.calls

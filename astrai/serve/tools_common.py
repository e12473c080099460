"""Tool-use rules that the OpenAI and Anthropic APIs share: tool names, the chat template's tool and tool-call
dicts, and the grammar that forces a call.

Both APIs hand the chat template OpenAI-shaped dicts (that is what Hugging Face templates read). Both force a tool
call (OpenAI tool_choice "required" / a named function, Anthropic "any" / "tool") with a grammar
(`forced_call_grammar`, a Lark grammar with one `%json` schema per allowed tool, compiled by the engine like any
other `SamplingParams.grammar`): the output can only be Hermes `<tool_call>` calls whose arguments match the
tool's parameters, so the forced call always parses, whatever the model. Validation messages stay in each API's
own module, since each mimics its own service's wording.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from astrai.inference.params import GrammarSpec

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # both services' rule for function names
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool as the chat template takes it; absent fields are left out.

    Key order is OpenAI's (name, description, parameters): templates render these dicts as JSON, so the order
    reaches the prompt.
    """
    spec: dict[str, Any] = {"name": name}
    if description is not None:
        spec["description"] = description
    if parameters is not None:
        spec["parameters"] = parameters
    return {"type": "function", "function": spec}


def template_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool call as the chat template takes it (`arguments` an object, not JSON text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_names(tools: Iterable[dict[str, Any]]) -> tuple[str, ...]:
    """Function names of `function_tool` dicts, in order (the names the tool-call parser accepts)."""
    return tuple(t["function"]["name"] for t in tools)


# ---- forced tool calls through a grammar ----------------------------------------------------------------------
# the Hermes call's JSON as chat templates render it (tojson's separators), with no free whitespace: a weak model
# cannot pad forever inside a forced call
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HOISTED = ("$defs", "definitions")  # `#/$defs/X` refs in a tool's parameters keep working under "arguments"


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """JSON schema of one Hermes call object `{"name": NAME, "arguments": ARGS}`, ARGS valid for `parameters`.

    A tool without parameters takes any object. The parameters' `$defs` / `definitions` move to the root, so
    their `#/$defs/...` references still resolve.
    """
    params = dict(parameters) if isinstance(parameters, dict) and parameters else {"type": "object"}
    hoisted = {k: params.pop(k) for k in _HOISTED if k in params}
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False, **hoisted,
            "x-guidance": _CALL_JSON}  # fmt: skip


def tag_terminal(tokenizer: Any, text: str) -> tuple[str, bool]:
    """(the Lark terminal for the markup `text`, whether it is a special token).

    Real Qwen vocabularies have `<tool_call>` as an added token; when it is marked special it matches no text in
    the grammar engine, so the grammar names its id (`<[id]>`), and the request must keep special tokens' text in
    the output for the parser to see the tag.
    """
    if tokenizer is not None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in tokenizer.special_token_ids:
            return f"<[{ids[0]}]>", True
    return json.dumps(text), False


def forced_call_grammar(tools: Sequence[dict[str, Any]], name: str | None = None, *, parallel: bool = True,
                        tokenizer: Any = None) -> tuple[str, bool]:  # fmt: skip
    """The Lark grammar (llguidance's dialect) of a forced Hermes tool call, and whether it uses special tokens.

    The output must be `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` for one of `tools`
    (`function_tool` dicts), or for the tool `name` only, ARGS valid for that tool's parameters; then the
    sequence ends. `parallel`: one or more calls, separated by a newline; otherwise exactly one.
    """
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}")
    rules, special = _call_rules(chosen, tokenizer)
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join(["%llguidance {}", start, *rules]) + "\n", special


def auto_call_grammar(tools: Sequence[dict[str, Any]], *, parallel: bool = True, tokenizer: Any = None
                      ) -> tuple[str, bool]:  # fmt: skip
    """The grammar of tool_choice "auto" (Hermes markup): free text, or text then well-formed calls.

    Text may say anything except the opening tag; once the tag is written, what follows must be a complete call
    to one of `tools` with valid arguments, then (`parallel`) more calls separated by a newline, then the end.
    So a model that starts a call always finishes one the parser reads, and text never holds a broken call.
    Returns the grammar and whether the tags are special tokens (as `forced_call_grammar`).
    """
    rules, special = _call_rules([t["function"] for t in tools], tokenizer)
    more = ' ("\\n" call)*' if parallel else ""
    text = "TEXT: /(?s:.+)/ & ~/(?s:.*" + re.escape(OPEN_TAG) + ".*)/"  # never the tag's text
    if special:  # the tag is one token, which no text matches: text ends where it is sampled
        start = f"start: TEXT? | TEXT? call{more}"
    else:  # text up to and including the tag (a lazy lexeme that stops there), then the rest of the call
        rules.append(f"lead[stop={json.dumps(OPEN_TAG)}]: /(?s:.*)/")
        start = f"start: TEXT? | lead call_rest{more}"
    return "\n".join(["%llguidance {}", start, text, *rules]) + "\n", special


def _call_rules(functions: Sequence[dict[str, Any]], tokenizer: Any) -> tuple[list[str], bool]:
    """`call` (the opening tag, then `call_rest`: the call after its tag), `body` and one `%json` rule per
    function; whether the tags are special tokens."""
    (open_t, special_open), (close_t, special_close) = (tag_terminal(tokenizer, OPEN_TAG),
                                                        tag_terminal(tokenizer, CLOSE_TAG))  # fmt: skip
    rules = [f"call: {open_t} call_rest", 'call_rest: "\\n" body "\\n" ' + close_t,
             "body: " + " | ".join(f"call_{i}" for i in range(len(functions)))]  # fmt: skip
    for i, fn in enumerate(functions):
        rules.append(f"call_{i}: %json " + json.dumps(call_schema(fn["name"], fn.get("parameters"))))
    return rules, special_open or special_close


def tool_call_grammar(tools: Sequence[dict[str, Any]], forced: str | None, *, parallel: bool, tokenizer: Any = None,
                      tool_parser: str = "hermes") -> tuple[GrammarSpec | None, bool]:  # fmt: skip
    """What both APIs constrain a tool request with: `forced` None (tool_choice auto) gives `auto_call_grammar`
    (only with the hermes parser, else None: unconstrained), "" any tool and a name that tool
    (`forced_call_grammar`). Also whether the tags are special tokens (the request must then keep them as text)."""
    if forced is None:
        if not tools or tool_parser != "hermes":
            return None, False
        source, special = auto_call_grammar(tools, parallel=parallel, tokenizer=tokenizer)
    else:
        source, special = forced_call_grammar(tools, forced or None, parallel=parallel, tokenizer=tokenizer)
    return GrammarSpec(kind="lark", source=source, param="tool_choice"), special

"""OpenAI Responses request bodies (`POST /v1/responses`) -> the chat machinery's input.

A Responses request is mapped onto a /v1/chat/completions body and validated by `openai_protocol.parse_chat`, so
the chat template, tool grammars, structured output and sampling all behave exactly as on the chat route; errors
that the chat validation raises are renamed to the Responses field (`max_tokens` -> `max_output_tokens`,
`response_format` -> `text.format`, `messages[...]` -> `input`, ...). This module never sees server state: the
handler (`responses_api`) passes the earlier turns of a `previous_response_id` in as chat messages.

Mapped:
- `input`: a string (one user message) or a list of items: messages (`role` user / system / developer /
  assistant, `content` a string or `input_text` / `output_text` parts), `function_call` items (call_id, name,
  arguments: an assistant message's `tool_calls`; consecutive calls, and a call right after an assistant
  message, join that message), `function_call_output` items (call_id, output: a `tool` message), `reasoning`
  items (their text becomes the next assistant message's `reasoning_content`).
- `instructions` (a system message before everything; not carried over by `previous_response_id`, as OpenAI).
- `tools` of type function (name, description, parameters, strict) and `tool_choice` (auto, none, required,
  `{"type": "function", "name": ...}`), `parallel_tool_calls`.
- `text.format` (text, json_object, json_schema with name / schema / strict) -> `response_format`;
  `text.verbosity` and `reasoning.effort` -> the chat template's `verbosity` / `reasoning_effort`.
- `max_output_tokens` -> `max_tokens`; `temperature`, `top_p`, `stream`.
- accepted without effect: `metadata`, `user`, `service_tier`, `safety_identifier`, `prompt_cache_key`,
  `reasoning.summary`, `include` (empty), `truncation` "disabled", `store` and `previous_response_id` (the
  handler's), `model` (the served name is echoed).

Refused with a 400 naming the field: `background: true`, `conversation`, `prompt` (stored prompts), built-in
tools (web_search, file_search, computer use, ...), non-text content parts, `item_reference` items, `truncation`
"auto", `max_tool_calls`, `top_logprobs`, and any unknown field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from astrai.serve.common import APIError
from astrai.serve.openai_protocol import ChatRequest, parse_chat
from astrai.serve.sampling_fields import bad, show

if TYPE_CHECKING:
    from astrai.io.tokenizer import Tokenizer

FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "max_output_tokens",
    "temperature", "top_p", "reasoning", "metadata", "user", "store", "stream", "previous_response_id", "include",
    "truncation", "service_tier", "safety_identifier", "prompt_cache_key", "stream_options", "cache_salt"})  # fmt: skip
"""Top-level fields a Responses request may hold (anything else is a 400 naming it)."""
REFUSED = {"background": "background responses", "conversation": "conversations (use previous_response_id)",
           "prompt": "stored prompt templates", "max_tool_calls": "a cap on built-in tool calls",
           "top_logprobs": "logprobs on this route (use /v1/chat/completions)"}  # fmt: skip
"""Fields refused with a 400 unless null / false, and why."""
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# chat-validation param -> the Responses field it came from (prefix match, longest first)
_RENAMES = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
            ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("reasoning_effort", "reasoning.effort"), ("verbosity", "text.verbosity"),
            ("messages", "input"))  # fmt: skip
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function\.")


def rename_param(param: str | None) -> str | None:
    """The Responses field of a chat-validation `param` (e.g. `max_tokens` -> `max_output_tokens`)."""
    if param is None:
        return None
    param = _TOOL_PARAM.sub(r"tools[\1].", param)
    for old, new in _RENAMES:
        if param == old or param.startswith(old + ".") or param.startswith(old + "["):
            return "input" if old == "messages" else new + param[len(old) :]
    return param


def _text(content: Any, where: str) -> str:
    """A message's (or output's) text: a string, or a list of input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"{where} must be a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad(f"{where}[{j}].type", f"content part type {show(kind)} is not supported (input_text and "
                                             "output_text only)")  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}].text", "a text part needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", f"{where}.{key} must be a string")
    return value


def input_messages(value: Any) -> list[dict]:
    """`input` (a string or a list of items) as chat-completions messages (400 naming `input[i]...`)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "input must be a string or a non-empty list of items")
    out: list[dict] = []
    reasoning: list[str] = []  # reasoning items' text, for the next assistant message

    def assistant() -> dict:
        """The assistant message a function call joins: the last one when nothing came after it, else a new one."""
        if out and out[-1]["role"] == "assistant":
            return out[-1]
        out.append({"role": "assistant", "content": None})
        return out[-1]

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"{where} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad(f"{where}.role", f"unknown role {show(role)}; expected one of {', '.join(_ROLES)}")
            msg = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = "\n".join(reasoning), []
            out.append(msg)
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            arguments = _string(item, "arguments", where)
            msg = assistant()
            if reasoning:
                msg["reasoning_content"], reasoning = "\n".join(reasoning), []
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            msg.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning += [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        else:
            raise bad(f"{where}.type", f"input item type {show(kind)} is not supported (message, function_call, "
                                       "function_call_output, reasoning)")  # fmt: skip
    return out


def _tools(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("tools", "tools must be a list")
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad(f"tools[{i}].type", f"tool type {show(kind)} is not supported: only function tools (built-in "
                                          "tools such as web_search or file_search are not offered)")  # fmt: skip
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        if tool.get("strict") not in (None, True, False):
            raise bad(f"tools[{i}].strict", "strict must be a boolean")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad("tool_choice", f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'name': "
                             f"...}}, got {show(value)}")  # fmt: skip


def _text_config(value: Any) -> dict:
    """`text` -> the chat body's `response_format` / `verbosity`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("text", "text must be an object")
    out: dict[str, Any] = {}
    if value.get("verbosity") is not None:
        out["verbosity"] = value["verbosity"]
    fmt = value.get("format")
    if fmt is None:
        return out
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        out["response_format"] = {"type": kind}
    elif kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        if not isinstance(fmt.get("schema"), dict):
            raise bad("text.format.schema", "a json_schema format needs a schema object")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", **spec}}
    else:
        raise bad("text.format.type", f"text.format type must be text, json_object or json_schema, got {show(kind)}")
    return out


def _reasoning(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("reasoning", "reasoning must be an object")
    return {} if value.get("effort") is None else {"reasoning_effort": value["effort"]}


def check_fields(body: dict) -> None:
    """400 naming the first unknown or refused top-level field (refused ones may be null / false)."""
    for key, value in body.items():
        if key in REFUSED:
            if value is not None and value is not False:
                raise bad(key, f"{key} is not supported by this server ({REFUSED[key]})")
        elif key not in FIELDS:
            raise bad(key, f"unknown field {key!r}: this route accepts {', '.join(sorted(FIELDS))} "
                           "(docs/serving.md, 'Responses API')")  # fmt: skip
    for key, kind in (("store", bool), ("user", str), ("previous_response_id", str), ("instructions", str)):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise bad(key, f"{key} must be a {'boolean' if kind is bool else 'string'}, got {show(body[key])}")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items())):  # fmt: skip
        raise bad("metadata", "metadata must be an object of at most 16 string values (keys <= 64 characters, "
                              "values <= 512)")  # fmt: skip
    if body.get("include"):
        raise bad("include", "include is not supported (no extra output data is offered); send [] or omit it")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation", "truncation 'auto' is not supported: a prompt longer than the context is a 400")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise bad("stream_options", "stream_options needs stream: true")


def chat_body(body: dict, history: list[dict]) -> dict:
    """The /v1/chat/completions body a Responses `body` stands for; `history`: the chat messages of the
    `previous_response_id` chain (its inputs and outputs), put before this request's input."""
    check_fields(body)
    instructions = body.get("instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {"messages": system + history + input_messages(body.get("input"))}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    for key in ("temperature", "top_p", "parallel_tool_calls", "stream", "cache_salt"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return {**chat, **_text_config(body.get("text")), **_reasoning(body.get("reasoning"))}


@attrs.frozen
class ResponsesRequest:
    """A validated Responses request: the chat request it runs as, and the conversation so far (for the store)."""

    chat: ChatRequest
    messages: list[dict]  # the chat messages of the whole conversation sent (history + input), no instructions


def parse_responses(body: dict, history: list[dict], tokenizer: Tokenizer | None, *, vocab_size: int, context: int,
                    allow_special_tokens: bool = False, defaults: Mapping[str, Any] | None = None,
                    tool_parser: str = "hermes") -> ResponsesRequest:  # fmt: skip
    """Validate a /v1/responses body and render its prompt (on the worker pool: it tokenizes).

    Raises:
        APIError: 400 naming the Responses field in `param`.
    """
    try:
        chat = chat_body(body, history)
        request = parse_chat(chat, tokenizer, vocab_size=vocab_size, context=context,
                             allow_special_tokens=allow_special_tokens, defaults=defaults,
                             tool_parser=tool_parser)  # fmt: skip
    except APIError as err:
        raise attrs.evolve(err, param=rename_param(err.param)) from None
    instructions = 1 if body.get("instructions") else 0
    return ResponsesRequest(request, chat["messages"][instructions:])

"""OpenAI request bodies -> validated, typed requests for `/v1/chat/completions` and `/v1/completions`.

Chat completions accept:
- `messages` with roles system / developer (= system) / user / assistant / tool; `content` a string, null (an
  assistant turn with `tool_calls`) or a list of `{"type": "text"}` parts (joined with newlines; any other part
  type is a 400 naming it). Assistant `tool_calls` carry JSON-string `arguments` (parsed to objects for the
  chat template; invalid JSON is a 400); `tool` messages carry `tool_call_id`. Everything reaches the prompt
  through the model's chat template, so tool results are seen on the next turn.
- `tools` (type "function": name matching ^[a-zA-Z0-9_-]{1,64}$, unique; optional description and an object
  JSON-schema `parameters`) and `tool_choice`: "none" (tools not rendered, output not parsed), "auto" (default
  with tools), "required" (the assistant turn is pre-filled with `<tool_call>\\n{"name": "`), or
  `{"type": "function", "function": {"name": ...}}` (pre-filled up to `"arguments": `). The output is parsed by
  `astrai.serve.tool_calls` (Hermes `<tool_call>` markup or bare JSON); parsed calls come back as `tool_calls`
  with `arguments` a JSON string of an object, and finish_reason "tool_calls".
- sampling: `n` (<= 16), `temperature` [0, 2], `top_p`, `presence_penalty`, `frequency_penalty`, `logit_bias`,
  `seed`, `stop` (a string or <= 16 strings), `max_tokens` / `max_completion_tokens` (default: the rest of the
  context), `logprobs` + `top_logprobs` (0..20), `stream` + `stream_options.include_usage`; extensions (vLLM
  names): `top_k` (0 or -1 = off), `min_p`, `repetition_penalty`, `ignore_eos`. `model` may be any string (the
  served name is echoed); `user`, `parallel_tool_calls`, `store`, `metadata`, `service_tier` are ignored.
- rejected with a 400: `response_format` other than text (no guided decoding), `functions` / `function_call`
  (the deprecated API: use tools), `audio` / non-text `modalities`.

Special-token text in chat messages (a user writing `<|im_end|>`) is encoded as plain text, so only the chat
template makes control tokens (`astrai serve --allow-special-tokens-in-content` turns that off). A completions
`prompt` is raw: it is the client's own template, so special-token text in it is encoded as special tokens.

Completions accept `prompt` as a string or a list of token ids (a one-element list of either is unwrapped; a
batch of several prompts is a 400: send one request each), `echo` (not with `logprobs`: prompt logprobs are not
computed), `logprobs` as an int 0..20 (legacy shape with `text_offset`), `max_tokens` (default 16, as OpenAI),
the same sampling fields and streaming. `suffix` and `best_of` != n are 400s.

Every bad field is an `APIError` 400 naming `param` (OpenAI's error shape is rendered by `openai_api`). What
happens after validation (streaming, logprobs, usage, errors mid-request) is documented in `openai_api`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import attrs

from astrai.inference.params import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from astrai.serve.common import APIError
from astrai.serve.tools_common import FORCE_ANY, TOOL_NAME, force_tool, function_tool, template_call, tool_names

if TYPE_CHECKING:
    from astrai.io.tokenizer import Tokenizer

_ROLES = ("system", "developer", "user", "assistant", "tool")
_UNSUPPORTED = {"functions": "use tools", "function_call": "use tool_choice", "audio": "audio output",
                "suffix": "insertion", "prediction": "predicted outputs"}  # fmt: skip


def _bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


def _show(value: Any) -> str:
    return json.dumps(value)[:60]


# ---- field validation ---------------------------------------------------------------------------------------
def _number(body: dict, key: str, default: Any, lo: float | None, hi: float | None, *, integer: bool = False) -> Any:
    """body[key] checked to be a number (an int if `integer`) in [lo, hi]; `default` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float) or value != value:
        raise _bad(key, f"{key} must be {'an integer' if integer else 'a number'}, got {_show(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise _bad(key, f"{key} must be {bounds}, got {value}")
    return value


def _integer(body: dict, key: str, default: Any, lo: int | None, hi: int | None) -> Any:
    return _number(body, key, default, lo, hi, integer=True)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise _bad(key, f"{key} must be a boolean, got {_show(value)}")
    return bool(value)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", f"stop must be a non-empty string or a list of them, got {_show(body['stop'])}")
    return tuple(stop)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias") or {}
    try:
        if not isinstance(bias, dict) or any(isinstance(v, bool) for v in bias.values()):
            raise TypeError
        return tuple((int(k), float(v)) for k, v in bias.items())
    except (TypeError, ValueError):
        raise _bad("logit_bias", f"logit_bias must map token ids (strings) to numbers, got {_show(bias)}") from None


def _common_checks(body: dict) -> None:
    for key, what in _UNSUPPORTED.items():
        if body.get(key) is not None:
            raise _bad(key, f"{key} is not supported by this server ({what})")
    if not isinstance(body.get("model", ""), str):
        raise _bad("model", f"model must be a string, got {_show(body['model'])}")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not _flag(body, "stream"):
            raise _bad("stream_options", "stream_options must be an object, and only given when stream is true")
        _flag(options, "include_usage")
    best_of = _integer(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != _integer(body, "n", 1, 1, MAX_N):
        raise _bad("best_of", "best_of must equal n (no server-side best-of selection)")


_PARAMS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
           "repetition_penalty", "logit_bias", "seed", "n", "top_logprobs", "stop"}  # fmt: skip


def _sampling(body: dict, vocab_size: int, *, max_tokens: int, top_logprobs: int | None) -> SamplingParams:
    """SamplingParams from the request fields, validated; `top_logprobs` None: no logprobs."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, -1, None),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, None),
        logit_bias=_logit_bias(body),
        seed=_integer(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        n=_integer(body, "n", 1, 1, MAX_N),
        logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs or 0,
        stop=_stop(body),
        ignore_eos=_flag(body, "ignore_eos"),
    )
    try:
        params.check(vocab_size)
    except ValueError as err:  # EngineInputError: `param` names the field
        field = getattr(err, "param", None)
        raise _bad(field if field in _PARAMS else None, str(err)) from None
    return params


def _max_tokens(body: dict, keys: tuple[str, ...], prompt_len: int, default: int | None, prompt_param: str,
                context: int) -> int:  # fmt: skip
    """The first of `keys` given, else `default` or else the rest of the `context` (tokens a sequence may hold)."""
    if prompt_len >= context:
        raise _bad(prompt_param, f"the prompt has {prompt_len} tokens, but the model's context is {context} tokens: "
                                 "no room to generate")  # fmt: skip
    for key in keys:
        value = _integer(body, key, None, 1, None)
        if value is not None:
            return value
    return context - prompt_len if default is None else min(default, context - prompt_len)


# ---- chat requests ------------------------------------------------------------------------------------------
def _content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(where, f"{where} must be a string, null or a list of text parts")
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise _bad(f"{where}[{j}].type", f"content part type {kind!r} is not supported (text only)")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}].text", "a text part needs a string 'text'")
    return "\n".join(part["text"] for part in value)


def _assistant_calls(calls: Any, where: str, names: dict[str, str]) -> list[dict]:
    """OpenAI tool_calls with their JSON-string arguments parsed (templates render objects); records id -> name."""
    if not isinstance(calls, list):
        raise _bad(where, f"{where} must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}[{j}].function", "a tool call needs a function with a name")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError) as err:
            raise _bad(f"{where}[{j}].function.arguments", f"arguments must be a JSON string: {err}") from None
        if not isinstance(args, dict):
            raise _bad(f"{where}[{j}].function.arguments", "arguments must encode a JSON object")
        call_id = call["id"] if isinstance(call.get("id"), str) else f"call_{j}"
        names[call_id] = fn["name"]
        out.append(template_call(call_id, fn["name"], args))
    return out


def _messages(body: dict) -> list[dict]:
    """The conversation as chat-template messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list")
    out: list[dict] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for templates that show it on results
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _ROLES:
            raise _bad(f"{where}.role", f"unknown role {role!r}; expected one of {', '.join(_ROLES)}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        msg["content"] = _content(m.get("content"), f"{where}.content")
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _assistant_calls(m["tool_calls"], f"{where}.tool_calls", call_names)
        elif msg["content"] is None and role != "assistant":
            raise _bad(f"{where}.content", f"a {role} message needs content")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise _bad(f"{where}.tool_call_id", "a tool message needs a string tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
            if m["tool_call_id"] in call_names:
                msg["name"] = call_names[m["tool_call_id"]]
        elif isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _tool(tool: Any, where: str, seen: set[str]) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict):
        raise _bad(where, "a tool must be {'type': 'function', 'function': {...}}")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name) or name in seen:
        raise _bad(f"{where}.function.name", f"tool names must be unique and match ^[a-zA-Z0-9_-]{{1,64}}$, got "
                                             f"{_show(name)}")  # fmt: skip
    seen.add(name)
    description, parameters = fn.get("description"), fn.get("parameters")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.function.description", "description must be a string")
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
        raise _bad(f"{where}.function.parameters", "parameters must be a JSON schema of type 'object'")
    return function_tool(name, description, parameters)


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be a list")
    seen: set[str] = set()
    return [_tool(tool, f"tools[{i}]", seen) for i, tool in enumerate(tools)]


def _tool_choice(body: dict, tools: list[dict]) -> tuple[bool, str]:
    """(whether tools are rendered and parsed, the assistant-turn pre-fill that forces a call)."""
    choice = body.get("tool_choice")
    if choice in (None, "auto", "none"):
        return bool(tools) and choice != "none", ""
    if choice == "required":
        if not tools:
            raise _bad("tool_choice", "tool_choice 'required' needs tools")
        return True, FORCE_ANY
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}")  # fmt: skip
    if fn["name"] not in tool_names(tools):
        raise _bad("tool_choice", f"tool_choice names the function {fn['name']!r}, which is not in tools")
    return True, force_tool(fn["name"])


@attrs.frozen
class ChatRequest:
    """A validated chat completions request."""

    prompt: list[int]  # chat template + pre-fill, as token ids
    params: SamplingParams
    stream: bool
    include_usage: bool
    parse: bool  # whether tool calls are parsed from the output (tools given, tool_choice not "none")
    tool_names: tuple[str, ...]
    prefill: str


def parse_chat(body: dict, tokenizer: Tokenizer | None, *, vocab_size: int, context: int,
               allow_special_tokens: bool = False) -> ChatRequest:  # fmt: skip
    """Validate a /v1/chat/completions body and render its prompt through the chat template.

    Renders and tokenizes (seconds for a multi-megabyte body): handlers run it on the server's worker pool.

    Args:
        body: the request's JSON object.
        tokenizer: the served model's tokenizer (None: chat is refused).
        vocab_size: token ids (logit_bias keys) must be below it.
        context: tokens one sequence may hold, prompt and completion together.
        allow_special_tokens: special-token text in the messages becomes control tokens (by default it is
            encoded as plain text, see `Tokenizer.encode_chat`).

    Returns:
        The request with its prompt as token ids (template + tool-call pre-fill).

    Raises:
        APIError: 400 naming the offending field in `param`.
    """
    _common_checks(body)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("response_format", "only response_format {'type': 'text'} is supported (no guided decoding)")
    if body.get("modalities") not in (None, ["text"]):
        raise _bad("modalities", "only the text modality is supported")
    messages, tools = _messages(body), _tools(body)
    parse, prefill = _tool_choice(body, tools)
    rendered = tools if parse else []
    if tokenizer is None:
        raise _bad(None, "the served model has no tokenizer: use /v1/completions with token ids")
    try:
        prompt = tokenizer.encode_chat(messages, tools=rendered or None, head=prefill,
                                       special_tokens_in_content=allow_special_tokens)  # fmt: skip
    except (ValueError, TypeError) as err:
        raise _bad("messages", f"the chat template rejected the messages: {err}") from None
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top and not _flag(body, "logprobs"):
        raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
    keys = ("max_completion_tokens", "max_tokens")
    max_tokens = _max_tokens(body, keys, len(prompt), None, "messages", context)
    top_logprobs = (top or 0) if _flag(body, "logprobs") else None
    params = _sampling(body, vocab_size, max_tokens=max_tokens, top_logprobs=top_logprobs)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return ChatRequest(prompt, params, _flag(body, "stream"), include_usage, parse, tool_names(rendered), prefill)


# ---- legacy completions -------------------------------------------------------------------------------------
def _prompt_ids(tokenizer: Tokenizer | None, prompt: Any) -> tuple[list[int], str | None]:
    """(token ids, the prompt's text when it was given as text)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise _bad("prompt", "the served model has no tokenizer: send the prompt as token ids")
        return tokenizer.encode_nogil(prompt), prompt  # special-token text stays special: the prompt is raw
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), None
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise _bad("prompt", "batched prompts are not supported: send one request per prompt")
    raise _bad("prompt", "prompt must be a non-empty string or a non-empty list of token ids")


@attrs.frozen
class CompletionRequest:
    """A validated legacy completions request."""

    prompt: list[int]  # token ids
    params: SamplingParams
    logprobs: int | None  # alternatives per token in the legacy logprobs shape; None: no logprobs
    echo: str  # the prompt's text when `echo`, put before each choice's text; "" otherwise
    stream: bool
    include_usage: bool


def parse_completion(body: dict, tokenizer: Tokenizer | None, *, vocab_size: int, context: int) -> CompletionRequest:
    """Validate a /v1/completions body.

    Args:
        body: the request's JSON object.
        tokenizer: the served model's tokenizer (None: only token-id prompts).
        vocab_size: token ids (prompt, logit_bias keys) must be below it.
        context: tokens one sequence may hold, prompt and completion together.

    Returns:
        The request, its prompt as token ids.

    Raises:
        APIError: 400 naming the offending field in `param`.
    """
    _common_checks(body)
    ids, text = _prompt_ids(tokenizer, body.get("prompt"))
    k = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    if _flag(body, "echo") and k is not None:
        raise _bad("echo", "echo with logprobs is not supported (prompt logprobs are not computed)")
    max_tokens = _max_tokens(body, ("max_tokens",), len(ids), 16, "prompt", context)
    params = _sampling(body, vocab_size, max_tokens=max_tokens, top_logprobs=k)
    echo = "" if not _flag(body, "echo") else text if text is not None else tokenizer.decode(ids)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return CompletionRequest(ids, params, k, echo, _flag(body, "stream"), include_usage)

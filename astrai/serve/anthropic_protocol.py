"""Anthropic Messages API request bodies -> a validated `MessagesRequest`, its prompt and its SamplingParams.

Request (JSON; validated like the real API, every error a 400 in Anthropic's shape naming the field path):
- `model` (any string; the reply names the served model), `max_tokens` (int >= 1, required), `messages`
  (required, non-empty, the first one from `user`): `role` user | assistant, `content` a string or blocks:
  `text` {text}; `tool_use` {id, name, input: object} (assistant only); `tool_result` {tool_use_id, content:
  string or text blocks, is_error} (user only, answering every `tool_use` of the assistant message just
  before it); `thinking` {thinking, signature} (assistant only: reaches the template as the message's
  `reasoning_content`) and `redacted_thinking` {data} (assistant only, dropped). Other block types (image,
  document, ...) are rejected naming the type.
  A final `assistant` message of text is a pre-fill: generation continues from it (not repeated in the reply).
- `system` (string or text blocks), `tools` ([{name: ^[a-zA-Z0-9_-]{1,64}$, description, input_schema: an
  object schema}]; server tools are rejected), `tool_choice` ({"type": "auto" | "any" | "none" | "tool" +
  "name"}, `disable_parallel_tool_use` keeps only the first call), `stop_sequences`, `temperature` [0, 1]
  (default 1; 0 = greedy), `top_p` (0, 1], `top_k` (>= 0; 0 = off), `stream`, `thinking` ({"type": "enabled",
  "budget_tokens": 1024 <= n < max_tokens} or {"type": "disabled"}: the chat template's `enable_thinking`; the
  budget is not enforced; enabled needs a server with a reasoning parser, `anthropic_api`). Deliberate no-ops:
  `metadata`, `service_tier`, `cache_control` (accepted, ignored). Any other field is a 400 naming it (and
  listing the accepted ones). The `anthropic-version` header is accepted and ignored; `x-api-key` is checked by
  the app's Guard (401).
- Server sampling defaults (`ServerState.sampling_defaults`, e.g. generation_config.json) fill `temperature`,
  `top_p` and `top_k` when the request leaves them unset, and always set `min_p` and `repetition_penalty` (no
  Anthropic field); `max_tokens` is required here, so its default never applies.

Prompt: the chat template renders the system message first, then the turns: text blocks joined by "\\n",
assistant `tool_use` blocks as OpenAI-style `tool_calls` (arguments as a dict), `tool_result` blocks as `tool`
messages (content prefixed with "Error: " when `is_error`). Tools are rendered unless tool_choice is none;
"any" and "tool" constrain the output with a grammar (`sampling_params`): only calls, in the server's tool-call
format, to one of the tools (or the named one) whose input matches its `input_schema`, so the forced call always
parses; "auto" allows text, or text then such calls. Special-token text anywhere in the
client's strings (`<|im_end|>` in a message) is encoded as plain text, so only the chat template makes control
tokens (`astrai serve --allow-special-tokens-in-content` turns that off).

The routes, streaming and the reply's content blocks are `anthropic_api`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from astrai.inference.params import SamplingParams
from astrai.serve.common import APIError
from astrai.serve.disconnect import checkpoint
from astrai.serve.input_bounds import could_exceed, string_chars, tokens_over, user_texts
from astrai.serve.tool_grammars import tool_call_grammar
from astrai.serve.tools_common import TOOL_NAME, function_tool, template_call, tool_names

if TYPE_CHECKING:
    from astrai.io.tokenizer import Tokenizer

_FIELDS = frozenset({"model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
                     "temperature", "top_p", "top_k", "stream", "metadata", "service_tier", "cache_control",
                     "thinking", "seed"})  # fmt: skip
_KINDS = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


@attrs.frozen(kw_only=True)
class MessagesRequest:
    """A validated request, already in the chat template's terms.

    Attributes:
        max_tokens: tokens to generate at most.
        messages: chat-template messages, the system message first.
        tools: OpenAI-style tool dicts to render (empty: none, also when tool_choice is none).
        forced: the call tool_choice forces: None (not forced), "" (any: one of the tools) or the tool's name.
        prefill: text of a final assistant message, continued by the model and not repeated in the reply.
        single_call: keep only the first tool call (disable_parallel_tool_use).
        stop: stop sequences.
        temperature, top_p, top_k: sampling settings (top_k 0 = off); None: unset (the server's default, else
            1, 1, 0).
        seed: per-request sampling seed (an astrai extension, as on the OpenAI routes; pass it in `extra_body`);
            None: the engine's own generator.
        stream: answer with server-sent events.
        thinking: `thinking` {"type": "enabled"} (True) or "disabled" (False), passed to the chat template as
            `enable_thinking`; None: absent (the template's default).
    """

    max_tokens: int
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    forced: str | None = None
    prefill: str = ""
    single_call: bool = False
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool = False
    thinking: bool | None = None

    @property
    def tool_names(self) -> tuple[str, ...]:
        """Names of the rendered tools (the only ones the parser accepts)."""
        return tool_names(self.tools)


# ---- validation -----------------------------------------------------------------------------------------------
def _bad(path: str, message: str) -> APIError:
    return APIError(400, f"{path}: {message}", param=path)


def _check(value: Any, kind: str, path: str) -> Any:
    ok = isinstance(value, _KINDS[kind]) and (kind == "boolean" or not isinstance(value, bool))
    if not ok:
        raise _bad(path, f"Input should be a valid {kind}, got {type(value).__name__}")
    return value


def _req(obj: dict, key: str, kind: str, where: str = "") -> Any:
    path = f"{where}.{key}" if where else key
    if key not in obj:
        raise _bad(path, "Field required")
    return _check(obj[key], kind, path)


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _opt(obj: dict, key: str, kind: str, default: Any = None, where: str = "") -> Any:
    return default if obj.get(key) is None else _req(obj, key, kind, where)


def _text_of(content: Any, path: str) -> str:
    """A string, or a list of text blocks joined by newlines (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    return "\n".join(b["text"] for b in _blocks(content, path, allowed=("text",)))


def _blocks(content: Any, path: str, allowed: Sequence[str]) -> list[dict[str, Any]]:
    """Validated content blocks of one message (a bare string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(path, f"Input should be a string or a list of content blocks, got {type(content).__name__}")
    out = []
    for i, block in enumerate(content):
        where = f"{path}.{i}"
        kind = _check(block, "object", where).get("type")
        if kind not in _BLOCK_TYPES:
            raise _bad(f"{where}.type", f"content block type {kind!r} is not supported by this server "
                                        f"(supported: {', '.join(_BLOCK_TYPES)})")  # fmt: skip
        if kind not in allowed:
            raise _bad(f"{where}.type", f"{kind} blocks are not allowed here (allowed: {', '.join(allowed)})")
        if kind == "text":
            out.append({"type": "text", "text": _req(block, "text", "string", where)})
        elif kind == "thinking":  # an earlier turn's reasoning, sent back as the SDKs do with tool use
            out.append({"type": "thinking", "thinking": _req(block, "thinking", "string", where)})
            _opt(block, "signature", "string", None, where)
        elif kind == "redacted_thinking":  # opaque by definition: nothing of it reaches the prompt
            _req(block, "data", "string", where)
            out.append({"type": "redacted_thinking"})
        elif kind == "tool_use":
            out.append({"type": "tool_use", "id": _req(block, "id", "string", where), "name": _req(block, "name",
                        "string", where), "input": _req(block, "input", "object", where)})  # fmt: skip
        else:
            text = _text_of(block.get("content") or "", f"{where}.content")
            error = _opt(block, "is_error", "boolean", False, where)
            out.append({"type": "tool_result", "tool_use_id": _req(block, "tool_use_id", "string", where),
                        "text": ("Error: " if error else "") + text})  # fmt: skip
    return out


def _turn(role: str, blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Template messages of one Anthropic message: tool results become `tool` messages, in block order."""
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(b["text"] for b in blocks
                                                                       if b["type"] == "text")}  # fmt: skip
        calls = [template_call(b["id"], b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
        reasoning = "\n".join(b["thinking"] for b in blocks if b["type"] == "thinking")
        if reasoning:  # templates that show earlier reasoning (Qwen3's) read it as reasoning_content
            msg["reasoning_content"] = reasoning
        return [{**msg, "tool_calls": calls} if calls else msg]
    out, text = [], []
    for b in blocks + [{"type": "end"}]:
        if b["type"] == "text":
            text.append(b["text"])
            continue
        if text:
            out.append({"role": "user", "content": "\n".join(text)})
            text = []
        if b["type"] == "tool_result":
            out.append({"role": "tool", "content": b["text"], "tool_call_id": b["tool_use_id"]})
    return out


def _conversation(raw: list) -> tuple[list[dict[str, Any]], str]:
    """Template messages of `messages` and the pre-fill of a final assistant text message."""
    if not raw:
        raise _bad("messages", "at least one message is required")
    chat: list[dict[str, Any]] = []
    pending: set[str] = set()  # tool_use ids of the previous assistant message, to be answered next
    for i, msg in enumerate(raw):
        where = f"messages.{i}"
        role = _check(msg, "object", where).get("role")
        if role not in ("user", "assistant"):
            hint = "; put the system prompt in the top-level `system` field" if role == "system" else ""
            raise _bad(f"{where}.role", f"Input should be 'user' or 'assistant', got {role!r}{hint}")
        if i == 0 and role != "user":
            raise _bad(f"{where}.role", "the first message must use the user role")
        allowed = ("text", "tool_result") if role == "user" else ("text", "tool_use", "thinking", "redacted_thinking")
        if "content" not in msg:
            raise _bad(f"{where}.content", "Field required")
        blocks = _blocks(msg["content"], f"{where}.content", allowed)
        if not blocks:
            raise _bad(f"{where}.content", "all messages must have non-empty content")
        answered = {b["tool_use_id"] for b in blocks if b["type"] == "tool_result"}
        if answered - pending:
            raise _bad(where, f"tool_result blocks answer unknown tool_use ids {sorted(answered - pending)}: each "
                              "must answer a tool_use of the assistant message just before")  # fmt: skip
        if pending - answered:
            raise _bad(where, f"tool_use ids {sorted(pending - answered)} were found without tool_result blocks "
                              "immediately after")  # fmt: skip
        pending = {b["id"] for b in blocks if b["type"] == "tool_use"}
        chat += _turn(role, blocks)
    if pending:
        raise _bad(f"messages.{len(raw) - 1}", "the final assistant message has tool_use blocks: send their "
                                               "tool_result blocks in a user message")  # fmt: skip
    if raw[-1]["role"] != "assistant":
        return chat, ""
    prefill = chat.pop()["content"]
    if prefill != prefill.rstrip():
        raise _bad(f"messages.{len(raw) - 1}.content", "final assistant content cannot end with trailing whitespace")
    return chat, prefill


def _tools(raw: list, choice: Any) -> tuple[tuple[dict[str, Any], ...], str | None, bool]:
    """(OpenAI-style tools to render, the forced call (None, "" any, a name), single_call) from `tools` and
    `tool_choice`."""
    out, names = [], set()
    for i, tool in enumerate(raw):
        where = f"tools.{i}"
        if _check(tool, "object", where).get("type") not in (None, "custom"):
            raise _bad(f"{where}.type", f"tool type {tool['type']!r} is not supported; send custom tools "
                                        "(name, description, input_schema)")  # fmt: skip
        name = _req(tool, "name", "string", where)
        if not TOOL_NAME.fullmatch(name):
            raise _bad(f"{where}.name", f"String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$', got {name!r}")
        if name in names:
            raise _bad(f"{where}.name", f"tool names must be unique; {name!r} is repeated")
        schema = _req(tool, "input_schema", "object", where)
        if schema.get("type") != "object":
            raise _bad(f"{where}.input_schema.type", f"Input should be 'object', got {schema.get('type')!r}")
        description = None if tool.get("description") is None else _req(tool, "description", "string", where)
        names.add(name)
        out.append(function_tool(name, description, schema))
    kind, forced, single = "auto", None, False
    if choice is not None:
        kind = _check(choice, "object", "tool_choice").get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise _bad("tool_choice.type", f"Input should be 'auto', 'any', 'tool' or 'none', got {kind!r}")
        single = _opt(choice, "disable_parallel_tool_use", "boolean", False, "tool_choice")
        if kind in ("any", "tool") and not out:
            raise _bad("tool_choice", f"tool_choice {kind!r} may only be specified while providing tools")
        if kind == "tool":
            name = _req(choice, "name", "string", "tool_choice")
            if name not in names:
                raise _bad("tool_choice.name", f"tool {name!r} is not one of the tools {sorted(names)}")
            forced = name
        forced = "" if kind == "any" else forced
    return (() if kind == "none" else tuple(out)), forced, single


def parse_request(body: dict[str, Any], *, count_only: bool = False) -> MessagesRequest:
    """Validate a /v1/messages body (count_tokens: `count_only`, max_tokens not needed).

    Raises:
        APIError: 400 naming the offending field path.
    """
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise _bad(unknown[0], f"Extra inputs are not permitted (this server accepts {', '.join(sorted(_FIELDS))}; "
                               "docs/serving.md says what each does)")  # fmt: skip
    _req(body, "model", "string")  # the route checked it names a served model (`ServerState.check_model`)
    max_tokens = 1 if count_only else _req(body, "max_tokens", "integer")
    if max_tokens < 1:
        raise _bad("max_tokens", f"Input should be greater than or equal to 1, got {max_tokens}")
    chat, prefill = _conversation(_req(body, "messages", "array"))
    if body.get("system") is not None:
        system = _text_of(body["system"], "system")
        chat = [{"role": "system", "content": system}, *chat] if system else chat
    tools, forced, single = _tools(_opt(body, "tools", "array", []), body.get("tool_choice"))
    stop = _opt(body, "stop_sequences", "array", [])
    for i, s in enumerate(stop):
        if not _check(s, "string", f"stop_sequences.{i}"):
            raise _bad(f"stop_sequences.{i}", "stop sequences must be non-empty")
    temperature = _opt(body, "temperature", "number")
    if temperature is not None and not 0.0 <= temperature <= 1.0:
        raise _bad("temperature", f"Input should be between 0 and 1, got {temperature}")
    top_k = _opt(body, "top_k", "integer")
    if top_k is not None and top_k < 0:
        raise _bad("top_k", f"Input should be greater than or equal to 0, got {top_k}")
    seed = _opt(body, "seed", "integer")
    if seed is not None and not -(1 << 63) <= seed < (1 << 63):
        raise _bad("seed", f"Input should be a 64-bit integer, got {seed}")
    _opt(body, "metadata", "object")
    thinking = _thinking(body.get("thinking"), max_tokens, count_only)
    return MessagesRequest(max_tokens=max_tokens, messages=tuple(chat), tools=tools, forced=forced, prefill=prefill,
                           single_call=single, stop=tuple(stop), temperature=temperature,
                           top_p=_opt(body, "top_p", "number"), top_k=top_k, seed=seed,
                           stream=_opt(body, "stream", "boolean", False), thinking=thinking)  # fmt: skip


def _thinking(value: Any, max_tokens: int, count_only: bool) -> bool | None:
    """`thinking` -> the template's `enable_thinking`: True (enabled), False (disabled), None (absent)."""
    if value is None:
        return None
    kind = _check(value, "object", "thinking").get("type")
    if kind == "disabled":
        return False
    if kind != "enabled":
        raise _bad("thinking.type", f"Input should be 'enabled' or 'disabled', got {kind!r}")
    budget = _req(value, "budget_tokens", "integer", "thinking")
    if budget < 1024:
        raise _bad("thinking.budget_tokens", f"Input should be greater than or equal to 1024, got {budget}")
    if not count_only and budget >= max_tokens:
        raise _bad("thinking.budget_tokens", f"budget_tokens ({budget}) must be less than max_tokens ({max_tokens})")
    return True


def render_prompt(tokenizer: Tokenizer | None, req: MessagesRequest, *, allow_special_tokens: bool = False,
                  context: int | None = None, generate: bool = True) -> list[int]:  # fmt: skip
    """Prompt token ids: the rendered conversation, then the assistant pre-fill.

    Special-token text in the client's strings (pre-fill included) is encoded as plain text unless
    `allow_special_tokens` (see `Tokenizer.encode_chat`). Seconds for a huge body: handlers run it off the loop.
    With a `context`, a conversation the character bound (`input_bounds`) shows cannot fit is refused, in
    Anthropic's "prompt is too long" wording, before it is tokenized (its user turns and pre-fill before
    rendering; the rendered text when the body's strings as a whole could be too long).
    """
    if tokenizer is None:
        raise APIError(400, "the served model has no tokenizer, so it cannot take chat messages")
    try:
        extra = {} if req.thinking is None else {"enable_thinking": req.thinking}
        if context is not None:
            _check_chars(tokenizer, req, extra, context, generate)
        return tokenizer.encode_chat(list(req.messages), tools=list(req.tools) or None, prefill=req.prefill,
                                     special_tokens_in_content=allow_special_tokens, **extra)  # fmt: skip
    except ValueError as err:
        raise APIError(400, f"the chat template rejected the conversation: {err}") from None


def _check_chars(tokenizer: Tokenizer, req: MessagesRequest, extra: dict, context: int, generate: bool) -> None:
    messages, tools = list(req.messages), list(req.tools) or None
    texts = [*user_texts(messages), req.prefill]
    least = tokens_over(texts, tokenizer, context, generate=generate)
    if least is None and could_exceed(tokenizer, string_chars(messages) + string_chars(tools) + len(req.prefill),
                                      context, generate=generate):  # fmt: skip
        least = tokens_over([tokenizer.apply_chat_template(messages, tools=tools, **extra), req.prefill],
                            tokenizer, context, generate=generate)  # fmt: skip
        checkpoint()  # rendered; the client may have left meanwhile
    if least is not None:
        raise APIError(400, f"prompt is too long: at least {least} tokens > {context - generate} maximum (counted "
                            "from its characters without tokenizing)", param="messages")  # fmt: skip


def sampling_params(req: MessagesRequest, defaults: Mapping[str, Any] | None = None, tokenizer: Tokenizer | None = None,
                    tool_parser: str = "hermes") -> SamplingParams:  # fmt: skip
    """Engine settings, unset ones from the server's sampling `defaults` (`max_tokens` is the request's own).

    Stop strings are kept in the output so the reply can tell which one matched. A forced call (tool_choice
    any / tool) is a grammar (`tool_grammars.forced_call_grammar`: calls in the server's `tool_parser` format whose
    input matches the tool's schema; one call with `disable_parallel_tool_use`); `tokenizer` tells whether the
    markup is special tokens (and holds the chat template, which picks a format's variant). With tools and
    tool_choice auto, the output is text or text then well-formed calls (`tool_grammars.auto_call_grammar`).
    """
    try:
        grammar, keep_special = tool_call_grammar(req.tools, req.forced, parallel=not req.single_call,
                                                  tokenizer=tokenizer, tool_parser=tool_parser)  # fmt: skip
    except ValueError as err:  # a tool the format's markup cannot write
        raise _bad("tools", str(err)) from None
    d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, **(defaults or {})}
    return SamplingParams(max_tokens=req.max_tokens, stop=req.stop, include_stop_str_in_output=bool(req.stop),
                          temperature=d["temperature"] if req.temperature is None else float(req.temperature),
                          top_p=d["top_p"] if req.top_p is None else float(req.top_p),
                          top_k=d["top_k"] if req.top_k is None else req.top_k,
                          min_p=d["min_p"], repetition_penalty=d["repetition_penalty"], grammar=grammar,
                          seed=req.seed, skip_special_tokens=not keep_special)  # fmt: skip

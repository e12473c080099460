"""OpenAI request bodies -> validated, typed requests for `/v1/chat/completions` and `/v1/completions`.

Every top-level field is honoured, a documented no-op, or a 400 naming it in `param` (an unknown field's message
lists the route's fields); shared field checks and the mapping onto SamplingParams are `sampling_fields`'.

Chat completions accept:
- `messages` with roles system / developer (= system) / user / assistant / tool; `content` a string, null (an
  assistant turn with `tool_calls`) or a list of `{"type": "text"}` parts (joined with newlines; any other part
  type is a 400 naming it). Assistant `tool_calls` carry JSON-string `arguments` (parsed to objects for the
  chat template; invalid JSON is a 400); `tool` messages carry `tool_call_id`; an assistant's
  `reasoning_content` (or `reasoning`), a string, reaches the template as `reasoning_content` (Qwen3's renders it).
  Everything reaches the prompt through the model's chat template, so tool results are seen on the next turn.
- `tools` (type "function": name matching ^[a-zA-Z0-9_-]{1,64}$, unique; optional description and an object
  JSON-schema `parameters`) and `tool_choice`: "none" (tools not rendered, output not parsed), "auto" (default with
  tools: a grammar allows text, or text then well-formed calls, `tool_grammars.auto_call_grammar`), "required" or
  `{"type": "function", "function": {"name": ...}}`: a grammar (`tool_grammars.forced_call_grammar`,
  `SamplingParams.grammar` with param "tool_choice") lets the model write only calls to one of the tools (or the
  named one) whose arguments match its parameters, then end; both in the server's tool-call format (hermes,
  mistral, llama3_json, qwen3_coder, deepseek_v3); `parallel_tool_calls: false` allows exactly one call, true /
  absent one or more. The output is parsed by the server's tool-call parser (`astrai.serve.tool_parsers`); parsed
  calls come back as `tool_calls` with `arguments` a JSON string of an object, and finish_reason "tool_calls".
- sampling: `n` (<= 16), `temperature` [0, 2], `top_p`, `presence_penalty`, `frequency_penalty`, `logit_bias`,
  `seed`, `stop` (a string or <= 16 strings), `max_tokens` / `max_completion_tokens` (default: the server's
  sampling default, else the rest of the context), `logprobs` + `top_logprobs` (0..20), `stream` +
  `stream_options.include_usage`, `response_format` {"type": "text"}; vLLM's extensions: `top_k` (0 or -1 =
  off), `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `min_tokens`, `skip_special_tokens`,
  `include_stop_str_in_output`. Unset `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and
  `max_tokens` take the server's sampling defaults (generation_config.json).
- vLLM's chat extras: `chat_template_kwargs` (an object of extra template variables, e.g. `{"enable_thinking":
  false}`; names of encode_chat / template arguments such as `messages` or `add_generation_prompt` are a 400, and
  so is special-token text in its strings unless special tokens are allowed in content), `documents` (a list of
  objects, the template's `documents`), `continue_final_message` (the final assistant message is continued, not
  closed: its text is the assistant pre-fill; `add_generation_prompt` must then be false or absent),
  `add_generation_prompt` (true only, or false with `continue_final_message`), `echo` (the final message's text,
  when it is an assistant's, starts the reply), `add_special_tokens` (false only: the template places them).
- no-ops: `model` may be any string (the served name is echoed); `user`, `store`, `metadata`, `service_tier`,
  `safety_identifier`,
  `prompt_cache_key` are accepted and ignored.
- client extras: `reasoning_effort` and `verbosity` reach the chat template as variables (`chat_prompt`), as vLLM
  passes them; `request_id` (both routes) names the reply (`chatcmpl-<request_id>`); `priority` (both routes: the
  engine's scheduling policy must be "priority" for a non-zero value); `return_tokens_as_token_ids` (both routes:
  logprob tokens are `token_id:N`).
- structured output (both routes): `response_format` (text, json_object, json_schema; or TGI's `{"type", "value"}`)
  or vLLM's `structured_outputs` or one of its older `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar` (`sampling_fields.grammar_spec`; the engine
  compiles it, a grammar that does not compile is a 400 naming the field). Combined with a forced tool call
  (tool_choice "required" or named, itself a grammar) it is a 400: two constraints on one output.
- rejected with a 400: `functions` / `function_call` (the deprecated API: use tools), `audio` / non-text
  `modalities`, `chat_template` (per-request templates: start the server with --chat-template), and vLLM fields
  without an implementation (`sampling_fields.UNSUPPORTED`: structural tags, beam search, bad words, ...).

Special-token text in chat messages (a user writing `<|im_end|>`) is encoded as plain text, so only the chat
template makes control tokens (`astrai serve --allow-special-tokens-in-content` turns that off). A completions
`prompt` is raw: it is the client's own template, so special-token text in it is encoded as special tokens.

Completions accept `prompt` as a string, a list of token ids, or a list of several of either (each prompt is its
own engine request: choices are indexed `prompt_index * n + j`; a list of prompts times `n` may not exceed the
engine's waiting queue; a bad prompt is a 400 naming `prompt` and its index before anything is submitted),
`echo` (with `logprobs`: the prompt's tokens are scored too, `token_logprobs` starting with null, as lm-eval's
`local-completions` loglikelihood requests need; `max_tokens: 0` with `echo` only scores, nothing is generated),
`logprobs` as an int 0..20 (legacy shape with `text_offset`), `max_tokens` (default: the server's sampling
default, else 16, as OpenAI), `add_special_tokens`
(default true: a text prompt gets the tokenizer's BOS etc.), the same sampling fields and streaming; `user` is a
no-op. `suffix` and `best_of` != n are 400s.

What happens after validation (streaming, logprobs, usage, errors mid-request) is documented in `openai_api`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from astrai.inference.params import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from astrai.serve.chat_prompt import encode_messages
from astrai.serve.disconnect import checkpoint
from astrai.serve.input_bounds import check_text_fits
from astrai.serve.router_fields import router_fields
from astrai.serve.sampling_fields import (
    SAMPLING_FIELDS,
    UNSUPPORTED,
    bad,
    check_fields,
    common_checks,
    context_exceeded,
    flag,
    include_usage,
    integer,
    is_token_id,
    max_tokens,
    prompt_logprobs_top,
    sampling_params,
    show,
)
from astrai.serve.tool_grammars import tool_call_grammar
from astrai.serve.tool_parsers import tool_schemas
from astrai.serve.tools_common import TOOL_NAME, function_tool, template_call, tool_names

if TYPE_CHECKING:
    from astrai.io.tokenizer import Tokenizer

_ROLES = ("system", "developer", "user", "assistant", "tool")
NO_OPS = frozenset({"user", "store", "metadata", "service_tier", "parallel_tool_calls", "safety_identifier",
                    "prompt_cache_key"})  # fmt: skip
"""Chat fields accepted on purpose without effect (`user` is the only one on completions)."""
CHAT_FIELDS = SAMPLING_FIELDS | NO_OPS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "modalities",
    "chat_template_kwargs", "documents", "continue_final_message", "add_generation_prompt", "echo",
    "add_special_tokens", "reasoning_effort", "verbosity", "request_id"}  # fmt: skip
COMPLETION_FIELDS = SAMPLING_FIELDS | {"user", "prompt", "logprobs", "echo", "add_special_tokens", "request_id"}
_CHAT_UNSUPPORTED = {**UNSUPPORTED, "functions": "use tools", "function_call": "use tool_choice",
                     "audio": "audio output", "prediction": "predicted outputs",
                     "chat_template": "per-request templates; start the server with --chat-template"}  # fmt: skip
_COMPLETION_UNSUPPORTED = {**UNSUPPORTED, "suffix": "insertion"}


# ---- chat requests ------------------------------------------------------------------------------------------
def _content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(where, f"{where} must be a string, null or a list of text parts")
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise bad(f"{where}[{j}].type", f"content part type {kind!r} is not supported (text only)")
        if not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}].text", "a text part needs a string 'text'")
    return "\n".join(part["text"] for part in value)


def _assistant_calls(calls: Any, where: str, names: dict[str, str]) -> list[dict]:
    """OpenAI tool_calls with their JSON-string arguments parsed (templates render objects); records id -> name."""
    if not isinstance(calls, list):
        raise bad(where, f"{where} must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}[{j}].function", "a tool call needs a function with a name")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError) as err:
            raise bad(f"{where}[{j}].function.arguments", f"arguments must be a JSON string: {err}") from None
        if not isinstance(args, dict):
            raise bad(f"{where}[{j}].function.arguments", "arguments must encode a JSON object")
        call_id = call["id"] if isinstance(call.get("id"), str) else f"call_{j}"
        names[call_id] = fn["name"]
        out.append(template_call(call_id, fn["name"], args))
    return out


def _messages(body: dict) -> list[dict]:
    """The conversation as chat-template messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    out: list[dict] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for templates that show it on results
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _ROLES:
            raise bad(f"{where}.role", f"unknown role {role!r}; expected one of {', '.join(_ROLES)}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        msg["content"] = _content(m.get("content"), f"{where}.content")
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _assistant_calls(m["tool_calls"], f"{where}.tool_calls", call_names)
        reasoning = m.get("reasoning_content", m.get("reasoning")) if role == "assistant" else None
        if reasoning is not None:  # a thinking model's earlier reasoning: templates such as Qwen3's render it
            if not isinstance(reasoning, str):
                raise bad(f"{where}.reasoning_content", "reasoning_content must be a string")
            msg["reasoning_content"] = reasoning
        elif msg["content"] is None and role != "assistant":
            raise bad(f"{where}.content", f"a {role} message needs content")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad(f"{where}.tool_call_id", "a tool message needs a string tool_call_id")
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
        raise bad(where, "a tool must be {'type': 'function', 'function': {...}}")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name) or name in seen:
        raise bad(f"{where}.function.name", f"tool names must be unique and match ^[a-zA-Z0-9_-]{{1,64}}$, got "
                                             f"{show(name)}")  # fmt: skip
    seen.add(name)
    description, parameters = fn.get("description"), fn.get("parameters")
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}.function.description", "description must be a string")
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
        raise bad(f"{where}.function.parameters", "parameters must be a JSON schema of type 'object'")
    return function_tool(name, description, parameters)


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad("tools", "tools must be a list")
    seen: set[str] = set()
    return [_tool(tool, f"tools[{i}]", seen) for i, tool in enumerate(tools)]


def _tool_choice(body: dict, tools: list[dict]) -> tuple[bool, str | None]:
    """(whether tools are rendered and parsed, the forced call: None (not forced), "" (any tool) or a name)."""
    choice = body.get("tool_choice")
    if choice in (None, "auto", "none"):
        return bool(tools) and choice != "none", None
    if choice == "required":
        if not tools:
            raise bad("tool_choice", "tool_choice 'required' needs tools")
        return True, ""
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}")  # fmt: skip
    if fn["name"] not in tool_names(tools):
        raise bad("tool_choice", f"tool_choice names the function {fn['name']!r}, which is not in tools")
    return True, fn["name"]


def chat_messages(body: dict) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of a chat body, validated and mapped to chat-template input (400 naming the field)."""
    return _messages(body), _tools(body)


@attrs.frozen
class ChatRequest:
    """A validated chat completions request."""

    prompt: list[int]  # chat template + pre-fill, as token ids
    params: SamplingParams
    stream: bool
    include_usage: bool
    parse: bool  # whether tool calls are parsed from the output (tools given, tool_choice not "none")
    tool_names: tuple[str, ...]
    forced: bool  # tool_choice "required" / named: the grammar forces calls (the output holds nothing else)
    echo: str = ""  # text put before each choice's content (`echo` with a final assistant message)
    tool_schemas: dict[str, Any] = attrs.Factory(dict)  # name -> parameters of the rendered tools
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens are "token_id:N"
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: score the prompt with this many alternatives


def parse_chat(body: dict, tokenizer: Tokenizer | None, *, vocab_size: int, context: int,
               allow_special_tokens: bool = False, defaults: Mapping[str, Any] | None = None,
               tool_parser: str = "hermes") -> ChatRequest:  # fmt: skip
    """Validate a /v1/chat/completions body and render its prompt through the chat template.

    Renders and tokenizes (seconds for a multi-megabyte body): handlers run it on the server's worker pool.

    Args:
        body: the request's JSON object.
        tokenizer: the served model's tokenizer (None: chat is refused).
        vocab_size: token ids (logit_bias keys, stop_token_ids) must be below it.
        context: tokens one sequence may hold, prompt and completion together.
        tool_parser: the server's tool-call format, in which tool calls are grammar-constrained
            (`tool_grammars.tool_call_grammar`).
        allow_special_tokens: special-token text in the messages becomes control tokens (by default it is
            encoded as plain text, see `Tokenizer.encode_chat`).
        defaults: the server's sampling defaults for unset fields (`sampling_fields`).

    Returns:
        The request with its prompt as token ids (template + pre-fills).

    Raises:
        APIError: 400 naming the offending field in `param`.
    """
    router_fields(body)  # the fields a router in front adds (router_api)
    check_fields(body, CHAT_FIELDS, _CHAT_UNSUPPORTED)
    common_checks(body)
    if body.get("modalities") not in (None, ["text"]):
        raise bad("modalities", "only the text modality is supported")
    if flag(body, "add_special_tokens"):
        raise bad("add_special_tokens", "add_special_tokens true is not supported: the chat template places the "
                                        "special tokens")  # fmt: skip
    messages, tools = _messages(body), _tools(body)
    parse, forced = _tool_choice(body, tools)
    rendered = tools if parse else []
    last = messages[-1]
    echo = (last["content"] or "") if flag(body, "echo") and last["role"] == "assistant" else ""
    prompt = encode_messages(body, tokenizer, messages, rendered, allow_special_tokens=allow_special_tokens,
                             context=context)  # fmt: skip
    top = integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top and not flag(body, "logprobs"):
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    defaults = defaults or {}
    keys = ("max_completion_tokens", "max_tokens")
    limit = max_tokens(body, keys, len(prompt), defaults.get("max_tokens"), "messages", context)
    top_logprobs = (top or 0) if flag(body, "logprobs") else None
    params = sampling_params(body, vocab_size, max_tokens=limit, top_logprobs=top_logprobs, defaults=defaults)
    if forced is not None:
        if params.grammar is not None:
            raise bad(params.grammar.param, f"{params.grammar.param} cannot be combined with a forced tool call "
                                            "(tool_choice 'required' or a named function): both constrain the "
                                            "output")  # fmt: skip
        params = _constrain_calls(params, rendered, forced, body, tokenizer, tool_parser)
    elif rendered and params.grammar is None:
        params = _constrain_calls(params, rendered, None, body, tokenizer, tool_parser)
    return ChatRequest(prompt, params, flag(body, "stream"), include_usage(body), parse, tool_names(rendered),
                       forced is not None, echo, tool_schemas(rendered),
                       tokens_as_ids=flag(body, "return_tokens_as_token_ids"),
                       prompt_logprobs=prompt_logprobs_top(body, MAX_TOP_LOGPROBS))  # fmt: skip


def _constrain_calls(params: SamplingParams, tools: list[dict], forced: str | None, body: dict, tokenizer: Tokenizer,
                     tool_parser: str) -> SamplingParams:  # fmt: skip
    """`params` with `tool_grammars.tool_call_grammar` (one call when `parallel_tool_calls` is false)."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    try:
        grammar, special = tool_call_grammar(tools, forced, parallel=parallel is not False, tokenizer=tokenizer,
                                             tool_parser=tool_parser)  # fmt: skip
    except ValueError as err:  # a tool the format's markup cannot write
        raise bad("tools", str(err)) from None
    if grammar is None:
        return params
    # a special-token tag must reach the parser as text (the grammar allows no other special token but EOS)
    return attrs.evolve(params, grammar=grammar, skip_special_tokens=params.skip_special_tokens and not special)


# ---- legacy completions -------------------------------------------------------------------------------------
def _prompt_list(prompt: Any) -> tuple[list[str | list[int]], bool]:
    """(the prompts, whether the client sent a list of several): a string, token ids, or a list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_token_id(t) for t in prompt)):
        return [prompt], False
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return prompt, len(prompt) > 1
    raise bad("prompt", "prompt must be a non-empty string, a non-empty list of token ids, or a list of several "
                        "of either")  # fmt: skip


def _prompt_ids(tokenizer: Tokenizer | None, prompt: str | list, where: str, vocab_size: int,
                add_special_tokens: bool) -> tuple[list[int], str | None]:  # fmt: skip
    """(token ids, the prompt's text when it was given as text)."""
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise bad("prompt", f"{where}: the served model has no tokenizer: send the prompt as token ids")
        # special-token text stays special: the prompt is raw
        return tokenizer.encode_nogil(prompt, add_special_tokens=add_special_tokens), prompt
    if not isinstance(prompt, list) or not prompt or not all(is_token_id(t) for t in prompt):
        raise bad("prompt", f"{where} must be a non-empty string or a non-empty list of token ids")
    outside = [t for t in prompt if not 0 <= t < vocab_size]
    if outside:
        raise bad("prompt", f"{where}: prompt token ids outside [0, {vocab_size}): {outside[:5]}")
    return list(prompt), None


@attrs.frozen
class CompletionPrompt:
    """One prompt of a completions request: its own engine request."""

    ids: list[int]
    params: SamplingParams  # max_tokens capped to the room this prompt leaves in the context
    echo: str  # the prompt's text when `echo`, put before each of its choices' text; "" otherwise


@attrs.frozen
class CompletionRequest:
    """A validated legacy completions request (one or several prompts)."""

    prompts: tuple[CompletionPrompt, ...]
    n: int  # completions per prompt: choice index = prompt index * n + j
    logprobs: int | None  # alternatives per token in the legacy logprobs shape; None: no logprobs
    stream: bool
    include_usage: bool
    prompt_logprobs: bool = False  # echo with logprobs: score the prompt tokens too
    prompt_top: int | None = None  # vLLM's prompt_logprobs: score each prompt with this many alternatives
    generate: bool = True  # False: max_tokens 0 with echo, the prompts are only echoed (and scored)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens are "token_id:N"


def parse_completion(body: dict, tokenizer: Tokenizer | None, *, vocab_size: int, context: int,
                     defaults: Mapping[str, Any] | None = None, max_sequences: int | None = None
                     ) -> CompletionRequest:  # fmt: skip
    """Validate a /v1/completions body.

    Args:
        body: the request's JSON object.
        tokenizer: the served model's tokenizer (None: only token-id prompts).
        vocab_size: token ids (prompts, logit_bias keys, stop_token_ids) must be below it.
        context: tokens one sequence may hold, prompt and completion together.
        defaults: the server's sampling defaults for unset fields (`sampling_fields`).
        max_sequences: most sequences (prompts times n) a list of prompts may ask for (the engine's waiting
            queue); None: no limit.

    Returns:
        The request, each prompt as token ids with its own SamplingParams; every prompt is checked (length,
        token ids, room for max_tokens) before the handler submits any.

    Raises:
        APIError: 400 naming the offending field in `param` (a list's bad prompt: `prompt`, its index in the
            message).
    """
    router_fields(body)  # the fields a router in front adds (router_api)
    check_fields(body, COMPLETION_FIELDS, _COMPLETION_UNSUPPORTED)
    common_checks(body)
    prompts, several = _prompt_list(body.get("prompt"))
    n = integer(body, "n", 1, 1, MAX_N)
    if several and max_sequences is not None and len(prompts) * n > max_sequences:
        raise bad("prompt", f"{len(prompts)} prompts x n={n} is more than the {max_sequences} sequences the server "
                            "queues at once: send fewer prompts per request")  # fmt: skip
    k = integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    echo = flag(body, "echo")
    add_special = flag(body, "add_special_tokens", True)
    defaults = defaults or {}
    explicit = integer(body, "max_tokens", None, 0, None)
    generate = explicit != 0
    if not generate and not echo:
        raise bad("max_tokens", "max_tokens must be >= 1 (0 only with echo: the prompt is echoed and scored)")
    for i, prompt in enumerate(prompts):  # every text prompt on the character bound before tokenizing any
        if isinstance(prompt, str):
            check_text_fits(prompt, tokenizer, context, "prompt", what=f"prompt[{i}]" if several else "prompt",
                            generate=generate)  # fmt: skip
    parsed = []
    for i, prompt in enumerate(prompts):
        checkpoint()  # between the prompts of a list: stop once the client left
        where = f"prompt[{i}]" if several else "prompt"
        ids, text = _prompt_ids(tokenizer, prompt, where, vocab_size, add_special)
        if len(ids) > context or (generate and len(ids) == context):
            raise context_exceeded("prompt", context, len(ids), what=where)
        if explicit is not None and len(ids) + explicit > context:
            raise context_exceeded("max_tokens", context, len(ids), explicit, what=where)
        parsed.append((ids, text))
    default = defaults.get("max_tokens", 16)
    limits = [explicit or min(default, context - len(ids)) if generate else 1 for ids, _ in parsed]
    params = sampling_params(body, vocab_size, max_tokens=max(limits), top_logprobs=k, defaults=defaults)
    out = []
    for i, ((ids, text), limit) in enumerate(zip(parsed, limits, strict=True)):
        if generate and params.min_tokens > limit:
            where = f"prompt[{i}]" if several else "prompt"
            raise bad("min_tokens", f"min_tokens is {params.min_tokens}, but max_tokens for {where} is {limit}")
        own = params if limit == params.max_tokens else attrs.evolve(params, max_tokens=limit)
        shown = "" if not echo else text if text is not None else tokenizer.decode(ids) if tokenizer else ""
        out.append(CompletionPrompt(ids, own, shown))
    return CompletionRequest(tuple(out), n, k, flag(body, "stream"), include_usage(body),
                             prompt_logprobs=echo and k is not None, generate=generate,
                             tokens_as_ids=flag(body, "return_tokens_as_token_ids"),
                             prompt_top=prompt_logprobs_top(body, MAX_TOP_LOGPROBS))  # fmt: skip

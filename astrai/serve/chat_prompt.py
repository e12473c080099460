"""A chat body's prompt ids: the validated messages and tools through the chat template, with the body's template
variables (`chat_template_kwargs`, `documents`) and how the reply starts (`add_generation_prompt`,
`continue_final_message`).

Shared by `/v1/chat/completions` (`openai_protocol.parse_chat`) and vLLM's `/tokenize` (`vllm_api`), so a
conversation tokenized there counts exactly the tokens the chat route would submit. Template variables are
template input, not message content: special-token text in them is refused (unless the server lets content hold
special tokens), and they may not set the template call's own arguments (`RESERVED_TEMPLATE_KWARGS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from astrai.serve.disconnect import checkpoint
from astrai.serve.input_bounds import check_text_fits, could_exceed, string_chars, user_texts
from astrai.serve.sampling_fields import bad, flag, show

if TYPE_CHECKING:
    from astrai.io.tokenizer import Tokenizer

# names chat_template_kwargs may not set: encode_chat's / apply_chat_template's own arguments and the template's
# globals (their request fields, where there is one, set them)
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                      "chat_template", "prefill", "head", "tokenize", "special_tokens_in_content",
                                      "raise_exception", "strftime_now", "dict", "namespace"})  # fmt: skip


TEMPLATE_FIELDS = {"reasoning_effort": ("none", "minimal", "low", "medium", "high", "xhigh"),
                   "verbosity": ("low", "medium", "high")}  # fmt: skip
"""Top-level OpenAI fields that reach the chat template as variables of the same name, as vLLM passes them (a
template that reads `reasoning_effort`, such as gpt-oss's, honours it; others ignore it). litellm, langchain and the
agents SDK's `ModelSettings(reasoning=...)` send them."""


def _has_special_text(value: Any, texts: tuple[str, ...]) -> bool:
    if isinstance(value, str):
        return any(t in value for t in texts)
    if isinstance(value, dict):
        return any(_has_special_text(k, texts) or _has_special_text(v, texts) for k, v in value.items())
    return isinstance(value, list) and any(_has_special_text(v, texts) for v in value)


def _template_kwargs(body: dict, special_texts: tuple[str, ...]) -> dict[str, Any]:
    """Extra chat-template variables: `chat_template_kwargs`, `documents` and `TEMPLATE_FIELDS`.

    Their strings are template input, not message content, so special-token text in them would become control
    tokens: it is refused unless `special_texts` is empty (special tokens allowed in content).
    """
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", f"chat_template_kwargs must be an object, got {show(kwargs)}")
    clash = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if clash:
        raise bad(
            "chat_template_kwargs",
            f"chat_template_kwargs may not set {clash[0]!r} (an argument of the "
            "template call; use the request field of that name where there is one)",
        )
    documents = body.get("documents")
    if documents is not None:
        if "documents" in kwargs:
            raise bad("documents", "give documents either as the documents field or in chat_template_kwargs")
        kwargs = {**kwargs, "documents": documents}
    docs = kwargs.get("documents")
    if docs is not None and (not isinstance(docs, list) or not all(isinstance(d, dict) for d in docs)):
        raise bad("documents", f"documents must be a list of objects, got {show(docs)}")
    for key, allowed in TEMPLATE_FIELDS.items():
        value = body.get(key)
        if value is None:
            continue
        if value not in allowed:
            raise bad(key, f"{key} must be one of {', '.join(allowed)}, got {show(value)}")
        if key in kwargs:
            raise bad(key, f"give {key} either as the {key} field or in chat_template_kwargs")
        kwargs = {**kwargs, key: value}
    for key, value in kwargs.items():
        if _has_special_text(value, special_texts):
            where = "documents" if key == "documents" and documents is not None else f"chat_template_kwargs.{key}"
            raise bad(where, f"{where} holds special-token text, which the server does not accept there")
    return kwargs


def _continue_final(body: dict, messages: list[dict]) -> tuple[list[dict], str]:
    """(the messages to render, the assistant text to continue) under `continue_final_message`."""
    generation_prompt = flag(body, "add_generation_prompt", True)
    if not flag(body, "continue_final_message"):
        if not generation_prompt:
            raise bad(
                "add_generation_prompt",
                "add_generation_prompt false is only supported with "
                "continue_final_message true (the reply is an assistant turn)",
            )
        return messages, ""
    if body.get("add_generation_prompt") is True:
        raise bad("continue_final_message", "continue_final_message cannot be used with add_generation_prompt true")
    last = messages[-1]
    if last["role"] != "assistant" or last.get("tool_calls") or not isinstance(last["content"], str):
        raise bad("continue_final_message", "continue_final_message needs a final assistant message with text "
                                            "content (and no tool_calls)")  # fmt: skip
    return messages[:-1], last["content"]


def encode_messages(body: dict, tokenizer: Tokenizer | None, messages: list[dict], tools: list[dict], *,
                    allow_special_tokens: bool = False, context: int | None = None,
                    generate: bool = True) -> list[int]:  # fmt: skip
    """Prompt ids of validated `messages` (`chat_messages`) through the chat template, honouring the body's
    `chat_template_kwargs`, `documents`, `continue_final_message` and `add_generation_prompt`.

    With a `context`, a conversation too long for it by `input_bounds`' character bound is refused before it is
    tokenized: on its user turns and pre-fill before rendering, and, when the body's strings as a whole could be
    too long, on the rendered text (rendering is string work; tokenizing is what costs seconds).

    Raises:
        APIError: 400 naming the field: no tokenizer, a bad template variable, or the template rejected them;
            `context_length_exceeded` (param `messages`) for a conversation the bound shows cannot fit.
    """
    if tokenizer is None:
        raise bad(None, "the served model has no tokenizer: use /v1/completions with token ids")
    kwargs = _template_kwargs(body, () if allow_special_tokens else tokenizer.special_token_texts)
    messages, prefill = _continue_final(body, messages)
    try:
        if context is not None:
            check_text_fits([*user_texts(messages), prefill], tokenizer, context, "messages", generate=generate)
            total = string_chars(messages) + string_chars(tools) + string_chars(kwargs) + len(prefill)
            if could_exceed(tokenizer, total, context, generate=generate):
                text = tokenizer.apply_chat_template(messages, tools=tools or None, **kwargs)
                check_text_fits([text, prefill], tokenizer, context, "messages", generate=generate)
                checkpoint()  # rendered; the client may have left meanwhile
        return tokenizer.encode_chat(messages, tools=tools or None, prefill=prefill,
                                     special_tokens_in_content=allow_special_tokens, **kwargs)  # fmt: skip
    except (ValueError, TypeError) as err:
        raise bad("messages", f"the chat template rejected the messages: {err}") from None

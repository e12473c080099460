"""`astrai.chat`: generate the assistant's reply to a conversation through the model's chat template.

The conversation is rendered with the template for generation (`add_generation_prompt`) and encoded with
`Tokenizer.encode_chat`, without the tokenizer's post-processor: the template writes every special token itself
(a Llama-3-style template renders `<|begin_of_text|>`), so the ids hold exactly one BOS, as transformers'
`apply_chat_template(..., add_generation_prompt=True, tokenize=True)` and vLLM's chat route give them.
Special-token text inside message contents (a user typing `<|im_end|>`) is encoded as plain text, as the server
does (`encode_chat`); for conversations without such text the ids equal transformers'.

Not here: streaming (use an `Engine`), tool-call parsing of the reply (the server's job: `astrai.serve`), and
`generation_config.json` sampling defaults (the arguments' defaults are greedy, as `astrai.generate`'s).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from astrai.inference.generate import _params, _run
from astrai.io.model import Model

Message = Mapping[str, Any]


def _is_conversation(messages: Any) -> bool:
    return isinstance(messages, Sequence) and not isinstance(messages, str) and bool(messages)


def check_message(message: Any, where: str) -> None:
    """Raise ValueError unless `message` is a chat message: a dict with a string `role` and a `content` that is a
    string or a list of content parts (null or absent only beside `tool_calls`, an assistant's call turn).

    Templates read both keys; without the check a missing one surfaces as a jinja error about a `dict object`.
    """
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        got = "no 'role'" if role is None else f"role {role!r}"
        raise ValueError(f"{where} needs a 'role' string such as 'user' or 'assistant', got {got}")
    content = message.get("content")
    if content is None and message.get("tool_calls") is None:
        raise ValueError(f"{where} (role {role!r}) has no 'content' (only an assistant message with 'tool_calls' "
                         "may leave it out)")  # fmt: skip
    if content is not None and not isinstance(content, str | list | tuple):
        raise ValueError(f"{where} 'content' must be a string or a list of content parts, got "
                         f"{type(content).__name__}")  # fmt: skip


def chat(
    model: Model,
    messages: Sequence[Message] | Sequence[Sequence[Message]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: str | Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
) -> str | list[str]:
    """Reply to one conversation, or to each of a batch of conversations, through the chat template.

    Args:
        model: a loaded model whose tokenizer has a chat template.
        messages: one conversation, `[{"role": "user", "content": "hi"}, ...]`, or a list of conversations
            (generated together in one batch).
        tools: JSON schemas of the tools the model may call (rendered by the template; the reply is returned
            as text, tool calls unparsed).
        chat_template: a template name from `model.tokenizer.chat_templates` or a whole jinja2 template.
        chat_template_kwargs: more template variables, e.g. `{"enable_thinking": False}` (vLLM's field name).
        max_tokens: most new tokens per reply.
        temperature: 0 for greedy decoding; otherwise the softmax temperature.
        top_k: keep the k most likely tokens (0: off).
        top_p: nucleus mass (1: off).
        seed: seed of the sampling noise (reproducible output).
        stop: stop strings (the reply ends before them).
        stop_token_ids: ids that end a reply; None means the model's eos ids (which include the end-of-turn
            token of the checkpoints' generation_config.json).

    Returns:
        the assistant's reply text (special tokens left out): a `str` for one conversation, a `list[str]` in
        order for a list of conversations.

    Raises:
        ValueError: no tokenizer or no chat template, an empty conversation, a message without a string `role`
            or without `content` (`check_message`), the template rejected the conversation or failed
            (`ChatTemplateError`), or a prompt plus `max_tokens` longer than the model's context.
    """
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer (no tokenizer.json in its folder): use astrai.generate_ids")
    if not _is_conversation(messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    single = isinstance(messages[0], Mapping)
    conversations = [messages] if single else list(messages)
    kwargs = dict(chat_template_kwargs or {})
    if "add_generation_prompt" in kwargs:
        raise ValueError("chat always renders the generation prompt: drop add_generation_prompt")
    ids = []
    for i, conversation in enumerate(conversations):
        if not _is_conversation(conversation) or not all(isinstance(m, Mapping) for m in conversation):
            raise ValueError(f"conversation {i} must be a non-empty list of message dicts")
        for j, message in enumerate(conversation):
            check_message(message, f"message {j}" if single else f"conversation {i} message {j}")
        ids.append(model.tokenizer.encode_chat(conversation, tools=tools, chat_template=chat_template, **kwargs))
    params = _params(max_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids)
    texts = [c.outputs[0].text for c in _run(model, ids, params)]
    return texts[0] if single else texts

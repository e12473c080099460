"""A reply's size, estimated before generation from the request's fields (`common.check_reply_size` bounds it by
the server's `--max-reply-bytes`): per part of the reply, the fields that make it big and their estimated bytes,
so a request whose reply would be too big is refused naming what to lower, before anything runs."""

from __future__ import annotations

from astrai.serve import common
from astrai.serve.openai_protocol import ChatRequest, CompletionRequest


def chat_reply_parts(chat: ChatRequest) -> list[tuple[str, tuple[str, ...], int]]:
    """The estimated bytes of a chat reply, per part and the fields that make it (`common.check_reply_size`)."""
    p, n = chat.params, chat.params.n
    parts = [("text: n x max_tokens tokens", ("n", "max_tokens"),
              n * (p.max_tokens * common.BYTES_PER_TOKEN_TEXT + len(chat.echo.encode())))]  # fmt: skip
    if p.wants_logprobs:
        parts.append(("logprobs: n x max_tokens x (top_logprobs + 1) entries", ("n", "max_tokens", "top_logprobs"),
                      n * p.max_tokens * (p.top_logprobs + 1) * common.BYTES_PER_CHAT_LOGPROB))  # fmt: skip
    if chat.prompt_logprobs is not None:
        parts.append(("prompt_logprobs: prompt tokens x (prompt_logprobs + 1) entries", ("prompt_logprobs",),
                      len(chat.prompt) * (chat.prompt_logprobs + 1) * common.BYTES_PER_VLLM_LOGPROB))  # fmt: skip
    return parts


def completion_reply_parts(req: CompletionRequest) -> list[tuple[str, tuple[str, ...], int]]:
    """The estimated bytes of a completions reply (every prompt's n choices), per part and the fields that make it
    (`common.check_reply_size`). Each choice repeats its prompt's echoed text and scores."""
    n, k = req.n, req.logprobs or 0
    made = [p.params.max_tokens if req.generate else 0 for p in req.prompts]
    held = [len(p.ids) for p in req.prompts]
    parts = [("text: prompts x n x (max_tokens tokens + echo)", ("n", "max_tokens", "prompt"),
              n * sum(m * common.BYTES_PER_TOKEN_TEXT + len(p.echo.encode()) for m, p in zip(made, req.prompts,
                                                                                           strict=True)))]  # fmt: skip
    if req.logprobs is not None:
        parts.append(("logprobs: prompts x n x max_tokens x (logprobs + 1) entries", ("n", "max_tokens", "logprobs"),
                      n * sum(made) * (k + 1) * common.BYTES_PER_LEGACY_LOGPROB))  # fmt: skip
    if req.prompt_logprobs:
        parts.append(("echo: prompts x n x prompt tokens x (logprobs + 2) entries", ("echo", "logprobs", "n", "prompt"),
                      n * sum(held) * (k + 2) * common.BYTES_PER_LEGACY_LOGPROB))  # fmt: skip
    if req.prompt_top is not None:
        parts.append(("prompt_logprobs: prompts x n x prompt tokens x (prompt_logprobs + 1) entries",
                      ("prompt_logprobs", "n", "prompt"),
                      n * sum(held) * (req.prompt_top + 1) * common.BYTES_PER_VLLM_LOGPROB))  # fmt: skip
    return parts

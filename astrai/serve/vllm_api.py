"""vLLM's operational routes, so scripts, routers and dashboards written for `vllm serve` work unchanged.

- `POST /tokenize`: vLLM's two request shapes. A completion body `{"prompt": str, "add_special_tokens": true}`, or
  a chat body `{"messages": [...], "tools"?, "add_generation_prompt"?, "continue_final_message"?,
  "chat_template_kwargs"?, "documents"?}` rendered exactly as `/v1/chat/completions` renders it (`chat_prompt`),
  so the count is the prompt the chat route submits. `return_token_strs: true` adds each token's string. Answer:
  `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` null unless asked), as vLLM's.
- `POST /detokenize`: `{"tokens": [int, ...]}` -> `{"prompt": str}` (special tokens kept, as vLLM's).
- `GET /version`: `{"version": astrai's version}`.
- `GET|POST /ping`: SageMaker's health probe, as vLLM answers it: the same as `GET /health`.

`model` may be given (any string, as on the other routes). Every other field is a 400 naming it. Rendering and
tokenizing run on the server's worker pool, never on the event loop; bodies are bounded by the server's body limit.
"""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from astrai.io.tokenizer import Tokenizer
from astrai.serve.chat_prompt import encode_messages
from astrai.serve.common import json_body, openai_error, route
from astrai.serve.input_bounds import check_text_fits
from astrai.serve.openai_protocol import chat_messages
from astrai.serve.sampling_fields import bad, check_fields, flag, is_token_id
from astrai.serve.state import ServerState

_COMPLETION_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT_FIELDS = frozenset({"model", "messages", "tools", "add_generation_prompt", "continue_final_message",
                          "chat_template_kwargs", "documents", "add_special_tokens", "return_token_strs"})  # fmt: skip
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
JSON = "application/json"


def version() -> str:
    """astrai's installed version ("unknown" in a source checkout that was never installed)."""
    try:
        return metadata.version("astrai")
    except metadata.PackageNotFoundError:
        return "unknown"


def tokenize(body: dict, tokenizer: Tokenizer | None, *, allow_special_tokens: bool = False,
             context: int | None = None) -> list[int]:  # fmt: skip
    """The token ids of a /tokenize body (either shape); 400 naming the field for anything wrong.

    With a `context`, a text the character bound shows is longer than it is a 400 `context_length_exceeded`
    before it is rendered or tokenized (`input_bounds`), as on the generating routes."""
    if tokenizer is None:
        raise bad(None, "the served model has no tokenizer")
    if "messages" in body:
        check_fields(body, _CHAT_FIELDS, {})
        if flag(body, "add_special_tokens"):
            raise bad("add_special_tokens", "add_special_tokens true is not supported with messages: the chat "
                                            "template places the special tokens")  # fmt: skip
        messages, tools = chat_messages(body)
        return encode_messages(body, tokenizer, messages, tools, allow_special_tokens=allow_special_tokens,
                               context=context, generate=False)  # fmt: skip
    check_fields(body, _COMPLETION_FIELDS, {})
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("prompt", "prompt must be a string (or send messages)")
    if context is not None:
        check_text_fits(prompt, tokenizer, context, "prompt", generate=False)
    return tokenizer.encode(prompt, add_special_tokens=flag(body, "add_special_tokens", True))


def detokenize(body: dict, tokenizer: Tokenizer | None, *, vocab_size: int) -> str:
    """The text of a /detokenize body's `tokens`; 400 naming the field for anything wrong."""
    check_fields(body, _DETOKENIZE_FIELDS, {})
    if tokenizer is None:
        raise bad(None, "the served model has no tokenizer")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_token_id(t) for t in tokens):
        raise bad("tokens", "tokens must be a list of integer token ids")
    outside = [t for t in tokens if not 0 <= t < vocab_size]
    if outside:
        raise bad("tokens", f"token ids outside [0, {vocab_size}): {outside[:5]}")
    return tokenizer.decode(tokens, skip_special_tokens=False)


def routes(state: ServerState, health: Any) -> list[Route]:
    """vLLM's operational routes over `state`; `health` is the app's /health handler (/ping answers the same)."""

    def tokenize_reply(body: dict) -> bytes:  # on a worker: rendering, tokenizing and encoding grow with the body
        ids = tokenize(body, state.tokenizer, allow_special_tokens=state.allow_special_tokens_in_content,
                       context=state.context)  # fmt: skip
        strs = [state.tokenizer.id_to_token(t) for t in ids] if flag(body, "return_token_strs") else None
        reply = {"count": len(ids), "max_model_len": state.context, "tokens": ids, "token_strs": strs}
        return json.dumps(reply, ensure_ascii=False).encode()

    def detokenize_reply(body: dict) -> bytes:
        text = detokenize(body, state.tokenizer, vocab_size=state.vocab_size)
        return json.dumps({"prompt": text}, ensure_ascii=False).encode()

    async def checked_body(request: Request) -> dict:
        body = await json_body(request)
        state.check_model(body)
        return body

    async def tokenize_route(request: Request) -> Response:
        return Response(
            await state.offload(tokenize_reply, await checked_body(request), request=request), media_type=JSON
        )

    async def detokenize_route(request: Request) -> Response:
        return Response(await state.offload(detokenize_reply, await checked_body(request)), media_type=JSON)

    async def version_route(request: Request) -> Response:
        return JSONResponse({"version": version()})

    return [Route("/tokenize", route(openai_error, tokenize_route), methods=["POST"]),
            Route("/detokenize", route(openai_error, detokenize_route), methods=["POST"]),
            Route("/version", route(openai_error, version_route)),
            Route("/ping", route(openai_error, health), methods=["GET", "POST"])]  # fmt: skip

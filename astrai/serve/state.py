"""`ServerState`: what the route handlers share (the engine, the served name, metrics, auth and limits, sampling
defaults, whether requests are logged, the tool-call and reasoning parsers).

Handlers (`openai_api`, `anthropic_api`, `embeddings_api`) and `app` import it; the protocol modules never do:
they take the tokenizer and the limits they check as arguments.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import attrs
from starlette.requests import Request

from astrai.inference.engine import Engine
from astrai.models.encoder import EncoderConfig
from astrai.serve import disconnect
from astrai.serve.common import APIError
from astrai.serve.metrics import Metrics
from astrai.serve.reasoning import check_parser
from astrai.serve.sampling_fields import check_defaults
from astrai.serve.tool_parsers import check_parser_name, detect_parser


@attrs.define(eq=False)
class ServerState:
    """What the route handlers share."""

    engine: Engine
    model_name: str
    # other names a request's `model` may give (vLLM's extra --served-model-name values, the --model path as typed)
    model_aliases: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    metrics: Metrics = attrs.Factory(Metrics)
    created: int = attrs.Factory(lambda: int(time.time()))
    api_key: str | tuple[str, ...] | None = None  # one key or several (any of them is accepted)
    cache_salt_by_api_key: bool = False  # True: each API key's requests share prefix-cache pages only among themselves
    enable_prompt_tokens_details: bool = False  # True: usage reports prompt_tokens_details.cached_tokens (vLLM's flag)
    metrics_public: bool = False  # True: GET /metrics needs no API key even when one is set
    max_body_bytes: int = 8 << 20
    # largest reply a request may ask for, as estimated before generation (`common.check_reply_size`); None: any
    max_reply_bytes: int | None = 32 << 20
    # seconds a stream's send may stay blocked (its client stopped reading) before its request is aborted
    stream_stall_timeout: float | None = 30.0
    embeddings: EncoderConfig | None = None  # None: /v1/embeddings answers 404
    tokenizer_workers: int = 4  # requests rendering chat templates / tokenizing at once, each on a worker thread
    allow_special_tokens_in_content: bool = False  # True: special-token text in chat messages is control tokens
    # defaults for the sampling fields a request leaves unset (`sampling_fields.SAMPLING_DEFAULT_KEYS`; e.g. the
    # model's generation_config.json, `Model.generation_defaults`); a request's own value always wins
    sampling_defaults: Mapping[str, Any] = attrs.field(
        factory=dict, converter=dict, validator=lambda _s, _a, v: check_defaults(v)
    )
    log_requests: bool = False  # True: log each request's id, route, prompt (truncated) and sampling params at INFO
    # the format of the model's tool calls (`tool_parsers.PARSERS`); None: detected from the chat template
    tool_call_parser: str | None = attrs.field(
        default=None, validator=lambda _s, _a, v: v is None or bool(check_parser_name(v))
    )
    # `reasoning.PARSERS` name: split <think>...</think> into reasoning_content / thinking blocks; None: leave the
    # text as the model wrote it
    reasoning_parser: str | None = attrs.field(default=None, validator=lambda _s, _a, v: check_parser(v))
    # LoRA adapters (`lora_api`): the parent their model cards name, by adapter (vLLM's base_model_name; unset:
    # model_name); whether POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist; the folder runtime loads
    # must read under (None: any)
    lora_parents: dict[str, str] = attrs.Factory(dict)
    lora_runtime_updates: bool = False
    lora_root: Path | None = attrs.field(default=None, converter=lambda v: None if v is None else Path(v))
    # request tracing (`tracing.Tracer`, `astrai serve --otlp-traces-endpoint`); None: off, and no hook does work
    tracer: Any = None
    _tokenizing: anyio.CapacityLimiter = attrs.field(
        init=False, default=attrs.Factory(lambda self: anyio.CapacityLimiter(self.tokenizer_workers), takes_self=True)
    )

    async def offload(self, fn: Callable[..., Any], /, *args: Any, request: Request | None = None,
                      **kwargs: Any) -> Any:  # fmt: skip
        """`fn(*args, **kwargs)` run on a worker thread, at most `tokenizer_workers` at once (the rest queue).

        For the heavy per-request host work (chat-template rendering, tokenization), so that the event loop keeps
        streaming other replies meanwhile; `fn` should release the GIL where it can (`Tokenizer.encode_nogil`).
        With the `request` (its body already read), work for a client that disconnects is skipped if it has not
        started and stops at its next `disconnect.checkpoint()` if it has: an APIError 499 nobody reads.
        """
        if request is None:
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self._tokenizing)
        gone = threading.Event()
        watcher = asyncio.create_task(disconnect.watch(request, gone))
        try:
            work = functools.partial(disconnect.run_unless_gone, gone, fn, *args, **kwargs)
            return await anyio.to_thread.run_sync(work, limiter=self._tokenizing)
        except disconnect.ClientGone:
            raise APIError(499, "the client closed the request") from None
        finally:
            watcher.cancel()

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys (empty: none is required)."""
        if not self.api_key:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(k for k in self.api_key if k)

    def check_model(self, body: Mapping[str, Any]) -> str | None:
        """The LoRA adapter the request's `model` names (None: the base model), or APIError 404 `model_not_found`
        when it names a model this server does not serve.

        A missing or empty `model` means the base model (as vLLM takes it); a non-string is left to the field
        checks of the route, which name it.
        """
        name = body.get("model")
        if not isinstance(name, str) or not name or name == self.model_name or name in self.model_aliases:
            return None
        if name in self.adapters():
            return name
        # OpenAI's wording and code (the SDKs raise NotFoundError on the 404)
        raise APIError(404, f"The model `{name[:200]}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")  # fmt: skip

    def adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters, name -> folder, in load order (empty when the engine serves none)."""
        return self.engine.loras() if self.engine.config.enable_lora else {}

    def reply_model(self, lora: str | None) -> str:
        """The `model` a reply reports: the adapter's name, else the served name."""
        return self.model_name if lora is None else lora

    @property
    def tokenizer(self):
        """The served model's tokenizer (None when the folder has none)."""
        return self.engine.model.tokenizer

    @functools.cached_property
    def tool_parser(self) -> str:
        """The tool-call parser's name: `tool_call_parser`, else the one the chat template's markup asks for."""
        if self.tool_call_parser is not None:
            return self.tool_call_parser
        return detect_parser(self.tokenizer.chat_template if self.tokenizer is not None else None)

    @property
    def vocab_size(self) -> int:
        """The served model's vocabulary size (token ids and logit_bias keys must be below it)."""
        return self.engine.model.config.vocab_size

    @property
    def max_waiting(self) -> int:
        """Most sequences the engine queues (a list of prompts times n may not ask for more)."""
        return self.engine.config.max_waiting

    @property
    def context(self) -> int:
        """Tokens one sequence may hold, prompt and completion together (the model's length, capped by the KV pool)."""
        engine = self.engine
        return min(engine.max_model_len, (engine.pool.num_pages - 1) * engine.config.page_size)

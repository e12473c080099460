"""The worker endpoints SGLang's router (`sglang-router`, the SGLang Model Gateway) calls, so `astrai serve` workers
started separately (on this host or others) can sit behind it; docs/serving.md ("Behind a router") has the recipe.

What the router (0.3.2, tried) calls on a worker, besides the OpenAI routes it forwards:

- `GET /health`: its startup and periodic health checks (the app's own route, open without a key).
- `GET /server_info` (then `/get_server_info`) and `GET /model_info` (then `/get_model_info`): metadata read when a
  worker is added; `served_model_name` becomes the worker's model id (the router's `/v1/models`), a 404 leaves it
  "unknown". astrai answers SGLang's field names: `served_model_name`, `tp_size`, `dp_size`, `max_total_tokens`
  (KV pool tokens), `max_running_requests`, `page_size`, `context_length`, `version`; `is_generation`,
  `model_type`. No `model_path` or `tokenizer_path`: given one, the router loads a tokenizer from it (a Hugging
  Face download on the router's host), which it needs only for its own gRPC and tokenizing routes.
- `POST /flush_cache`: the router's `/flush_cache` fans it out; drops the worker's prefix cache
  (`Engine.invalidate_prefix_cache`). As SGLang's, it is refused (400) while requests are in flight. A bodiless
  POST (the router sends no content type), so it is exempt from the JSON-only rule (`BARE_POSTS`).
- `GET /get_load`: the router's `/get_loads` and its `power_of_two` policy: one entry per data-parallel rank,
  `{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}`, `num_tokens` being the KV tokens requests hold (the
  figure the router compares). `GET /v1/loads` answers the newer gateways' shape (`{"loads": [{...,
  "num_used_tokens"}]}`) with the same figures.

All of them need the API key when one is set (`KEYED_PATHS`; the router sends its `--api-key` as a bearer token to
workers on every call but the health check), as /v1/models and /metrics do; /health stays open for probes.

The router re-serializes the bodies it forwards, adding SGLang's own sampling fields with their default values:
`no_stop_trim`, `separate_reasoning`, `stream_reasoning`, `return_hidden_states` (chat and completions).
`router_fields` folds them into astrai's (the OpenAI routes call it before checking a body's fields).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from astrai.inference.engine import EngineStats
from astrai.serve.common import APIError, openai_error, route
from astrai.serve.state import ServerState
from astrai.serve.vllm_api import version

KEYED_PATHS = frozenset({"/server_info", "/get_server_info", "/model_info", "/get_model_info", "/flush_cache",
                         "/get_load"})  # fmt: skip
"""Paths outside /v1/ that need the API key (the Guard adds them to its own)."""
BARE_POSTS = frozenset({"/flush_cache"})
"""POST routes taking no body, exempt from the JSON content type rule (the router sends none)."""


def _tokens(stats: EngineStats, page_size: int) -> tuple[int, int]:
    """(KV tokens held by requests, KV tokens in the pool); cached prefix pages count as free (evictable)."""
    return stats.kv_pages_used * page_size, stats.kv_pages_total * page_size


def routes(state: ServerState) -> list[Route]:
    """The router-facing worker routes over `state`."""
    engine = state.engine

    def server_info() -> dict[str, Any]:
        config = engine.config
        return {"served_model_name": state.model_name, "tp_size": config.tensor_parallel_size, "dp_size": 1,
                "max_total_tokens": _tokens(engine.stats(), config.page_size)[1],
                "max_running_requests": config.max_running, "page_size": config.page_size,
                "context_length": state.context, "version": version(), "engine": "astrai"}  # fmt: skip

    async def server_info_route(request: Request) -> Response:
        return JSONResponse(server_info())

    async def model_info_route(request: Request) -> Response:
        model = engine.model.config
        return JSONResponse({"is_generation": True, "model_type": model.model_type,
                             "served_model_name": state.model_name})  # fmt: skip

    async def flush_cache_route(request: Request) -> Response:
        if engine.unavailable is not None:
            raise APIError(503, engine.unavailable)
        try:  # may wait for a step queued ahead to settle: off the event loop
            await asyncio.to_thread(engine.invalidate_prefix_cache)
        except RuntimeError as err:  # requests in flight (SGLang refuses then too)
            raise APIError(400, f"the prefix cache was not flushed: {err}") from None
        return JSONResponse({"flushed": True, "message": "Cache flushed."})

    def loads() -> list[dict[str, Any]]:
        stats = engine.stats()
        used, total = _tokens(stats, engine.config.page_size)
        return [{"dp_rank": 0, "num_reqs": stats.running + stats.waiting, "num_running_reqs": stats.running,
                 "num_waiting_reqs": stats.waiting, "num_tokens": used, "num_used_tokens": used,
                 "max_total_num_tokens": total, "token_usage": used / total if total else 0.0}]  # fmt: skip

    async def get_load_route(request: Request) -> Response:
        return JSONResponse(loads())

    async def loads_route(request: Request) -> Response:
        return JSONResponse({"loads": loads()})

    get = ["GET"]
    return [Route("/server_info", route(openai_error, server_info_route), methods=get),
            Route("/get_server_info", route(openai_error, server_info_route), methods=get),
            Route("/model_info", route(openai_error, model_info_route), methods=get),
            Route("/get_model_info", route(openai_error, model_info_route), methods=get),
            Route("/flush_cache", route(openai_error, flush_cache_route), methods=["POST"]),
            Route("/get_load", route(openai_error, get_load_route), methods=get),
            Route("/v1/loads", route(openai_error, loads_route), methods=get)]  # fmt: skip

"""OpenAI-compatible `POST /v1/embeddings`: the served model's blocks run bidirectionally and pooled per input.

Enabled by `build_app(..., embeddings=EncoderConfig(...))` (`astrai serve --embeddings`); pooling and
normalisation are the server's, fixed at start. Disabled, the route answers 404 saying how to enable it.

`input` is a string, a list of strings, a list of token ids, or a list of token-id lists (at most
`MAX_INPUTS`); text is tokenized with the model's tokenizer. `encoding_format` "float" (default) or "base64"
(little-endian float32 bytes, what the openai SDK asks for by default and decodes). `dimensions` is refused
(no truncation or projection is offered). Bad fields are 400s naming `param`.

The encoder is the dense forward without a KV cache, so it never touches the engine's pool or scheduler; it
runs on a worker thread (one request at a time, behind a lock) so the event loop keeps streaming chat replies;
text inputs are tokenized on the server's tokenizer pool (`ServerState.offload`) for the same reason.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from astrai.inference.embed import check_ids, embed_ids
from astrai.serve import common
from astrai.serve.common import APIError, openai_error
from astrai.serve.sampling_fields import check_fields
from astrai.serve.state import ServerState

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
"""OpenAI's embeddings fields (`user` is accepted and unused); any other is a 400 naming it, as on the other
routes, so a misspelt field is not silently ignored."""
_FORMATS = ("float", "base64")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


@attrs.frozen
class EmbeddingRequest:
    """A validated embeddings request: one token-id list per input, and the reply's encoding."""

    inputs: list[list[int]]
    base64: bool


def _inputs(state: ServerState, value: Any) -> list[list[int]]:
    """Token ids of every input; 400 naming `input` for anything but the four OpenAI shapes."""
    shape = "a non-empty string, a list of strings, a list of token ids, or a list of token-id lists"
    if isinstance(value, str):
        value = [value]
    elif _is_ids(value) and value:
        value = [value]
    if not isinstance(value, list) or not value:
        raise _bad("input", f"input must be {shape}; got {json.dumps(value)[:60]}")
    if len(value) > MAX_INPUTS:
        raise _bad("input", f"input has {len(value)} items; at most {MAX_INPUTS} per request")
    if all(isinstance(v, str) for v in value):
        if state.tokenizer is None:
            raise _bad("input", "the served model has no tokenizer: send token ids")
        if not all(value):
            raise _bad("input", f"input[{[bool(v) for v in value].index(False)}] is an empty string")
        return state.tokenizer.encode_batch(value)
    if not all(_is_ids(v) for v in value):
        raise _bad("input", f"input must be {shape} (not a mix); got {json.dumps(value)[:60]}")
    return value


def parse_embeddings(state: ServerState, body: dict) -> EmbeddingRequest:
    """Validate a /v1/embeddings body; raises APIError 400 naming the offending field."""
    check_fields(body, FIELDS, {})
    if body.get("dimensions") is not None:
        raise _bad("dimensions", "dimensions is not supported by this server: vectors have the model's hidden size")
    if not isinstance(body.get("model", ""), str):
        raise _bad("model", f"model must be a string, got {json.dumps(body['model'])[:60]}")
    fmt = body.get("encoding_format") or "float"
    if fmt not in _FORMATS:
        raise _bad("encoding_format", f"encoding_format must be 'float' or 'base64', got {json.dumps(fmt)[:60]}")
    if "input" not in body:
        raise _bad("input", "input is required")
    ids = _inputs(state, body["input"])
    try:
        check_ids(state.engine.model.config, ids)
    except ValueError as err:  # empty, too long, or an id outside the vocabulary
        raise _bad("input", str(err)) from None
    return EmbeddingRequest(ids, fmt == "base64")


def _encode_vector(vector: Any, as_base64: bool) -> list[float] | str:
    if as_base64:
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def routes(state: ServerState) -> list[Route]:
    """`POST /v1/embeddings` over `state` (404 unless `state.embeddings` is set)."""
    lock = threading.Lock()  # one encoder pass at a time: bounded memory, fair to the engine thread

    def run(ids: list[list[int]]) -> Any:
        enc = state.embeddings
        with lock:
            vectors = embed_ids(state.engine.model, ids, pooling=enc.pooling, normalize=enc.normalize)
        return vectors.cpu()

    async def embeddings(request: Request) -> Response:
        if state.embeddings is None:
            raise APIError(404, "embeddings are not enabled on this server: start it with `astrai serve "
                           "--embeddings`", type="not_found_error")  # fmt: skip
        body = await common.json_body(request)
        state.check_model(body)
        req = await state.offload(parse_embeddings, state, body)  # tokenizes
        vectors = await asyncio.to_thread(run, req.inputs)
        tokens = sum(len(row) for row in req.inputs)
        state.metrics.embedding_tokens += tokens
        data = [{"object": "embedding", "index": i, "embedding": _encode_vector(v, req.base64)}
                for i, v in enumerate(vectors)]  # fmt: skip
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return JSONResponse({"object": "list", "data": data, "model": state.model_name, "usage": usage})

    return [Route("/v1/embeddings", common.route(openai_error, embeddings), methods=["POST"])]

"""OpenAI-compatible `POST /v1/embeddings`: the served model's blocks run bidirectionally and pooled per input.

Enabled by `build_app(..., embeddings=EncoderConfig(...))` (`astrai serve --embeddings`); pooling and
normalisation are the server's, fixed at start. Disabled, the route answers 404 saying how to enable it.

`input` is a string, a list of strings, a list of token ids, or a list of token-id lists (at most
`MAX_INPUTS`); text is tokenized with the model's tokenizer. `encoding_format` "float" (default) or "base64"
(little-endian float32 bytes, what the openai SDK asks for by default and decodes). `dimensions` is refused
(no truncation or projection is offered). Bad fields are 400s naming `param`.

Fairness. The encoder is the dense forward without a KV cache, so it never touches the engine's pool or
scheduler; like the engine, it works in bounded steps and takes turns:

- a request may hold at most `max_request_tokens` tokens over all its inputs (400 naming `input` past it; text
  is tokenized in chunks and stops at the first chunk past the budget);
- the request's rows are planned into encoder passes of at most `max_batch_tokens` padded tokens
  (`astrai.inference.embed.plan_batches`), and one dedicated thread (`Embedder`, not the default executor) runs
  one pass at a time, round-robin over the requests it holds: a small request waits for at most one pass of each
  request ahead of it, never for a whole large one;
- before each pass the worker drops requests whose client left (a watcher on the connection marks them), so a
  disconnect frees the encoder within one pass; tokenization stops at its next chunk too;
- once the engine is shut down (the graceful shutdown's deadline, `server.GracefulServer`) or dead, the
  requests still held end with a 503 at the next pass, and new ones are refused with a 503;
- at most `max_queued` requests are held at once; more are answered 429.

Text inputs are tokenized on the server's tokenizer pool (`ServerState.offload`), off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import threading
from collections.abc import Callable
from typing import Any

import attrs
import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from torch import Tensor

from astrai.inference.embed import check_ids, encode_rows, plan_batches
from astrai.io.model import Model
from astrai.models.encoder import EncoderConfig
from astrai.openmp import release_idle_threads
from astrai.serve import common
from astrai.serve.common import APIError, openai_error
from astrai.serve.disconnect import ClientGone, watch
from astrai.serve.input_bounds import check_text_fits, tokens_over
from astrai.serve.sampling_fields import check_fields
from astrai.serve.state import ServerState

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
MAX_REQUEST_TOKENS = 300_000  # OpenAI's limit on tokens per embeddings request, over all its inputs
MAX_QUEUED = 64  # embeddings requests the worker holds at once; more are 429
TOKENIZE_CHUNK = (64, 1 << 18)  # texts and characters tokenized between checks of the budget and the client
FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
"""OpenAI's embeddings fields (`user` is accepted and unused); any other is a 400 naming it, as on the other
routes, so a misspelt field is not silently ignored."""
_FORMATS = ("float", "base64")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _over_budget(tokens: int, budget: int, *, exact: bool) -> APIError:
    counted = f"{tokens}" if exact else f"at least {tokens}"  # text stops tokenizing at the first chunk past it
    return _bad("input", f"input has {counted} tokens in all; at most {budget} per request "
                "(--max-embedding-tokens-per-request)")  # fmt: skip


@attrs.frozen
class EmbeddingRequest:
    """A validated embeddings request: one token-id list per input, and the reply's encoding."""

    inputs: list[list[int]]
    base64: bool


def _tokenize(state: ServerState, texts: list[str], budget: int, gone: threading.Event) -> list[list[int]]:
    """Token ids of `texts`, in chunks: stops with a 400 once past `budget` tokens, with ClientGone once `gone`."""
    assert state.tokenizer is not None
    out: list[list[int]] = []
    total, start = 0, 0
    while start < len(texts):
        end, chars = start, 0
        while end < len(texts) and end - start < TOKENIZE_CHUNK[0] and (end == start or chars < TOKENIZE_CHUNK[1]):
            chars += len(texts[end])
            end += 1
        if gone.is_set():
            raise ClientGone
        ids = state.tokenizer.encode_batch(texts[start:end])
        total += sum(len(row) for row in ids)
        if total > budget:
            raise _over_budget(total, budget, exact=end == len(texts))
        out += ids
        start = end
    return out


def _check_chars(state: ServerState, texts: list[str], budget: int) -> None:
    """Refuse texts on the character bound before tokenizing any (`input_bounds`): an input whose characters
    alone need more tokens than the encoder's positions, or inputs that together need more than `budget`."""
    context = state.engine.model.config.max_position_embeddings
    for i, text in enumerate(texts):
        check_text_fits(text, state.tokenizer, context, "input", what=f"input[{i}]" if len(texts) > 1 else "input",
                        generate=False)  # fmt: skip
    least = tokens_over(texts, state.tokenizer, budget, generate=False)
    if least is not None:
        raise _over_budget(least, budget, exact=False)


def _inputs(state: ServerState, value: Any, budget: int, gone: threading.Event) -> list[list[int]]:
    """Token ids of every input; 400 naming `input` for anything but the four OpenAI shapes, or past `budget`."""
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
        _check_chars(state, value, budget)
        return _tokenize(state, value, budget, gone)
    if not all(_is_ids(v) for v in value):
        raise _bad("input", f"input must be {shape} (not a mix); got {json.dumps(value)[:60]}")
    total = sum(len(v) for v in value)
    if total > budget:
        raise _over_budget(total, budget, exact=True)
    return value


def parse_embeddings(state: ServerState, body: dict, *, max_tokens: int = MAX_REQUEST_TOKENS,
                     gone: threading.Event | None = None) -> EmbeddingRequest:  # fmt: skip
    """Validate a /v1/embeddings body; raises APIError 400 naming the offending field (`input` past `max_tokens`
    tokens over all inputs), ClientGone when `gone` is set while tokenizing."""
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
    ids = _inputs(state, body["input"], max_tokens, gone or threading.Event())
    try:
        check_ids(state.engine.model.config, ids)
    except ValueError as err:  # empty, too long, or an id outside the vocabulary
        raise _bad("input", str(err)) from None
    return EmbeddingRequest(ids, fmt == "base64")


@attrs.define(eq=False)
class _Job:
    """One request held by the `Embedder`: its rows, its planned passes, and where its answer goes."""

    rows: list[list[int]]
    passes: list[list[int]]
    out: Tensor
    gone: threading.Event
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    done: int = 0  # passes run

    def settle(self, value: Tensor | BaseException) -> None:
        """Hand the result (or the error) to the waiting handler, from the worker thread."""

        def _set() -> None:
            if not self.future.done():
                (self.future.set_exception if isinstance(value, BaseException) else self.future.set_result)(value)

        try:
            self.loop.call_soon_threadsafe(_set)
        except RuntimeError:  # the event loop is closed: nobody waits any more
            pass


class Embedder:
    """The embeddings worker: one dedicated thread runs encoder passes one at a time, taking turns between requests.

    `run(rows, gone)` plans the rows into passes of at most `max_batch_tokens` padded tokens and waits for them;
    the thread runs one pass of the first request it holds, then moves that request behind the others
    (round-robin). Before each pass it drops requests whose `gone` is set (ClientGone) and, once `unavailable()`
    says why no request can be served any more (the engine was shut down or died), ends every request with a 503.
    The thread starts with the first request and ends at `close()`.
    """

    def __init__(self, model: Model, enc: EncoderConfig, *, max_batch_tokens: int,
                 unavailable: Callable[[], str | None], max_queued: int = MAX_QUEUED) -> None:  # fmt: skip
        if max_batch_tokens < 1 or max_queued < 1:
            raise ValueError(f"max_batch_tokens and max_queued must be >= 1, got {max_batch_tokens}, {max_queued}")
        self.model, self.enc, self.max_batch_tokens, self.max_queued = model, enc, max_batch_tokens, max_queued
        self.unavailable = unavailable
        self.passes = 0  # encoder passes run so far (tests and benchmarks watch it)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> int:
        """Requests the worker holds (queued or in a pass)."""
        with self._cv:
            return len(self._jobs)

    async def run(self, rows: list[list[int]], gone: threading.Event) -> Tensor:
        """[len(rows), E] float32 vectors on the CPU, in the order of `rows` (already checked: `check_ids`).

        Raises:
            APIError: 429 when `max_queued` requests are held already; 503 when the engine is shut down or dead.
            ClientGone: `gone` was set before the last pass.
        """
        loop = asyncio.get_running_loop()
        lengths = [len(r) for r in rows]
        job = _Job(rows, plan_batches(lengths, max_batch_tokens=self.max_batch_tokens),
                   torch.empty(len(rows), self.model.config.hidden_size, dtype=torch.float32), gone,
                   loop.create_future(), loop)  # fmt: skip
        with self._cv:
            if (reason := self.unavailable()) is not None or self._closed:
                raise APIError(503, f"embeddings are not available: {reason or 'the server is shutting down'}",
                               type="server_error")  # fmt: skip
            if len(self._jobs) >= self.max_queued:
                raise APIError(429, f"the server is busy: {self.max_queued} embeddings requests are running; retry "
                               "later", type="rate_limit_error")  # fmt: skip
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="astrai-embeddings", daemon=True)
                self._thread.start()
            self._cv.notify()
        try:
            return await job.future
        finally:
            gone.set()  # the handler stopped waiting (answered, or cancelled by the server): drop the job if held

    def close(self) -> None:
        """End the requests still held (503) and stop the thread after its current pass."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _next(self) -> _Job | None:
        """The request whose turn it is (None: closed), after settling the gone ones and, when stopping, all."""
        with self._cv:
            while True:
                reason = self.unavailable() or ("the server is shutting down" if self._closed else None)
                for job in list(self._jobs):
                    if job.gone.is_set():
                        self._jobs.remove(job)
                        job.settle(ClientGone())
                    elif reason is not None:
                        self._jobs.remove(job)
                        job.settle(APIError(503, f"the embeddings request was ended: {reason}", type="server_error"))
                if self._jobs:
                    return self._jobs[0]
                if self._closed:
                    return None
                self._cv.wait(timeout=1.0)  # also notices a dead engine while idle

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            chunk = job.passes[job.done]
            try:
                job.out[chunk] = encode_rows(self.model, [job.rows[i] for i in chunk], self.enc).cpu()
            except Exception as err:  # noqa: BLE001 - the handler re-raises it (a logged 500)
                error: BaseException | None = err
            else:
                error = None
                job.done += 1
                self.passes += 1
            with self._cv:
                self._jobs.remove(job)
                if error is None and job.done < len(job.passes):
                    self._jobs.append(job)  # behind the others: one pass per turn
            if error is not None or job.done == len(job.passes):
                job.settle(error if error is not None else job.out)
            if not self._jobs:  # idle now: this thread's OpenMP pool would slow the engine's steps (astrai.openmp)
                release_idle_threads()


def _encode_vector(vector: Any, as_base64: bool) -> list[float] | str:
    if as_base64:
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def routes(state: ServerState, embedder: Embedder | None, *, max_request_tokens: int = MAX_REQUEST_TOKENS
           ) -> list[Route]:  # fmt: skip
    """`POST /v1/embeddings` over `state`, run on `embedder` (404 unless `state.embeddings` is set)."""

    async def embeddings(request: Request) -> Response:
        if state.embeddings is None or embedder is None:
            raise APIError(404, "embeddings are not enabled on this server: start it with `astrai serve "
                           "--embeddings`", type="not_found_error")  # fmt: skip
        body = await common.json_body(request)
        if state.check_model(body) is not None:
            raise APIError(400, "embeddings come from the base model: LoRA adapters are not applied to them; name "
                                f"the base model ({state.model_name!r})", param="model")  # fmt: skip
        gone = threading.Event()
        watcher = asyncio.create_task(watch(request, gone))
        try:
            req = await state.offload(parse_embeddings, state, body, max_tokens=max_request_tokens, gone=gone)
            vectors = await embedder.run(req.inputs, gone)
        except ClientGone:
            raise APIError(499, "the client closed the request") from None
        finally:
            gone.set()
            watcher.cancel()
        tokens = sum(len(row) for row in req.inputs)
        state.metrics.embedding_tokens += tokens
        data = [{"object": "embedding", "index": i, "embedding": _encode_vector(v, req.base64)}
                for i, v in enumerate(vectors)]  # fmt: skip
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return JSONResponse({"object": "list", "data": data, "model": state.model_name, "usage": usage})

    return [Route("/v1/embeddings", common.route(openai_error, embeddings), methods=["POST"])]

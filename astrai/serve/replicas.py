"""The front of `astrai serve --data-parallel-size N`: one address for N engine replicas (vLLM's flag).

Each replica is a whole `astrai serve` worker process on a loopback port (`astrai.cli.serve_replicas` starts
them); this app, in the parent process, relays every request to one of them and adds what only the front can know:

- **Routing**: each request goes to the live replica with the fewest requests in flight through the front (ties
  rotate), so a long request does not pile others behind it on one engine. A replica that refuses the connection
  (it died and the watchdog has not noticed yet) is skipped and the request goes to the next one: nothing of it
  reached the dead one. For routing that knows each replica's prefix cache across machines, put an existing
  router in front of plain workers instead (docs/serving.md, "Replicas").
- **Relaying**: the request's method, path, query, headers (API key included: each worker checks it) and body go
  through unchanged, and the reply streams back as it comes (SSE included), so every route behaves as on one
  engine. A client that leaves closes the upstream request, and the worker cancels the generation and frees its KV.
- **Failure**: a replica that dies is marked dead (its process' exit code, polled) and gets no more requests; its
  requests in flight end cleanly: a 502 in OpenAI's error shape when nothing was sent yet, else an error event
  closing the stream (`data: {"error": ...}`, as vLLM's streams end on an error). The others keep serving.
  `/health` answers 200 while every replica is up, 200 with `"status": "degraded"` and the dead ones named while
  some are, and 503 when none is.
- **Fan-out routes**: `/metrics` joins every live replica's metrics, each sample labelled `engine="i"` (vLLM's DP
  label), plus `astrai_replicas` / `astrai_replicas_alive`; runtime LoRA loads and unloads go to every replica, so
  every replica serves the same adapters (a load that fails on one is undone on the others).

`httpx` relays the requests (an optional dependency, `astrai[replicas]`: one engine does not need it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import subprocess
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

# connection-level headers, never relayed (RFC 9110 section 7.6.1); content-length is recomputed for the stream
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "content-length", "host"})  # fmt: skip
FAN_OUT = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


@attrs.define(eq=False)
class Replica:
    """One worker: its number, base URL, process (None when started elsewhere), requests in flight, why it is down."""

    index: int
    url: str
    process: subprocess.Popen | None = None
    in_flight: int = 0
    dead: str | None = None


class ReplicaSet:
    """The replicas behind the front and the routing rule (fewest requests in flight, ties rotating)."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.replicas = list(replicas)
        self._turn = itertools.count()

    def check(self) -> None:
        """Mark the replicas whose process has exited."""
        for replica in self.replicas:
            code = replica.process.poll() if replica.process is not None and replica.dead is None else None
            if code is not None:
                replica.dead = f"replica {replica.index} exited with code {code}"

    def alive(self) -> list[Replica]:
        self.check()
        return [r for r in self.replicas if r.dead is None]

    def pick(self, exclude: Sequence[Replica] = ()) -> Replica | None:
        """The live replica to send the next request to, or None when none is left."""
        live = [r for r in self.alive() if r not in exclude]
        if not live:
            return None
        turn = next(self._turn)
        return min(live, key=lambda r: (r.in_flight, (r.index - turn) % len(self.replicas)))


def _error(status: int, message: str, code: str) -> JSONResponse:
    """OpenAI's error body (the front has no request-specific API; every API's clients read a JSON error)."""
    return JSONResponse({"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_"
                                   "error", "param": None, "code": code}}, status_code=status)  # fmt: skip


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")
_ENGINE_LABEL = re.compile(r'(^|,)\s*engine="(?:[^"\\]|\\.)*"')


def label_engine(text: str, index: int) -> list[str]:
    """The sample lines of a Prometheus text exposition labelled `engine="index"` (an existing engine label, as the
    vllm: families carry, is replaced so no sample has the label twice; comments and blank lines dropped: the caller
    keeps one HELP/TYPE per family)."""
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, rest = match.groups()
        inner = labels[1:-1] if labels else ""
        if _ENGINE_LABEL.search(inner):  # vllm: families already carry engine="0": the replica's index replaces it
            inner = _ENGINE_LABEL.sub(lambda m: f'{m.group(1)}engine="{index}"', inner, count=1)
            out.append(f"{name}{{{inner}}}{rest}")
        else:
            out.append(f'{name}{{engine="{index}"{"," + inner if inner else ""}}}{rest}')
    return out


def merge_metrics(texts: Sequence[tuple[int, str]]) -> str:
    """Join replicas' expositions: one HELP/TYPE per family (the first seen), every sample labelled by engine."""
    meta: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for index, text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                meta.setdefault(family, [])
                if line not in meta[family] and len(meta[family]) < 2:
                    meta[family].append(line)
            elif line and not line.startswith("#"):
                samples.setdefault(family or "", []).extend(label_engine(line, index))
    lines = []
    for family in dict.fromkeys([*meta, *samples]):
        lines += meta.get(family, []) + samples.get(family, [])
    return "\n".join(lines) + "\n"


def front_app(replicas: ReplicaSet, client: Any, *, max_body_bytes: int) -> Starlette:
    """The front's Starlette app over `replicas`, relaying with the httpx.AsyncClient `client`."""
    import httpx

    async def health(request: Request) -> Response:
        live = replicas.alive()
        dead = [{"replica": r.index, "error": r.dead} for r in replicas.replicas if r.dead is not None]
        status = "ok" if not dead else "degraded" if live else "error"
        body = {"status": status, "replicas": len(replicas.replicas), "alive": len(live), "dead": dead}
        return JSONResponse(body, status_code=503 if not live else 200)

    async def metrics(request: Request) -> Response:
        live = replicas.alive()

        async def one(replica: Replica) -> tuple[int, str] | None:
            try:
                reply = await client.get(f"{replica.url}/metrics", headers=_relayed(request.headers.raw), timeout=10)
            except httpx.HTTPError:
                return None
            return (replica.index, reply.text) if reply.status_code == 200 else None

        texts = [t for t in await asyncio.gather(*(one(r) for r in live)) if t is not None]
        if live and not texts:  # every replica refused (e.g. the API key): say so as one would
            reply = await client.get(f"{live[0].url}/metrics", headers=_relayed(request.headers.raw), timeout=10)
            return Response(reply.content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))
        own = ("# HELP astrai_replicas Engine replicas behind this address.\n# TYPE astrai_replicas gauge\n"
               f"astrai_replicas {len(replicas.replicas)}\n# HELP astrai_replicas_alive Replicas serving.\n"
               f"# TYPE astrai_replicas_alive gauge\nastrai_replicas_alive {len(live)}\n")  # fmt: skip
        return PlainTextResponse(own + merge_metrics(texts), media_type="text/plain; version=0.0.4")

    async def fan_out(request: Request) -> Response:
        body = await _body(request, max_body_bytes)
        if isinstance(body, Response):
            return body
        live, done, reply = replicas.alive(), [], None
        for replica in live:
            reply = await client.post(f"{replica.url}{request.url.path}", content=body,
                                      headers=_relayed(request.headers.raw), timeout=300)  # fmt: skip
            if reply.status_code != 200:
                break
            done.append(replica)
        if reply is None:
            return _error(503, "no replica is serving", "no_replica")
        if reply.status_code != 200 and done and request.url.path.endswith("/load_lora_adapter"):
            name = json.loads(body).get("lora_name")  # undo the loads that succeeded: every replica the same
            headers = _relayed(request.headers.raw, drop=("content-type",))
            for replica in done:
                await client.post(f"{replica.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers,
                                  timeout=60)  # fmt: skip
        return Response(reply.content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    async def relay(request: Request) -> Response:
        body = await _body(request, max_body_bytes)
        if isinstance(body, Response):
            return body
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        tried: list[Replica] = []
        while (replica := replicas.pick(tried)) is not None:
            replica.in_flight += 1
            try:
                upstream = await client.send(client.build_request(request.method, replica.url + target, content=body,
                                                                  headers=_relayed(request.headers.raw)),
                                             stream=True)  # fmt: skip
                break
            except httpx.ConnectError:  # nothing reached it: another replica takes the request
                replica.in_flight -= 1
                tried.append(replica)
            except httpx.HTTPError as err:  # it took the request and died before answering
                replica.in_flight -= 1
                replicas.check()
                return _error(502, f"replica {replica.index} failed before answering: {type(err).__name__}",
                              "replica_failed")  # fmt: skip
        else:
            return _error(503, "no replica is serving: " + "; ".join(r.dead or "" for r in replicas.replicas),
                          "no_replica")  # fmt: skip
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        stream = _stream(upstream, replica, replicas)
        return StreamingResponse(stream, status_code=upstream.status_code, headers=headers)

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/health", health), Route("/metrics", metrics),
                             *(Route(path, fan_out, methods=["POST"]) for path in FAN_OUT),
                             Route("/{path:path}", relay, methods=methods)])  # fmt: skip


async def _stream(upstream: Any, replica: Replica, replicas: ReplicaSet) -> AsyncIterator[bytes]:
    """The upstream reply as it arrives; a replica that dies mid-reply ends it with an error event (SSE) or a cut
    body, and the upstream request is closed however the relay ends (the client left: the worker cancels it)."""
    import httpx

    sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as err:
        replicas.check()
        if sse:
            error = {"message": f"replica {replica.index} failed mid-stream: {type(err).__name__}",
                     "type": "server_error", "code": "replica_failed"}  # fmt: skip
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
    finally:
        replica.in_flight -= 1
        await upstream.aclose()


def _relayed(raw: Sequence[tuple[bytes, bytes]], drop: Sequence[str] = ()) -> list[tuple[bytes, bytes]]:
    """The request headers a replica gets: all but the hop-by-hop ones (and `drop`)."""
    skip = HOP_BY_HOP | set(drop)
    return [(k, v) for k, v in raw if k.decode("latin-1").lower() not in skip]


async def _body(request: Request, limit: int) -> bytes | Response:
    """The request body, read as it arrives up to `limit` bytes (413 past it, before it is all read)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return _error(413, f"the request body is larger than {limit} bytes", "body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)

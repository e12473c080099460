"""The soak's hostile-but-valid request kinds (issue 42): each a coroutine `act(ctx, rng)` that sends one attack and
records what came back in `ctx.tally` (the `bench_soak.Soak` context), plus the /health prober and RSS readings.

- `big_reply`: chat n=8 with top_logprobs=20 (a reply of ~1.4 MB, built off the event loop) or completions
  echo + logprobs over a list of prompts; one in four asks for more than the soak's `--max-reply-bytes` and must
  be refused with a 400 `reply_too_large` before generating.
- `long_prompt`: a 0.25-1 MB prompt, far past the context, on chat, completions, messages or embeddings: a 400
  on the character bound (`context_length_exceeded`, Anthropic's `invalid_request_error` on /v1/messages).
- `embed`: a small embeddings request (texts or ids), or a big one (64 x 512 ids) dropped after 0-0.3 s.
- `salted`: a chat request with a `cache_salt`, or under the second API key (the soak's server salts by key).
- `slow_reader`: a stream of n=4 x 256 tokens with top_logprobs=20 on a 4 KiB receive window whose client stops
  reading for 0.5-3 s and then leaves (the server aborts it after `--stream-stall-timeout`).
- `framing`: Content-Length with Transfer-Encoding, or a 64 KB head in one write: a 4xx and a closed connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import random

    from bench_soak import Soak

CHAT, COMPLETIONS, MESSAGES, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/embeddings"
KEYS = ("soak-key-a", "soak-key-b")  # the server's API keys; the client sends the first unless told otherwise
HI = [{"role": "user", "content": "hi"}]


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "x-api-key": key}


async def _expect_4xx(ctx: Soak, action: str, path: str, body: dict, *, code: str | None = None) -> None:
    """Send `body`; a 2xx or 5xx is a server error, and so is a 4xx without `code` (when given)."""
    response = await ctx.client.post(path, json=body)
    ctx.tally.response(action, response.status_code, good=False)
    if 400 <= response.status_code < 500 and code is not None:
        error = response.json().get("error") or {}
        if error.get("code") != code and error.get("type") != code:
            ctx.tally.fail(action, f"{path}: expected {code}, got {json.dumps(error)[:200]}")
    elif response.status_code < 300:
        ctx.tally.fail(action, f"{path}: a request that must be refused got HTTP {response.status_code}")


async def act_big_reply(ctx: Soak, rng: random.Random) -> None:
    if rng.random() < 0.25:  # predicted over the reply limit: refused before generating
        body = {"model": "bench", "messages": HI, "n": 16, "max_tokens": 400, "logprobs": True, "top_logprobs": 20}
        await _expect_4xx(ctx, "big_reply", CHAT, body, code="reply_too_large")
        return
    if rng.random() < 0.5:
        path, n = CHAT, 8
        body = {"model": "bench", "messages": HI, "n": n, "max_tokens": 128, "logprobs": True, "top_logprobs": 20,
                "ignore_eos": True, "temperature": 1.0}  # fmt: skip
    else:
        prompts = [[rng.randrange(1, ctx.vocab) for _ in range(200)] for _ in range(4)]
        path, n = COMPLETIONS, 4
        body = {"model": "bench", "prompt": prompts, "echo": True, "logprobs": 5, "max_tokens": 4}
    response = await ctx.client.post(path, json=body)
    if ctx.tally.response("big_reply", response.status_code):
        reply = response.json()
        if len(reply["choices"]) != n or not all(c.get("logprobs") for c in reply["choices"]):
            ctx.tally.fail("big_reply", f"{path}: expected {n} choices with logprobs")
        ctx.tally.rows["big_reply"]["tokens"] += reply["usage"]["completion_tokens"]


async def act_long_prompt(ctx: Soak, rng: random.Random) -> None:
    text = "soak " * (rng.randint(50_000, 200_000))  # 0.25-1 MB: far past context x the longest token
    path = rng.choice([CHAT, COMPLETIONS, MESSAGES, EMBEDDINGS])
    body = {"model": "bench", "max_tokens": 4}
    if path == COMPLETIONS:
        body["prompt"] = text
    elif path == EMBEDDINGS:
        body = {"model": "bench", "input": ["short", text]}
    else:
        body["messages"] = [{"role": "user", "content": text}]
    await _expect_4xx(ctx, "long_prompt", path, body,
                      code="invalid_request_error" if path == MESSAGES else "context_length_exceeded")  # fmt: skip


async def act_embed(ctx: Soak, rng: random.Random) -> None:
    if rng.random() < 0.3:  # a big request whose client leaves mid-way
        rows = [[rng.randrange(1, ctx.vocab) for _ in range(512)] for _ in range(64)]
        try:
            response = await asyncio.wait_for(ctx.client.post(EMBEDDINGS, json={"model": "bench", "input": rows}),
                                              rng.uniform(0.0, 0.3))  # fmt: skip
        except TimeoutError:
            ctx.tally.rows["embed"]["requests"] += 1
            ctx.tally.rows["embed"]["dropped"] += 1
            return
        ctx.tally.response("embed", response.status_code)
        return
    count = rng.randint(1, 8)
    if rng.random() < 0.5:
        inputs: list = [" ".join(rng.choices(["soak", "tokens", "vector", "the", "cache"], k=9)) for _ in range(count)]
    else:
        inputs = [[rng.randrange(1, ctx.vocab) for _ in range(rng.randint(1, 64))] for _ in range(count)]
    response = await ctx.client.post(EMBEDDINGS, json={"model": "bench", "input": inputs})
    if ctx.tally.response("embed", response.status_code) and len(response.json()["data"]) != count:
        ctx.tally.fail("embed", f"expected {count} vectors")


async def act_salted(ctx: Soak, rng: random.Random) -> None:
    body = {"model": "bench", "messages": [{"role": "user", "content": "the shared system prompt, then a question"}],
            "max_tokens": rng.randint(1, 8)}  # fmt: skip
    headers = None
    if rng.random() < 0.5:
        body["cache_salt"] = rng.choice(["tenant-1", "tenant-2"])
    else:
        headers = auth(KEYS[1])
    response = await ctx.client.post(CHAT, json=body, headers=headers)
    if ctx.tally.response("salted", response.status_code):
        usage = response.json()["usage"]
        if (usage.get("prompt_tokens_details") or {}).get("cached_tokens"):
            ctx.tally.fail("salted", "cached_tokens reported without --enable-prompt-tokens-details")


def _head(port: int, path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode()  # fmt: skip


async def _connect(port: int, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # a small window: the server's send blocks
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock, limit=1024)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def act_slow_reader(ctx: Soak, rng: random.Random) -> None:
    body = json.dumps({"model": "bench", "messages": HI, "n": 4, "max_tokens": 256, "logprobs": True,
                       "top_logprobs": 20, "stream": True, "ignore_eos": True}).encode()  # fmt: skip
    reader, writer = await _connect(ctx.port, rcvbuf=4096)
    try:
        writer.write(_head(ctx.port, CHAT, body) + body)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 30)
        code = int(status.split()[1]) if status.startswith(b"HTTP/1.1 ") else 0
        if ctx.tally.response("slow_reader", code):
            ctx.tally.rows["slow_reader"]["dropped"] += 1
            await asyncio.sleep(rng.uniform(0.5, 3.0))  # reads nothing more, then leaves
    finally:
        await _close(writer)


async def act_framing(ctx: Soak, rng: random.Random) -> None:
    if rng.random() < 0.5:  # RFC 9112 6.1: both framings; answered, then the connection is closed
        raw = _head(ctx.port, CHAT, b"0\r\n\r\n", "Transfer-Encoding: chunked\r\n") + b"0\r\n\r\n"
    else:  # a 64 KB head in one write
        raw = (f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{ctx.port}\r\nX-Pad: {'a' * 65536}\r\n\r\n").encode()
    reader, writer = await _connect(ctx.port)
    try:
        writer.write(raw)
        with contextlib.suppress(OSError):
            await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 10)  # to EOF: the server must close the connection
    except (TimeoutError, OSError) as err:
        ctx.tally.fail("framing", f"no answer and close: {type(err).__name__}")
        return
    finally:
        await _close(writer)
    code = int(reply.split()[1]) if reply.startswith(b"HTTP/1.1 ") else 0
    ctx.tally.response("framing", code, good=False)
    if not 400 <= code < 500:
        ctx.tally.fail("framing", f"expected a 4xx, got {reply[:80]!r}")


HOSTILE = {"big_reply": (act_big_reply, 0.5), "long_prompt": (act_long_prompt, 0.3), "embed": (act_embed, 0.7),
           "salted": (act_salted, 0.7), "slow_reader": (act_slow_reader, 0.3),
           "framing": (act_framing, 0.3)}  # fmt: skip


async def probe_health(ctx: Soak, latencies: list[float], period: float = 0.1) -> None:
    """GET /health every `period` seconds until the deadline: the latencies (s); a non-200 is a server error."""
    while time.monotonic() < ctx.deadline:
        t0 = time.perf_counter()
        response = await ctx.client.get("/health")
        latencies.append(time.perf_counter() - t0)
        ctx.tally.response("health", response.status_code)
        await asyncio.sleep(period)


def rss_mib() -> dict[str, float]:
    """This process's resident memory now and at its peak (the server runs in it), MiB."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in open("/proc/self/status").read().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    return {"rss_mib": fields.get("VmRSS", 0.0), "peak_rss_mib": fields.get("VmHWM", 0.0)}

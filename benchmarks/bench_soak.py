"""Soak: `--streams` concurrent clients against `astrai serve` for `--duration` seconds, with random client
disconnects and bad requests mixed in; then 0 server errors and an all-free KV pool are required.

Method. The parent process builds a random model with a trained tokenizer (`bench_serve.build_model`) and one
`Engine` (a small KV budget, so sequences are preempted under pressure), and serves it as `astrai serve` does
(`bench_serve.serve_in_thread`: `build_app`, `server_config`'s connection limits, `GracefulServer`; 127.0.0.1, a
free port, its own thread). An asyncio client on the main thread keeps `--streams` workers busy until the
deadline; each repeatedly picks an action at random:

- `stream`: a streamed OpenAI chat or completions request (random prompt, max_tokens, temperature including
  1e-39, top_p, penalties, n 1-2, logprobs, seed, stop), read to `[DONE]`; every choice must have finished.
- `full`: the same without streaming; the body must hold n finished choices.
- `anthropic`: a streamed /v1/messages request, read to `message_stop`.
- `disconnect`: a stream dropped after 0-5 events (OpenAI or Anthropic), or a non-streamed request dropped
  after 0-0.3 s.
- `bad`: one malformed request (invalid JSON, wrong types, out-of-range and float32-underflowing sampling
  values, an out-of-vocab prompt id, a context overflow, a lone surrogate, 10,000-deep nesting, a 5,000-digit
  number, a text/plain body, an unknown route, a wrong method): it must be answered 4xx.
- `raw`: a socket that sends part of a request head, or a head promising more body than it sends, then closes.
- the hostile-but-valid kinds of `soak_hostile` (issue 42; off with `--no-hostile`): big logprob replies and one
  over `--max-reply-bytes`, prompts far past the context on every route, embeddings (some abandoned), salted
  requests under two API keys, slow readers on a 4 KiB window, CL+TE and 64 KB-head framing attacks.

Meanwhile a prober GETs /health every 0.1 s: its worst and p99 latency are reported (the event loop's stalls), and
the process's RSS (the server runs in it) before, after and at its peak.

A *server error* is a 5xx, an error event inside a stream, a stream that ended without its final event, a
transport error on a request not dropped on purpose, a good request refused with a 4xx (429/529 "busy" are
counted apart and allowed), or an ERROR record logged by uvicorn or astrai. After the deadline the engine must
go idle with no KV page held by a request (`kv_pages_used == 0`), the pool and radix must pass their checks,
`radix.reset()` must leave every page free, and one more normal request must succeed. The server takes two API
keys and salts the prefix cache by key (`--cache-salt-by-api-key`), serves embeddings, and aborts a stream whose
client stopped reading after `--stream-stall-timeout` seconds.

Prints a rich table (one row per action) and the JSON report as the last stdout line; exits 1 when a check
failed (the failures go to stderr). `--smoke` runs 8 streams for 4 seconds on a 512-token KV pool (CI).
Usage: python benchmarks/bench_soak.py [--streams 64] [--duration 60] [--kv-budget-tokens 2048] [--seed 0]
       [--no-hostile] [--max-reply-bytes 4194304] [--stream-stall-timeout 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import soak_hostile
from bench_serve import CORPUS, build_model, serve_in_thread

RESULTS = Path(__file__).resolve().parent / "results" / "bench_soak.json"
WORDS = " ".join(CORPUS).split()
CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
JSON = {"Content-Type": "application/json"}
HI = [{"role": "user", "content": "hi"}]
BAD = [  # (method, path, httpx keyword arguments): every one must get a 4xx
    ("POST", CHAT, {"content": b"{not json", "headers": JSON}),
    ("POST", CHAT, {"content": b"[1, 2]", "headers": JSON}),
    ("POST", CHAT, {"json": {"messages": HI, "temperature": "hot"}}),
    ("POST", CHAT, {"json": {"messages": HI, "temperature": 5}}),
    ("POST", CHAT, {"json": {"messages": HI, "repetition_penalty": 5e-324}}),
    ("POST", CHAT, {"json": {"messages": HI, "frequency_penalty": 1e-45}}),
    ("POST", CHAT, {"json": {"messages": HI, "logit_bias": {"abc": 1}}}),
    ("POST", CHAT, {"json": {"messages": HI, "n": 0}}),
    ("POST", CHAT, {"json": {"messages": HI, "max_tokens": 10**6}}),
    ("POST", CHAT, {"json": {"messages": "hi"}}),
    ("POST", CHAT, {"json": {"model": "bench"}}),
    ("POST", CHAT, {"json": {"messages": HI, "stream": "yes"}}),
    ("POST", CHAT, {"content": b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "headers": JSON}),
    ("POST", CHAT, {"content": b'{"messages": ' + b"[" * 10000 + b"]" * 10000 + b"}", "headers": JSON}),
    ("POST", CHAT, {"content": b'{"max_tokens": ' + b"9" * 5000 + b', "messages": []}', "headers": JSON}),
    ("POST", CHAT, {"content": b'{"messages": []}', "headers": {"Content-Type": "text/plain"}}),
    ("POST", COMPLETIONS, {"json": {"prompt": [10**9]}}),
    ("POST", COMPLETIONS, {"json": {"prompt": []}}),
    ("POST", MESSAGES, {"json": {"max_tokens": 5, "messages": HI, "temperature": 3}}),
    ("POST", MESSAGES, {"json": {"messages": HI}}),
    ("POST", "/v1/nope", {"json": {}}),
    ("GET", CHAT, {}),
]


class Tally:
    """Per-action counts, response statuses, and the server errors seen (the first 20 described)."""

    def __init__(self, actions: list[str]) -> None:
        keys = ("requests", "ok", "4xx", "5xx", "busy", "dropped", "tokens", "errors", "worst_s")
        self.rows = {a: {"action": a, **dict.fromkeys(keys, 0)} for a in actions}
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []
        self.bad_accepted = 0

    def fail(self, action: str, what: str) -> None:
        """Record a server error."""
        self.rows[action]["errors"] += 1
        if len(self.failures) < 20:
            self.failures.append(f"{action}: {what}")

    def response(self, action: str, status: int, *, good: bool = True) -> bool:
        """Record a response status; True when it is a 2xx (a good request's 4xx is a server error)."""
        row = self.rows[action]
        row["requests"] += 1
        self.statuses[status] += 1
        if 200 <= status < 300:
            row["ok"] += 1
            return True
        if status in (429, 529):
            row["busy"] += 1
        elif status >= 500:
            row["5xx"] += 1
            self.fail(action, f"HTTP {status}")
        else:
            row["4xx"] += 1
            if good:
                self.fail(action, f"a valid request was refused with HTTP {status}")
        return False

    @property
    def server_errors(self) -> int:
        return sum(row["errors"] for row in self.rows.values())


class Soak:
    """What every worker shares: the client, the server's address, the vocabulary size, the tally, the deadline."""

    def __init__(self, client: httpx.AsyncClient, port: int, vocab: int, deadline: float, actions: dict) -> None:
        self.client, self.port, self.vocab, self.deadline = client, port, vocab, deadline
        self.actions = actions  # name: (coroutine, weight)
        self.tally = Tally([*actions, "health"])
        self.final_ok = False  # the normal request sent after the soak succeeded
        self.health: list[float] = []  # /health latencies (s)


def words(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))


def openai_body(rng: random.Random, vocab: int, *, stream: bool) -> tuple[str, dict, int]:
    """(path, body, n) of a valid random OpenAI request."""
    n = rng.choice([1, 1, 1, 2])
    body = {"model": "bench", "max_tokens": rng.randint(1, 24), "n": n, "stream": stream,
            "temperature": rng.choice([0, 0.7, 1.0, 1e-39]), "top_p": rng.choice([1.0, 0.9]),
            "seed": rng.randrange(1 << 31), "ignore_eos": rng.random() < 0.5}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.3:
        body.update(frequency_penalty=rng.uniform(-1, 1), repetition_penalty=rng.uniform(0.8, 1.5))
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": words(rng)}]
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        return CHAT, body, n
    ids = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 40))]
    body["prompt"] = words(rng) if rng.random() < 0.5 else ids
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 3)
    return COMPLETIONS, body, n


def anthropic_body(rng: random.Random) -> tuple[str, dict, int]:
    body = {"model": "bench", "max_tokens": rng.randint(1, 24), "stream": True, "temperature": rng.choice([0.0, 1.0]),
            "messages": [{"role": "user", "content": words(rng)}]}  # fmt: skip
    return MESSAGES, body, 1


async def sse(response: httpx.Response):
    """(event name or None, data) of each server-sent event."""
    event = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, line[6:]
            event = None


async def stream(ctx: Soak, action: str, path: str, body: dict, n: int, cut: int | None = None) -> None:
    """A streamed OpenAI or Anthropic request read to its final event (or dropped after `cut` events)."""
    finished, seen, row = set(), 0, ctx.tally.rows[action]
    async with ctx.client.stream("POST", path, json=body) as response:
        if not ctx.tally.response(action, response.status_code):
            return
        if cut == 0:  # drop right after the response head
            row["dropped"] += 1
            return
        async for event, data in sse(response):
            if data == "[DONE]" or event == "message_stop":
                if finished != set(range(n)):
                    ctx.tally.fail(action, f"{path}: final event with {sorted(finished)} of {n} choices finished")
                return
            payload = json.loads(data)
            if event == "error" or "error" in payload:
                ctx.tally.fail(action, f"{path}: error event {data[:200]}")
                return
            for choice in payload.get("choices") or ():
                if choice.get("finish_reason"):
                    finished.add(choice["index"])
            usage = payload.get("usage") or {}
            row["tokens"] += usage.get("completion_tokens", usage.get("output_tokens", 0))
            if event == "message_delta" and payload["delta"].get("stop_reason"):
                finished.add(0)
            seen += 1
            if cut is not None and seen >= cut:
                row["dropped"] += 1
                return
    ctx.tally.fail(action, f"{path}: the stream ended without its final event")


async def act_stream(ctx: Soak, rng: random.Random) -> None:
    await stream(ctx, "stream", *openai_body(rng, ctx.vocab, stream=True))


async def act_anthropic(ctx: Soak, rng: random.Random) -> None:
    await stream(ctx, "anthropic", *anthropic_body(rng))


async def act_full(ctx: Soak, rng: random.Random, *, action: str = "full", timeout: float | None = None) -> None:
    path, body, n = openai_body(rng, ctx.vocab, stream=False)
    try:
        response = await asyncio.wait_for(ctx.client.post(path, json=body), timeout)
    except TimeoutError:  # dropped on purpose: the client closes the connection mid-request
        ctx.tally.rows[action]["requests"] += 1
        ctx.tally.rows[action]["dropped"] += 1
        return
    if ctx.tally.response(action, response.status_code):
        reply = response.json()
        if len(reply["choices"]) != n or not all(c.get("finish_reason") for c in reply["choices"]):
            ctx.tally.fail(action, f"{path}: expected {n} finished choices, got {reply['choices']}")
        ctx.tally.rows[action]["tokens"] += reply["usage"]["completion_tokens"]


async def act_disconnect(ctx: Soak, rng: random.Random) -> None:
    kind = rng.random()
    if kind < 0.2:
        await act_full(ctx, rng, action="disconnect", timeout=rng.uniform(0.0, 0.3))
    else:
        path, body, n = anthropic_body(rng) if kind < 0.4 else openai_body(rng, ctx.vocab, stream=True)
        # a request that finishes before its cut counts as a completed stream
        await stream(ctx, "disconnect", path, body, n, cut=rng.randint(0, 5))


async def act_bad(ctx: Soak, rng: random.Random) -> None:
    method, path, kwargs = rng.choice(BAD)
    response = await ctx.client.request(method, path, **kwargs)
    if ctx.tally.response("bad", response.status_code, good=False):
        ctx.tally.bad_accepted += 1


async def act_raw(ctx: Soak, rng: random.Random) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", ctx.port)
    head = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{ctx.port}\r\nContent-Type: application/json\r\n"
    if rng.random() < 0.5:
        writer.write(head.encode()[: rng.randint(1, len(head))])  # part of the head
    else:
        writer.write((head + "Content-Length: 1000\r\n\r\n" + '{"messages": [').encode())  # less body than promised
    with contextlib.suppress(OSError):
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.0, 0.2))
        writer.close()
        await writer.wait_closed()
    ctx.tally.rows["raw"]["requests"] += 1
    ctx.tally.rows["raw"]["dropped"] += 1


ACTIONS = {"stream": (act_stream, 4), "full": (act_full, 2), "anthropic": (act_anthropic, 1),
           "disconnect": (act_disconnect, 2), "bad": (act_bad, 2), "raw": (act_raw, 0.5)}  # fmt: skip


async def worker(ctx: Soak, rng: random.Random) -> None:
    names, weights = list(ctx.actions), [w for _, w in ctx.actions.values()]
    while time.monotonic() < ctx.deadline:
        action = rng.choices(names, weights)[0]
        start = time.perf_counter()
        try:
            await ctx.actions[action][0](ctx, rng)
        except httpx.HTTPError as err:
            ctx.tally.fail(action, f"transport error {type(err).__name__}: {err}")
        except (ValueError, KeyError, TypeError) as err:  # JSON that is not what the API promises
            ctx.tally.fail(action, f"malformed response {type(err).__name__}: {err}")
        row = ctx.tally.rows[action]
        row["worst_s"] = max(row["worst_s"], time.perf_counter() - start)


async def load(url: str, port: int, vocab: int, args: argparse.Namespace) -> Soak:
    actions = {**ACTIONS, **(soak_hostile.HOSTILE if args.hostile else {})}
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, headers=soak_hostile.auth()) as client:
        ctx = Soak(client, port, vocab, time.monotonic() + args.duration, actions)
        workers = [worker(ctx, random.Random(args.seed * 1000 + i)) for i in range(args.streams)]
        await asyncio.gather(soak_hostile.probe_health(ctx, ctx.health), *workers)
        ctx.tally.rows["health"]["worst_s"] = max(ctx.health, default=0.0)
        final = await client.post(CHAT, json={"model": "bench", "messages": HI, "max_tokens": 4})
        ctx.final_ok = final.status_code == 200 and final.json()["choices"][0]["finish_reason"] is not None
    return ctx


class ErrorLog(logging.Handler):
    """Keeps ERROR records (uvicorn's "Exception in ASGI application", astrai.serve's 500 log)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()[:300]}")


def settle(engine, timeout: float = 60.0) -> dict:
    """Wait for the engine to go idle, check the pool and radix, reset the radix; the KV figures."""
    deadline = time.monotonic() + timeout
    while (engine.stats().running or engine.stats().waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    stats, problems = engine.stats(), []
    for part in (engine.pool, engine.radix):
        try:
            if part is not None:
                part.check()
        except AssertionError as err:
            problems.append(f"{type(part).__name__}.check: {err}")
    if engine.radix is not None:
        engine.radix.reset()
    return dict(idle=not (stats.running or stats.waiting), pages_total=stats.kv_pages_total,
                used_after=stats.kv_pages_used, cached_before_reset=stats.kv_pages_cached,
                free_after_reset=engine.pool.num_free, preemptions=stats.preemptions, steps=stats.steps,
                generated_tokens=stats.generated_tokens, problems=problems)  # fmt: skip


def health_summary(latencies: list[float]) -> dict:
    """The /health prober's probes and latency percentiles, ms."""
    ordered = sorted(latencies) or [0.0]
    pick = lambda q: 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return dict(probes=len(latencies), p50_ms=pick(0.5), p99_ms=pick(0.99), worst_ms=1000 * ordered[-1])


def run(args: argparse.Namespace) -> dict:
    """Serve, soak, settle; returns the report."""
    import torch

    from astrai.inference.engine import Engine, EngineConfig
    from astrai.models.encoder import EncoderConfig

    torch.manual_seed(args.seed)
    model = build_model(args.config, args.vocab)
    engine = Engine(model, EngineConfig(compile=args.compile, kv_budget_tokens=args.kv_budget_tokens))
    server, thread, url = serve_in_thread(engine, api_key=soak_hostile.KEYS, cache_salt_by_api_key=True,
                                          embeddings=EncoderConfig(pooling="mean"),
                                          max_reply_bytes=args.max_reply_bytes,
                                          stream_stall_timeout=args.stream_stall_timeout)  # fmt: skip
    rss_start = soak_hostile.rss_mib()["rss_mib"]
    log = ErrorLog()
    for name in ("uvicorn", "astrai"):
        logging.getLogger(name).addHandler(log)
    try:
        start = time.perf_counter()
        ctx = asyncio.run(load(url, server.servers[0].sockets[0].getsockname()[1], model.config.vocab_size, args))
        wall = time.perf_counter() - start
        kv = settle(engine)
        rss = soak_hostile.rss_mib()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
    tally = ctx.tally
    errors = tally.server_errors + len(log.records)
    ok = (errors == 0 and ctx.final_ok and kv["idle"] and kv["used_after"] == 0 and not kv["problems"]
          and kv["free_after_reset"] == kv["pages_total"])  # fmt: skip
    return dict(benchmark="bench_soak", config=args.config, vocab=model.config.vocab_size, streams=args.streams,
                duration_s=args.duration, wall_s=wall, seed=args.seed, compile=args.compile,
                kv_budget_tokens=args.kv_budget_tokens, requests=sum(r["requests"] for r in tally.rows.values()),
                actions=list(tally.rows.values()), statuses={str(k): v for k, v in sorted(tally.statuses.items())},
                bad_accepted=tally.bad_accepted, server_errors=errors, failures=tally.failures + log.records[:20],
                kv=kv, final_request_ok=ctx.final_ok, hostile=args.hostile, max_reply_bytes=args.max_reply_bytes,
                stream_stall_timeout_s=args.stream_stall_timeout, health=health_summary(ctx.health),
                rss_start_mib=rss_start, rss_end_mib=rss["rss_mib"], peak_rss_mib=rss["peak_rss_mib"],
                ok=ok)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which new requests start")
    parser.add_argument("--kv-budget-tokens", type=int, default=2048, help="a small pool: preemption under load")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hostile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mix in soak_hostile's request kinds (issue 42)",
    )
    parser.add_argument("--max-reply-bytes", type=int, default=4 << 20, help="the server's --max-reply-bytes")
    parser.add_argument("--stream-stall-timeout", type=float, default=1.0, help="the server's, seconds")
    parser.add_argument("--smoke", action="store_true", help="8 streams for 4 seconds, a 512-token KV pool")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from _common import console, emit, table

    if args.smoke:
        args.vocab, args.streams, args.duration, args.kv_budget_tokens = 300, 8, 4.0, 512
    report = run(args)
    cols = [("action", ""), ("requests", ""), ("ok", ""), ("4xx", ""), ("5xx", ""), ("busy", ""), ("dropped", ""),
            ("tokens", ""), ("errors", ""), ("worst_s", ".2f")]  # fmt: skip
    kv = report["kv"]
    title = (
        f"soak: {report['streams']} streams for {report['duration_s']:.0f} s ({report['wall_s']:.1f} s wall), "
        f"{report['requests']} requests, {kv['preemptions']} preemptions; server errors {report['server_errors']}; "
        f"KV after: {kv['used_after']} pages in use, {kv['free_after_reset']}/{kv['pages_total']} free after reset; "
        f"/health worst {report['health']['worst_ms']:.0f} ms (p99 {report['health']['p99_ms']:.0f}); "
        f"RSS {report['rss_start_mib']:.0f} -> {report['rss_end_mib']:.0f} MiB (peak {report['peak_rss_mib']:.0f})"
    )
    console.print(table(title, report["actions"], cols))
    for failure in report["failures"]:
        print(failure, file=sys.stderr)
    emit(report, args.out)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""HTTP serving load test: throughput and latency through `astrai serve` vs the same engine called directly.

Method. The parent process builds the model and one `Engine` and serves it the way `astrai serve` does:
`build_app` on uvicorn through `astrai.serve.server.GracefulServer`, here on a thread. The HTTP load generator
runs in its own process, like vLLM's benchmark_serving and SGLang's bench_serving: this script re-invoked with
`--client URL` (the workload comes as JSON on stdin, the result is the last stdout line; it imports httpx, asyncio
and json, no torch), so its SSE/JSON parsing does not compete with the server's event loop and the engine thread
for the GIL. After one untimed request it keeps `--concurrency` streaming requests in flight against
/v1/completions (token-id prompts of `--prompt-len` tokens, `--new` tokens each, greedy, eos ignored so every
request produces exactly `--new` tokens; the count comes from the stream's usage chunk), and reports requests/s,
output tok/s, TTFT and inter-token latency p50/p99 and errors. The same workload then runs against the engine
in-process: asyncio tasks in the parent consume `engine.astream` (no HTTP, no second process), so the difference
is what serving costs. `--rounds` alternates the two (HTTP, direct, HTTP, ...) so drift on a shared machine hits
both, and the best round of each is compared. Every run gets its own random prompts of the same length, so none
finds another's prompts in the prefix cache. An untimed warm-up compiles the decode step first (a lone request,
since batch size 1 gets its own graph, then a full batch); `compiles` counts graphs compiled during a timed run
(should be 0) and `steps` the engine steps it took.

Torch runs `--threads` intra-op threads in the server process (default torch's own, as under `astrai serve`);
the client imports no torch. `server_cpu_s` / `client_cpu_s`: CPU seconds the server process (all its threads:
engine, torch workers, event loop) and the client process spent during each timed run. On a machine with few
cores the client still takes CPU from the server; the figures show how much.

Model: SmolLM2-135M-shaped with random weights and a locally trained tokenizer (a few hundred tokens, so the
embedding is much smaller than the real model's), fp32, compiled decode.

`--first-of-kind` measures instead what a server's first requests wait (issue 41 item 2, DESIGN fact F9): the
time from process start to the point `astrai serve` prints `serving` (model built, engine started, and with
`--warm-up`, the default, `ModelRunner.warm_up` compiling the decode batch sizes and the sampler variants), then
for each kind of request (greedy n=1, sampled n=4, penalties, a JSON-schema grammar) the TTFT of its first
request after that point vs its steady-state TTFT (the median of 3 more), one request at a time, through the
engine directly. Goal: every first-of-kind TTFT <= 2x its steady state. `--no-warm-up` shows the stalls.

Prints a rich table and the JSON report as the last stdout line. `--smoke` runs a tiny model, uncompiled, in seconds.
Usage: python benchmarks/bench_serve.py [--requests 64] [--concurrency 32] [--new 64] [--rounds 2] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:  # the server side imports these lazily: the client process stays light
    from astrai.inference.engine import Engine
    from astrai.io.model import Model
    from astrai.serve.server import GracefulServer

PROCESS_START = time.perf_counter()  # module import: before torch and the model; what `serving` is timed from
RESULTS = Path(__file__).resolve().parent / "results" / "bench_serve.json"
CORPUS = ["the quick brown fox jumps over the lazy dog " * 4, "serving many streams at once " * 4,
          "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ"] * 20  # fmt: skip


def pct(values: list[float], q: int) -> float:
    """The q-th percentile of `values` (0 when empty)."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100)[q - 1]


class Recorder:
    """TTFT, inter-token gaps and token counts of the streams of one run."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.errors = 0

    def add(self, start: float, arrivals: list[float], tokens: int) -> None:
        """One finished stream: its start time, the arrival times of its token events and its token count."""
        if arrivals:
            self.ttft.append(arrivals[0] - start)
            self.itl.extend(b - a for a, b in pairwise(arrivals))
        self.tokens += tokens

    def summary(self, name: str, wall: float, requests: int, server_cpu_s: float | None,
                client_cpu_s: float | None) -> dict:  # fmt: skip
        """The run's row: rates over `wall` seconds, latency percentiles, CPU seconds of each process."""
        return dict(target=name, requests=requests, errors=self.errors, tokens=self.tokens, wall_s=wall,
                    requests_per_s=requests / wall, output_tok_s=self.tokens / wall, ttft_p50=pct(self.ttft, 50),
                    ttft_p99=pct(self.ttft, 99), itl_p50=pct(self.itl, 50), itl_p99=pct(self.itl, 99),
                    server_cpu_s=server_cpu_s, client_cpu_s=client_cpu_s)  # fmt: skip


async def http_stream(client: httpx.AsyncClient, prompt: list[int], new: int) -> tuple[list[float], int] | None:
    """Stream one /v1/completions request: (arrival times of its token events, completion tokens), None on error."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    arrivals, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now, event = time.perf_counter(), json.loads(line[6:])
            if "error" in event:
                return None
            if event["choices"]:
                arrivals.append(now)
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return arrivals, tokens


async def load_http(base_url: str, prompts: list[list[int]], new: int, concurrency: int, warmup: list[int]) -> dict:
    """Streaming /v1/completions with `concurrency` requests in flight, after one untimed request."""
    rec, queue = Recorder(), list(reversed(prompts))

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            prompt, start = queue.pop(), time.perf_counter()
            try:
                got = await http_stream(client, prompt, new)
            except httpx.HTTPError:
                got = None
            if got is None:
                rec.errors += 1
            else:
                rec.add(start, *got)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        if await http_stream(client, warmup, 2) is None:
            raise RuntimeError("the warm-up request failed")
        cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return rec.summary("server (HTTP, SSE)", wall, len(prompts), None, cpu)  # the parent adds server_cpu_s


def client_main(url: str) -> int:
    """`--client URL`: run the HTTP load described by the JSON on stdin; print the result as the last line."""
    work = json.loads(sys.stdin.read())
    result = asyncio.run(load_http(url, work["prompts"], work["new"], work["concurrency"], work["warmup"]))
    print(json.dumps(result), flush=True)
    return 0


def http_in_subprocess(url: str, prompts: list[list[int]], new: int, concurrency: int, warmup: list[int]) -> dict:
    """Run `load_http` in a fresh interpreter (`--client URL`) while this process serves; adds the server's CPU."""
    work = json.dumps(dict(prompts=prompts, new=new, concurrency=concurrency, warmup=warmup))
    cpu = time.process_time()  # includes the client's start-up and warm-up request: a slight overestimate
    proc = subprocess.run([sys.executable, __file__, "--client", url], input=work, stdout=subprocess.PIPE, text=True)
    server_cpu = time.process_time() - cpu
    if proc.returncode != 0:
        raise RuntimeError(f"the load-generator process failed (exit {proc.returncode}); its stderr is above")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "server_cpu_s": server_cpu}


async def load_engine(engine: Engine, prompts: list[list[int]], new: int, concurrency: int) -> dict:
    """The same workload through `engine.astream`, consumed by asyncio tasks in this process."""
    from astrai.inference.params import SamplingParams

    rec, queue = Recorder(), list(reversed(prompts))
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

    async def worker() -> None:
        while queue:
            prompt, start = queue.pop(), time.perf_counter()
            arrivals, tokens = [], 0
            async for delta in engine.astream(prompt, params):
                if delta.token_ids:
                    arrivals.append(time.perf_counter())
                    tokens += len(delta.token_ids)
            rec.add(start, arrivals, tokens)

    cpu, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return rec.summary("engine (in-process)", wall, len(prompts), cpu, None)


def build_model(name: str, vocab: int) -> Model:
    """A random model of the named shape with a trained tokenizer of about `vocab` tokens."""
    import attrs

    import astrai
    from astrai.configs.models import NAMED
    from astrai.io.model import Model
    from astrai.io.templates import chatml_template
    from astrai.io.tokenizer import train_tokenizer

    tok = train_tokenizer(CORPUS, vocab_size=vocab, chat_template=chatml_template())
    cfg = attrs.evolve(NAMED[name](), vocab_size=tok.vocab_size, eos_token_id=(tok.eos_token_id,))
    return Model(config=cfg, params=astrai.init_params(cfg), tokenizer=tok, eos_token_ids=(tok.eos_token_id,))


def serve_in_thread(engine: Engine, **app_kwargs: Any) -> tuple[GracefulServer, threading.Thread, str]:
    """`astrai serve`'s server (GracefulServer around build_app with `app_kwargs`, its connection limits) on an
    ephemeral port, run on a thread."""
    from astrai.serve.app import build_app
    from astrai.serve.server import GracefulServer, server_config

    app = build_app(engine, model_name="bench", **app_kwargs)
    config = server_config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5)
    server = GracefulServer(config, engine)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def run(args: argparse.Namespace) -> dict:
    """Build the model and engine, serve it, warm up, then alternate HTTP and direct runs; returns the report."""
    import torch
    from _common import console
    from torch._dynamo.utils import counters  # graphs compiled so far: none should be compiled in timed runs

    from astrai.inference.engine import Engine, EngineConfig

    torch.set_num_threads(args.threads or torch.get_num_threads())
    torch.manual_seed(0)
    model = build_model(args.config, args.vocab)
    gen = torch.Generator().manual_seed(1)

    def prompts(n: int) -> list[list[int]]:
        """`n` fresh random prompts (fresh so that no run hits another's prefix-cache entries)."""
        return torch.randint(1, model.config.vocab_size, (n, args.prompt_len), generator=gen).tolist()

    # warm-up prompts: the client's untimed request, one alone (batch size 1 compiles its own graph), a full batch
    warm = prompts(args.concurrency + 2)
    engine = Engine(model, EngineConfig(max_running=args.concurrency, compile=args.compile,
                                        max_waiting=4 * args.requests))  # fmt: skip

    def measured(target: Callable[[list[list[int]]], dict]) -> dict:
        """`target`'s row on fresh prompts, plus the graphs compiled and the engine steps taken while it ran."""
        work, graphs, steps = prompts(args.requests), counters["stats"]["unique_graphs"], engine.stats().steps
        row = target(work)
        return {**row, "compiles": counters["stats"]["unique_graphs"] - graphs, "steps": engine.stats().steps - steps}

    rounds: dict[str, list[dict]] = {"http": [], "direct": []}
    server, thread, url = serve_in_thread(engine)
    try:
        console.print(f"[dim]warming up (compile), {torch.get_num_threads()} torch threads...[/]")
        asyncio.run(load_engine(engine, warm[1:2], 4, 1))
        asyncio.run(load_engine(engine, warm[2:], 4, args.concurrency))
        for i in range(args.rounds):
            console.print(f"[dim]round {i + 1}/{args.rounds}: {args.requests} requests, {args.concurrency} concurrent, "
                          "through HTTP (client in its own process), then the engine directly...[/]")  # fmt: skip
            rounds["http"].append(measured(lambda p: http_in_subprocess(url, p, args.new, args.concurrency, warm[0])))
            rounds["direct"].append(measured(lambda p: asyncio.run(load_engine(engine, p, args.new, args.concurrency))))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
    http, direct = (max(rows, key=lambda row: row["output_tok_s"]) for rows in rounds.values())
    if any(row["compiles"] for rows in rounds.values() for row in rows):
        console.print("[yellow]torch.compile compiled new graphs during a timed run (see `compiles`)")
    if any(row["tokens"] != args.requests * args.new for rows in rounds.values() for row in rows):
        console.print(f"[yellow]a run produced other than {args.requests * args.new} tokens (see `tokens`)")
    return dict(benchmark="bench_serve", config=args.config, vocab=model.config.vocab_size, dtype="float32",
                threads=torch.get_num_threads(), cpus=os.cpu_count(), client="separate process",
                requests=args.requests, concurrency=args.concurrency, prompt_len=args.prompt_len,
                new_tokens=args.new, compile=args.compile, rounds=args.rounds, results=[http, direct],
                output_tok_s_by_round={k: [row["output_tok_s"] for row in rows] for k, rows in rounds.items()},
                throughput_loss=1 - http["output_tok_s"] / direct["output_tok_s"])  # fmt: skip


def _ttft(engine: Engine, prompt: list[int], params) -> float:
    """Seconds from submitting `prompt` to its first streamed token (the request then runs to its end)."""
    start = time.perf_counter()
    handle = engine.submit(prompt, params)
    first = None
    for _ in handle:
        first = first or time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def first_of_kind(args: argparse.Namespace) -> dict:
    """Process start to `serving`, and each request kind's first TTFT after it vs its steady state."""
    import torch
    from _common import console
    from torch._dynamo.utils import counters

    from astrai.inference.engine import Engine, EngineConfig
    from astrai.inference.params import GrammarSpec, SamplingParams

    torch.set_num_threads(args.threads or torch.get_num_threads())
    torch.manual_seed(0)
    model = build_model(args.config, args.vocab)
    built = time.perf_counter()
    engine = Engine(model, EngineConfig(max_running=args.concurrency, compile=args.compile))
    started = time.perf_counter()
    done = engine.runner.warm_up() if args.warm_up else {}
    serving = time.perf_counter()
    engine.prepare_grammar()  # `astrai serve` builds the grammar view on a thread beside the warm-up
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    kinds = {
        "n=1": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        "n=4": SamplingParams(max_tokens=8, temperature=1.0, n=4, ignore_eos=True),
        "penalties": SamplingParams(
            max_tokens=8, temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, min_p=0.05, ignore_eos=True
        ),  # fmt: skip
        "grammar": SamplingParams(
            max_tokens=16, temperature=1.0, grammar=GrammarSpec(kind="json_schema", source=json.dumps(schema))
        ),  # fmt: skip
    }
    gen = torch.Generator().manual_seed(1)
    rows = []
    try:
        for kind, params in kinds.items():
            graphs = counters["stats"]["unique_graphs"]
            prompts = torch.randint(1, model.config.vocab_size, (4, args.prompt_len), generator=gen).tolist()
            first = _ttft(engine, prompts[0], params)
            compiles = counters["stats"]["unique_graphs"] - graphs
            steady = statistics.median(_ttft(engine, p, params) for p in prompts[1:])
            rows.append(dict(kind=kind, first_ttft_s=first, steady_ttft_s=steady, ratio=first / steady,
                             compiles_first=compiles))  # fmt: skip
            console.print(f"[dim]{kind}: first {first:.3f} s, steady {steady:.3f} s, {compiles} graphs compiled[/]")
    finally:
        engine.shutdown()
    return dict(benchmark="bench_serve.first_of_kind", config=args.config, vocab=model.config.vocab_size,
                threads=torch.get_num_threads(), cpus=os.cpu_count(), compile=args.compile, warm_up=args.warm_up,
                warmed=done, start_to_serving_s=serving - PROCESS_START, model_build_s=built - PROCESS_START,
                engine_start_s=started - built, warm_up_s=serving - started, results=rows,
                goal_met=all(row["ratio"] <= 2 for row in rows))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the server process (0: default)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating HTTP / direct runs; the best of each counts")
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, help="compiled decode (default: not in --smoke)"
    )
    parser.add_argument("--first-of-kind", action="store_true", help="start-to-serving time and first-request TTFTs")
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --first-of-kind: run the engine's warm-up before `serving` (as astrai serve)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, few requests (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # internal: the load-generator process
    args = parser.parse_args(argv)
    if args.client:
        return client_main(args.client)
    from _common import console, emit, table

    from astrai.configs.models import NAMED

    if args.config not in NAMED:
        parser.error(f"--config: choose from {', '.join(sorted(NAMED))}")
    if args.smoke:
        args.config, args.vocab, args.requests, args.concurrency, args.prompt_len, args.new = "tiny", 300, 8, 4, 8, 8
    if args.compile is None:  # compiling takes the smoke most of a minute on a cold cache
        args.compile = not args.smoke
    if args.first_of_kind:
        report = first_of_kind(args)
        cols = [("kind", ""), ("first_ttft_s", ".3f"), ("steady_ttft_s", ".3f"), ("ratio", ".1f"),
                ("compiles_first", "")]  # fmt: skip
        title = (f"{report['config']}: process start to serving {report['start_to_serving_s']:.1f} s "
                 f"(warm-up {report['warm_up_s']:.1f} s); first-of-kind TTFT vs steady state")  # fmt: skip
        console.print(table(title, report["results"], cols))
        emit(report, args.out.with_name("bench_serve_first_of_kind.json") if args.out == RESULTS else args.out)
        return 0
    report = run(args)
    cols = [("target", ""), ("errors", ""), ("output_tok_s", ".1f"),
            ("ttft_p50", ".3f"), ("ttft_p99", ".3f"), ("itl_p50", ".4f"), ("itl_p99", ".4f"),
            ("steps", ""), ("server_cpu_s", ".1f"), ("client_cpu_s", ".1f"), ("compiles", "")]  # fmt: skip
    title = (
        f"{report['requests']} requests, {report['concurrency']} concurrent streams, "
        f"{report['prompt_len']}-token prompts, {report['new_tokens']} new tokens, "
        f"{report['threads']} torch threads on {report['cpus']} CPUs, "
        f"client in its own process, best of {report['rounds']} rounds: "
        f"server throughput loss {report['throughput_loss']:.1%}"
    )
    console.print(table(title, report["results"], cols))
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""HTTP serving load test: throughput and latency through `astrai serve` vs the same engine called directly.

An async load generator (httpx) keeps `--concurrency` streaming requests in flight against /v1/completions
(token-id prompts of `--prompt-len` tokens, `--new` tokens each, greedy, eos ignored so every request produces
exactly `--new` tokens), and reports requests/s, output tok/s, TTFT and inter-token latency p50/p99 and errors.
The same workload then runs against the engine in-process (asyncio streams, no HTTP), so the server's overhead
is measured side by side on the same engine. Model: SmolLM2-135M-shaped with random weights and a locally
trained tokenizer (vocabulary 4096, so the embedding is smaller than the real model's), fp32, compiled decode.

Prints rich tables and the JSON report as the last stdout line. `--smoke` runs a tiny model in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import attrs
import httpx
import torch
import uvicorn
from _common import console, emit, table

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.io.model import Model
from astrai.io.templates import chatml_template
from astrai.io.tokenizer import train_tokenizer
from astrai.serve.app import build_app
from configs.models import NAMED

RESULTS = Path(__file__).resolve().parent / "results" / "bench_serve.json"
CORPUS = ["the quick brown fox jumps over the lazy dog " * 4, "serving many streams at once " * 4,
          "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ"] * 20  # fmt: skip


def build_model(name: str, vocab: int) -> Model:
    """A random model of the named shape with a trained tokenizer of about `vocab` tokens."""
    tok = train_tokenizer(CORPUS, vocab_size=vocab, chat_template=chatml_template())
    cfg = attrs.evolve(NAMED[name](), vocab_size=tok.vocab_size, eos_token_id=(tok.eos_token_id,))
    return Model(config=cfg, params=astrai.init_params(cfg), tokenizer=tok, eos_token_ids=(tok.eos_token_id,))


def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100)[q - 1]


def summarize(name: str, wall: float, ttft: list[float], itl: list[float], tokens: int, requests: int,
              errors: int) -> dict:  # fmt: skip
    return dict(target=name, requests=requests, errors=errors, wall_s=wall, requests_per_s=requests / wall,
                output_tok_s=tokens / wall, ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99), itl_p50=pct(itl, 50),
                itl_p99=pct(itl, 99))  # fmt: skip


async def load_http(base_url: str, prompts: list[list[int]], new: int, concurrency: int) -> dict:
    """Streaming /v1/completions with `concurrency` clients in flight."""
    ttft, itl, tokens, errors = [], [], 0, 0
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            start = last = time.perf_counter()
            first = True
            try:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        errors += 1
                        continue
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        if json.loads(line[6:])["choices"][0].get("text") is None:
                            continue
                        now = time.perf_counter()
                        (ttft.append(now - start) if first else itl.append(now - last))
                        first, last = False, now
                        tokens += 1
            except httpx.HTTPError:
                errors += 1

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
    return summarize("server (HTTP, SSE)", time.perf_counter() - start, ttft, itl, tokens, len(prompts), errors)


async def load_engine(engine: Engine, prompts: list[list[int]], new: int, concurrency: int) -> dict:
    """The same workload through `engine.astream` in-process."""
    ttft, itl, tokens = [], [], 0
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

    async def worker() -> None:
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            start = last = time.perf_counter()
            first = True
            async for delta in engine.astream(prompt, params):
                if delta.token_ids:
                    now = time.perf_counter()
                    (ttft.append(now - start) if first else itl.append(now - last))
                    first, last = False, now
                    tokens += len(delta.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize("engine (in-process)", time.perf_counter() - start, ttft, itl, tokens, len(prompts), 0)


def serve_in_thread(engine: Engine) -> tuple[uvicorn.Server, str]:
    server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name="bench"), host="127.0.0.1", port=0,
                                           log_level="warning"))  # fmt: skip
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def run(args) -> dict:
    torch.manual_seed(0)
    model = build_model(args.config, args.vocab)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, model.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.requests)]  # fmt: skip
    engine = Engine(model, EngineConfig(max_running=args.concurrency, compile=True, max_waiting=4 * args.requests))
    server, url = serve_in_thread(engine)
    try:
        console.print("[dim]warming up (compile)...[/]")
        asyncio.run(load_engine(engine, prompts[: args.concurrency], 4, args.concurrency))
        console.print(f"[dim]{args.requests} requests, {args.concurrency} concurrent, through HTTP...[/]")
        http = asyncio.run(load_http(url, prompts, args.new, args.concurrency))
        console.print("[dim]the same through the engine directly...[/]")
        direct = asyncio.run(load_engine(engine, prompts, args.new, args.concurrency))
    finally:
        server.should_exit = True
    overhead = 1 - http["output_tok_s"] / direct["output_tok_s"]
    return dict(benchmark="bench_serve", config=args.config, vocab=model.config.vocab_size, dtype="float32",
                threads=torch.get_num_threads(), concurrency=args.concurrency, prompt_len=args.prompt_len,
                new_tokens=args.new, results=[http, direct], throughput_loss=overhead)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="tiny model, few requests (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.vocab, args.requests, args.concurrency, args.prompt_len, args.new = "tiny", 300, 8, 4, 8, 8
    report = run(args)
    cols = [("target", ""), ("requests", ""), ("errors", ""), ("requests_per_s", ".2f"), ("output_tok_s", ".1f"),
            ("ttft_p50", ".3f"), ("ttft_p99", ".3f"), ("itl_p50", ".4f"), ("itl_p99", ".4f")]  # fmt: skip
    title = (
        f"{report['concurrency']} concurrent streams, {report['prompt_len']}-token prompts, "
        f"{report['new_tokens']} new tokens: server throughput loss {report['throughput_loss']:.1%}"
    )
    console.print(table(title, report["results"], cols))
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`astrai serve --async-scheduling` (the overlap schedule) through the real HTTP interface: concurrent streaming
clients get the tokens the engine gives without overlap, and a client that disconnects mid-stream frees its KV."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest
import uvicorn

import astrai
from astrai.cli._common import parse
from astrai.cli.serve import ServeConfig, engine_config
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.serve.app import build_app
from helpers import tiny_model_dir

PROMPTS = ["hello there", "the cat sat", "a b c d e f", "once upon a time", "x", "numbers 1 2 3"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("m")))


@pytest.fixture(scope="module")
def overlap_server(model):
    cfg = engine_config(parse(ServeConfig, ["m", "--async-scheduling", "--no-compile", "--kv-budget", "4096"]))
    assert cfg.overlap_schedule
    engine = Engine(model, cfg)
    uv = uvicorn.Server(uvicorn.Config(build_app(engine, model_name="m"), host="127.0.0.1", port=0,
                                       log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}", engine
    uv.should_exit = True
    with contextlib.suppress(Exception):
        thread.join(timeout=10)
    engine.shutdown()


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, str]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    text, reason = "", None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                text, reason = text + choice["text"], choice.get("finish_reason") or reason
    return text, reason


def test_concurrent_streams_match_the_engine_without_overlap(model, overlap_server):
    url, _ = overlap_server
    lengths = [5, 17, 9, 30, 2, 12]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(_stream(client, p, n) for p, n in zip(PROMPTS, lengths, strict=True)))

    got = asyncio.run(main())
    with Engine(model, EngineConfig(compile=False, kv_budget_tokens=4096, background=False)) as plain:
        want = [plain.generate([p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
                for p, n in zip(PROMPTS, lengths, strict=True)]  # fmt: skip
    assert got == [(c.outputs[0].text, "length") for c in want]


def test_disconnect_mid_stream_frees_kv(overlap_server):
    url, engine = overlap_server
    body = {"model": "m", "prompt": "hello", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    before = engine.stats().generated_tokens
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 8:
                break  # the client goes away while steps are queued ahead
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (engine.stats().running or engine.stats().waiting):
        time.sleep(0.02)
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kv_pages_used == 0
    assert stats.generated_tokens - before < 1000  # not vacuous: the request was cut short, not finished
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200

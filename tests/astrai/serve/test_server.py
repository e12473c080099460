"""Server-wide behaviour: health, models, metrics, auth, body limit, busy mapping, 64 concurrent streams, and
graceful shutdown freeing the KV."""

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn

import astrai
from astrai.inference.engine import Engine, EngineBusyError, EngineConfig
from astrai.serve.app import build_app
from astrai.serve.common import APIError, submit
from astrai.serve.server import GracefulServer
from helpers import tiny_model_dir

AUTH = {"Authorization": "Bearer test-key"}


def test_health_models_and_auth(server):
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = httpx.get(f"{server.base_url}/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-test"
    missing = httpx.get(f"{server.base_url}/v1/models")
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    wrong = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": "nope"})
    assert wrong.status_code == 401
    assert httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": "test-key"}).status_code == 200


def test_body_limit_is_413_in_the_api_shape(server):
    big = json.dumps({"model": "x", "messages": [{"role": "user", "content": "a" * (2 << 20)}]})
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=big,
                          headers={**AUTH, "content-type": "application/json"})  # fmt: skip
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
    anthropic = httpx.post(f"{server.base_url}/v1/messages", content=big,
                           headers={"x-api-key": "test-key", "content-type": "application/json"})  # fmt: skip
    assert anthropic.status_code == 413 and anthropic.json()["type"] == "error"


def test_metrics_count_requests_tokens_and_latency(server):
    body = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    before = httpx.get(f"{server.base_url}/metrics", headers=AUTH).text
    assert httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=AUTH).status_code == 200
    text = httpx.get(f"{server.base_url}/metrics", headers=AUTH).text

    def value(metrics: str, name: str) -> float:
        line = next((ln for ln in metrics.splitlines() if ln.startswith(name + " ")), f"{name} 0")
        return float(line.split()[-1])

    assert value(text, "astrai_generation_tokens_total") >= value(before, "astrai_generation_tokens_total") + 1
    assert value(text, "astrai_time_to_first_token_seconds_count") >= 1
    assert 'astrai_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    for gauge in ("astrai_requests_running", "astrai_kv_pages_free", "astrai_prefix_cache_hit_rate"):
        assert f"\n{gauge} " in text


def test_busy_engine_maps_to_429_and_529():
    class Busy:
        def submit(self, *args, **kwargs):
            raise EngineBusyError("64 requests are already waiting")

    async def check(status):
        with pytest.raises(APIError) as err:
            submit(Busy(), [1], astrai.inference.params.SamplingParams(), busy_status=status)
        return err.value.status

    assert asyncio.run(check(429)) == 429 and asyncio.run(check(529)) == 529


def test_64_concurrent_streams_finish_and_free_the_pool(server):
    async def one(client, i):
        body = {"model": "tiny-test", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 8,
                "stream": True, "temperature": 0.8, "seed": i}  # fmt: skip
        events = 0
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    last = line
        assert last == "data: [DONE]"
        return events

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    server.wait_idle()
    assert server.kv_in_use() == 0


def test_shutdown_ends_in_flight_streams_and_frees_kv(tmp_path):
    model = astrai.load(tiny_model_dir(tmp_path / "m"))
    engine = Engine(model, EngineConfig(compile=False, kv_budget_tokens=4096, max_running=8))
    app = build_app(engine, model_name="m")
    uv = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                       timeout_graceful_shutdown=1), engine)  # fmt: skip
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    body = {"model": "m", "prompt": "hello", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            lines.append(line)
            if len(lines) == 6:
                uv.should_exit = True  # SIGTERM-like: stop while the stream is running
    thread.join(timeout=20)
    assert not thread.is_alive()
    # the stream ended with its own error event (not cut by uvicorn's task cancellation mid-stream)
    last = json.loads([line for line in lines if line][-1].removeprefix("data: "))
    assert "shutting down" in last["error"]["message"]
    stats = engine.stats()
    assert stats.running == 0 and stats.kv_pages_used == 0

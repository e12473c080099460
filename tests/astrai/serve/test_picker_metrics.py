"""The metrics a router or endpoint picker reads (issue 45, item 3), read back through prometheus_client's parser.

The Gateway API inference extension's model-server protocol names vLLM's families: `vllm:num_requests_waiting`
(queue depth), `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before vLLM
0.10, still the default of older endpoint pickers), `vllm:cache_config_info`'s `block_size` / `num_gpu_blocks`
labels (its prefix-cache scorer), `vllm:lora_requests_info` (LoRA affinity: tests/astrai/serve/test_lora_serving.py)
and the prefix-cache counters (hit rate = hits / queries). Checked here: names, types and labels as vLLM writes
them, and values that follow the engine under load: a request running, one queued behind it (one running slot),
KV usage while they hold pages and 0 after, the hit rate of a repeated prompt.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import parser

from astrai.inference.engine import Engine, EngineConfig
from astrai.serve.app import build_app

NAME = "picked"
GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc")  # fmt: skip


def _families(text: str) -> dict:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _value(families: dict, name: str, sample: str | None = None) -> float:
    [value] = [s.value for s in families[name].samples if s.name == (sample or name)]
    return value


def test_picker_metrics_follow_the_engine(server):
    # one running slot: a second request waits; the prefix cache on, for the hit rate
    config = EngineConfig(compile=False, prefix_cache=True, max_running=1, kv_budget_tokens=4096)
    engine = Engine(server.engine.model, config)
    app = build_app(engine, model_name=NAME)
    long = {"prompt": list(range(3, 3 + 40)), "max_tokens": 400, "ignore_eos": True}

    async def run() -> tuple[dict, dict, dict, dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:

            async def metrics() -> dict:
                return _families((await client.get("/metrics")).text)

            idle = await metrics()
            requests = [asyncio.create_task(client.post("/v1/completions", json=long)) for _ in range(2)]
            async with asyncio.timeout(60):  # until one runs and the other waits behind it
                busy = await metrics()
                while (_value(busy, "vllm:num_requests_running"), _value(busy, "vllm:num_requests_waiting")) != (1, 1):
                    await asyncio.sleep(0.01)
                    busy = await metrics()
                for reply in await asyncio.gather(*requests):
                    assert reply.status_code == 200, reply.text
                after = await metrics()  # the stats may be a step stale: until the engine is idle
                while any(_value(after, name) for name in GAUGES):
                    await asyncio.sleep(0.01)
                    after = await metrics()
            assert (await client.post("/v1/completions", json={**long, "max_tokens": 1})).status_code == 200
            return idle, busy, after, await metrics()

    try:
        idle, busy, after, repeated = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        engine.shutdown()

    for name in (*GAUGES, "vllm:cache_config_info"):  # gauges, as vLLM's (its info metric is a gauge of 1 too)
        assert idle[name].type == "gauge", name
    for name in GAUGES:  # vLLM's labels: the served name and the engine index
        [sample] = idle[name].samples
        assert sample.labels == {"model_name": NAME, "engine": "0"}, name
        assert sample.value == 0.0, name
    [info] = idle["vllm:cache_config_info"].samples
    assert info.value == 1.0 and info.labels == {
        "block_size": str(config.page_size), "num_gpu_blocks": str(engine.pool.num_pages - 1),
        "enable_prefix_caching": "True", "engine": "0"}  # fmt: skip

    # under load (one running, one queued behind it): pages held, both usage names say the same
    loaded = busy
    usage = _value(loaded, "vllm:kv_cache_usage_perc")
    assert 0.0 < usage <= 1.0 and _value(loaded, "vllm:gpu_cache_usage_perc") == usage
    # done: nothing running or waiting, no page held by a request (cached prefix pages count as free, as vLLM's)
    for name in GAUGES:
        assert _value(after, name) == 0.0, name
    assert _value(after, "astrai_kv_pages_cached") > 0

    # the prefix-cache hit rate a picker computes: hits / queries, over the counters' growth
    def grew(kind: str) -> float:
        name = f"vllm:prefix_cache_{kind}"
        return _value(repeated, name, f"{name}_total") - _value(after, name, f"{name}_total")

    assert grew("queries") == 39 and grew("hits") == 32  # a repeat finds the prompt's 2 whole pages of 16
    assert repeated["vllm:prefix_cache_hits"].type == "counter"
    [hits] = repeated["vllm:prefix_cache_hits"].samples
    assert hits.labels == {"model_name": NAME, "engine": "0"}

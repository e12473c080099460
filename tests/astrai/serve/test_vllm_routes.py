"""vLLM's operational surface (issue 41, item 5): /tokenize, /detokenize, /version, /ping, `max_model_len` in the
model cards, and the `vllm:` metric families.

References: token ids and token strings from transformers' fast tokenizer over the same tokenizer.json (not
astrai's wrapper); the chat shape's ids from what the chat route really submits to the engine; metric names,
types and labels as vLLM V1 writes them (its `vllm/v1/metrics/loggers.py`), read back through
`prometheus_client`'s own parser.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import transformers
from prometheus_client import parser

from astrai.inference.engine import Engine, EngineConfig
from astrai.serve.app import build_app
from tests.astrai.serve.conftest import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXT = "Hello world, naïve café: 42 tokens?"
# vLLM V1's families (loggers.py) as prometheus_client reports them: counters without their _total suffix
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_tokenizer(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    server.tokenizer.save(folder)  # the served tokenizer.json, read by transformers itself
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))


def post(server, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=30)


def context(server) -> int:
    engine = server.engine
    return min(engine.max_model_len, (engine.pool.num_pages - 1) * engine.config.page_size)


def test_tokenize_a_prompt_as_transformers_does(server, hf_tokenizer):
    reply = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": TEXT, "return_token_strs": True}).json()
    expected = hf_tokenizer(TEXT)["input_ids"]
    assert reply["tokens"] == expected and reply["count"] == len(expected)
    assert reply["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
    assert reply["max_model_len"] == context(server)
    bare = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"] and bare["token_strs"] is None


def test_tokenize_messages_counts_what_the_chat_route_submits(server, oai, prompts):
    seen = prompts
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    reply = post(server, "/tokenize", {"messages": messages}).json()
    assert reply["tokens"] == seen[0] and reply["count"] == len(seen[0])
    other = post(server, "/tokenize", {"messages": [{"role": "user", "content": "something else"}]}).json()
    assert other["tokens"] != seen[0]  # negative control: the messages matter


def test_detokenize_round_trips(server):
    ids = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert post(server, "/detokenize", {"model": MODEL_NAME, "tokens": ids}).json() == {"prompt": TEXT}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "temperature": 1}, "temperature"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"text": "x"}, "text"),
])  # fmt: skip
def test_bad_bodies_are_400_naming_the_field(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_keys_probes_and_versions(server):
    assert post(server, "/tokenize", {"prompt": "x"}, headers=None).status_code == 401  # runs the tokenizer: keyed
    assert post(server, "/detokenize", {"tokens": [1]}, headers=None).status_code == 401
    assert httpx.get(server.base_url + "/ping").status_code == 200  # probes stay open, as /health
    assert httpx.post(server.base_url + "/ping").status_code == 200  # SageMaker's bare POST, no JSON body
    version = httpx.get(server.base_url + "/version").json()["version"]
    assert isinstance(version, str) and version
    card = httpx.get(server.base_url + "/v1/models", headers=AUTH).json()["data"][0]
    assert card["max_model_len"] == context(server) and card["id"] == card["root"] == MODEL_NAME
    assert card["parent"] is None
    assert httpx.get(f"{server.base_url}/v1/models/{MODEL_NAME}", headers=AUTH).json() == card


def _families(text: str) -> dict:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _value(fam, sample: str, **labels) -> float:
    matching = [s for s in fam.samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    [value] = [s.value for s in matching]
    return value


def test_vllm_families_parse_with_vllm_names_labels_and_values(server, oai):
    before = _families(httpx.get(server.base_url + "/metrics", headers=AUTH).text)
    reply = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": TEXT}], max_tokens=3,
                                        extra_body={"ignore_eos": True})  # fmt: skip
    after = _families(httpx.get(server.base_url + "/metrics", headers=AUTH).text)
    for name, kind in VLLM_FAMILIES.items():
        assert after[name].type == kind, name
        assert all(s.labels["model_name"] == MODEL_NAME and s.labels["engine"] == "0" for s in after[name].samples)

    def grew(name: str, sample: str, **labels) -> float:
        return _value(after[name], sample, **labels) - _value(before[name], sample, **labels)

    assert grew("vllm:generation_tokens", "vllm:generation_tokens_total") == reply.usage.completion_tokens == 3
    assert grew("vllm:prompt_tokens", "vllm:prompt_tokens_total") == reply.usage.prompt_tokens
    assert grew("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 0
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:request_generation_tokens"):  # fmt: skip
        assert grew(name, f"{name}_count") == 1, name
    assert grew("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 3
    assert 0.0 <= _value(after["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc") <= 1.0


def test_prefix_cache_counters_follow_the_radix_cache(server):
    engine = Engine(server.engine.model, EngineConfig(compile=False, prefix_cache=True, kv_budget_tokens=4096))
    app = build_app(engine, model_name="cached")
    body = {"prompt": list(range(3, 3 + 40)), "max_tokens": 1}  # 2 full pages of 16 that a repeat can reuse

    async def run() -> list[dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:
            out = []
            for _ in range(2):
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                metrics = _families((await client.get("/metrics")).text)
                out.append({k: _value(metrics[f"vllm:prefix_cache_{k}"], f"vllm:prefix_cache_{k}_total")
                            for k in ("queries", "hits")})  # fmt: skip
            return out

    try:
        first, second = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        engine.shutdown()
    # a lookup covers the prompt but its last token (whose logits must be computed), 39 tokens; whole pages of 16
    # match, so a repeat finds 2 pages = 32 tokens
    assert first == {"queries": 39, "hits": 0}  # nothing cached yet
    assert second == {"queries": 78, "hits": 32} == {"queries": engine.radix.query_tokens,
                                                     "hits": engine.radix.hit_tokens}  # fmt: skip

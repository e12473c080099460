"""Issue 18, item 2: `/metrics` is well-formed Prometheus text whatever paths clients request, its series are
bounded, and it sits behind the API key unless `metrics_public`.

`parse_exposition` is a strict checker of the text format 0.0.4 (one regex per line kind plus the family rules:
HELP and TYPE once each, before the samples; counters end in `_total`; histogram buckets cumulative up to
`+Inf` == `_count`; no duplicate series).
"""

import asyncio
import math
import re
import uuid

import httpx
import pytest

from astrai.inference.engine import EngineStats
from astrai.serve.app import build_app
from astrai.serve.metrics import OTHER, Metrics

AUTH = {"Authorization": "Bearer test-key"}
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL_VALUE = r'"(?:[^"\\\n]|\\[\\"n])*"'
LABELS = rf"\{{(?:[a-zA-Z_][a-zA-Z0-9_]*={LABEL_VALUE}(?:,[a-zA-Z_][a-zA-Z0-9_]*={LABEL_VALUE})*)?\}}"
VALUE = r"[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|Inf)|NaN"
HELP_LINE = re.compile(rf"# HELP ({NAME}) ((?:[^\\\n]|\\[\\n])*)")
TYPE_LINE = re.compile(rf"# TYPE ({NAME}) (counter|gauge|histogram|summary|untyped)")
SAMPLE_LINE = re.compile(rf"({NAME})({LABELS})? ({VALUE})(?: -?\d+)?")
PAIR = re.compile(rf"([a-zA-Z_][a-zA-Z0-9_]*)=({LABEL_VALUE})")
ROUTES = {
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
    "/version",
    "/ping",
    "/v1/responses",
    "/v1/responses/{response_id}",
    "/v1/models/{name:path}",
}
HOSTILE = "/v1/evil%22%7D%2042%0A%23%20HELP%20injected%20metric%0Ainjected_total%7Ba%3D%22"


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value[1:-1])


def _family_of(sample: str, types: dict[str, str]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        base = sample.removesuffix(suffix)
        if base != sample and types.get(base) == "histogram":
            return base
    return sample


def parse_exposition(text: str) -> dict[str, dict]:
    """Strictly parse exposition text: {family: {"type", "help", "samples": [(name, labels, value)]}}."""
    assert text.endswith("\n"), "the text must end with a newline"
    families: dict[str, dict] = {}
    seen: set[tuple] = set()
    for line in text[:-1].split("\n"):
        assert line.isprintable(), f"control character in {line!r}"
        if m := HELP_LINE.fullmatch(line):
            fam = families.setdefault(m.group(1), {"samples": []})
            assert "help" not in fam and not fam["samples"], f"HELP repeated or after samples: {line}"
            fam["help"] = m.group(2)
        elif m := TYPE_LINE.fullmatch(line):
            fam = families.setdefault(m.group(1), {"samples": []})
            assert "type" not in fam and not fam["samples"], f"TYPE repeated or after samples: {line}"
            fam["type"] = m.group(2)
        else:
            m = SAMPLE_LINE.fullmatch(line)
            assert m, f"not a valid exposition line: {line!r}"
            name, labels = m.group(1), {k: _unescape(v) for k, v in PAIR.findall(m.group(2) or "")}
            fam = families.get(_family_of(name, {k: f.get("type") for k, f in families.items()}))
            assert fam is not None and "type" in fam and "help" in fam, f"sample before its HELP/TYPE: {line}"
            key = (name, tuple(sorted(labels.items())))
            assert key not in seen, f"duplicate series {key}"
            seen.add(key)
            fam["samples"].append((name, labels, float(m.group(3).replace("Inf", "inf"))))
    for name, fam in families.items():
        assert "help" in fam and "type" in fam, name  # a family may have no samples yet
        if fam["type"] == "counter":
            assert name.endswith("_total") and all(v >= 0 for _, _, v in fam["samples"]), name
        else:
            assert not name.endswith("_total"), f"{name}: _total is for counters"
        if fam["type"] == "histogram":
            buckets = [(s[1]["le"], s[2]) for s in fam["samples"] if s[0] == f"{name}_bucket"]
            counts = [v for _, v in buckets]
            assert buckets[-1][0] == "+Inf" and counts == sorted(counts), name
            assert [v for n, _, v in fam["samples"] if n == f"{name}_count"] == [counts[-1]], name
    return families


def _endpoints(families: dict) -> set[str]:
    return {labels["endpoint"] for _, labels, _ in families["astrai_requests_total"]["samples"]}


def _metrics(base_url: str, headers: dict | None = AUTH) -> str:
    response = httpx.get(base_url + "/metrics", headers=headers, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return response.text


def test_every_family_is_typed_and_documented(server):
    families = parse_exposition(_metrics(server.base_url))
    types = {name: fam["type"] for name, fam in families.items()}
    assert types["astrai_requests_total"] == types["astrai_generation_tokens_total"] == "counter"
    assert types["astrai_preemptions_total"] == "counter" and types["astrai_kv_pages_free"] == "gauge"
    assert types["astrai_time_to_first_token_seconds"] == "histogram"
    assert types["astrai_kv_pages_capacity"] == "gauge" and "astrai_kv_pages_total" not in types


def test_a_hostile_path_cannot_forge_a_series(server):
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        assert client.get(HOSTILE).status_code == 401  # no key
        assert client.get(HOSTILE, headers=AUTH).status_code == 404
        assert client.get("/v1/%00nul%0d%0a", headers=AUTH).status_code == 404  # NUL, CR, LF in the path
        assert client.get('/a"b\\c', headers=AUTH).status_code == 404
    text = _metrics(server.base_url)
    assert "injected" not in text and "evil" not in text and "\x00" not in text and "nul" not in text
    families = parse_exposition(text)
    assert set(families) == {name for name in families if name.startswith(("astrai_", "vllm:"))}
    assert _endpoints(families) <= ROUTES | {OTHER}
    other = {labels["status"] for _, labels, _ in families["astrai_requests_total"]["samples"]
             if labels["endpoint"] == OTHER}  # fmt: skip
    assert {"401", "404"} <= other
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_random_paths_do_not_grow_the_output(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=10) as client:
        for _ in range(20):  # the (other, 404) and (other, 401) series exist after this
            client.get(f"/v1/{uuid.uuid4().hex}")
            client.get(f"/v1/{uuid.uuid4().hex}", headers={"Authorization": "Bearer nope"})
        before = parse_exposition(_metrics(server.base_url))
        size = len(_metrics(server.base_url))
        for i in range(300):
            client.get(f"/{uuid.uuid4().hex}/{i}" if i % 2 else f"/v1/{uuid.uuid4().hex}")
        after = parse_exposition(_metrics(server.base_url))
        grown = len(_metrics(server.base_url)) - size
    series = {(n, tuple(sorted(labels.items()))) for fam in after.values() for n, labels, _ in fam["samples"]}
    old = {(n, tuple(sorted(labels.items()))) for fam in before.values() for n, labels, _ in fam["samples"]}
    assert series == old and grown < 64  # only counters' digits changed


def _asgi_get(app, path: str, headers: dict | None = None) -> httpx.Response:
    # the flag's effect, checked in process (no lifespan: the session server's engine keeps running)
    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(asyncio.wait_for(get(), 30))


def test_metrics_need_the_api_key_unless_public(server):
    missing = httpx.get(server.base_url + "/metrics", timeout=10)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.base_url + "/metrics", headers={"x-api-key": "nope"}, timeout=10).status_code == 401
    parse_exposition(_metrics(server.base_url, {"x-api-key": "test-key"}))
    public = build_app(server.engine, model_name="tiny-test", api_key="test-key", metrics_public=True)
    response = _asgi_get(public, "/metrics")
    assert response.status_code == 200 and parse_exposition(response.text)
    assert _asgi_get(public, "/v1/models").status_code == 401  # only /metrics is opened
    assert _asgi_get(build_app(server.engine, model_name="tiny-test"), "/metrics").status_code == 200  # no key set


def _stats(**overrides) -> EngineStats:
    values = dict(running=1, waiting=2, kv_pages_total=10, kv_pages_used=3, kv_pages_cached=1, kv_pages_free=6,
                  prefix_hit_rate=0.25, prompt_tokens=0, generated_tokens=0, generation_tokens_per_s=0.0,
                  preemptions=4, steps=5)  # fmt: skip
    return EngineStats(**{**values, **overrides})


def test_label_values_are_escaped_and_values_spelled_for_prometheus():
    odd = 'a"b\\c\nd} 1\n# TYPE x counter'
    metrics = Metrics(endpoints=[odd, "/v1/models"])
    metrics.count_request(odd, 200)
    metrics.count_request("/v1/models", 401)
    metrics.count_request("/not/a/route", 404)
    metrics.ttft.observe(0.003)
    metrics.ttft.observe(1e9)  # past the last bucket: only +Inf counts it
    text = metrics.render(_stats(prefix_hit_rate=math.nan))
    families = parse_exposition(text)
    assert _endpoints(families) == {odd, "/v1/models", OTHER}  # round-trips through escaping
    assert "\nastrai_prefix_cache_hit_rate NaN\n" in text and "\nastrai_preemptions_total 4\n" in text
    ttft = {labels.get("le"): v for n, labels, v in families["astrai_time_to_first_token_seconds"]["samples"]
            if n.endswith("_bucket")}  # fmt: skip
    assert ttft["0.005"] == 1 and ttft["60.0"] == 1 and ttft["+Inf"] == 2


@pytest.mark.parametrize("bad", ['x{a="unterminated} 1', 'x{a="b"} one', "# TYPE x countr", "x 1\x00"])
def test_the_checker_is_strict(bad):
    assert parse_exposition("# HELP x h\n# TYPE x gauge\nx 1\n")["x"]["samples"] == [("x", {}, 1.0)]
    with pytest.raises(AssertionError):
        parse_exposition(f"# HELP x h\n# TYPE x gauge\n{bad}\n")

"""The prefix cache is not a side channel (issue 42, item 4), as a cache oracle through the real HTTP API.

Client A sends a prompt holding a secret; client B then probes two candidate prompts of the same length, the
secret one and a decoy, and reads what tells a cache hit: `usage.prompt_tokens_details.cached_tokens` (with
`enable_prompt_tokens_details`), and, as a second oracle that does not depend on what the API reports, the radix
cache's own hit counter. The positive control: without salts the oracle tells the secret from the decoy. With a
different `cache_salt`, or with `cache_salt_by_api_key` and another key, it cannot; the same salt (or the same key)
still shares the cache. By default usage does not report cached tokens at all (vLLM's default).
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.serve.app import build_app
from helpers import tiny_model_dir

KEYS = ("key-alice", "key-bob")
SECRET = "the secret code is 4711. " * 6
DECOY = "the secret code is 1234. " * 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = astrai.load(tiny_model_dir(tmp_path_factory.mktemp("salt") / "m"))
    config = EngineConfig(compile=False, kv_budget_tokens=4096, max_running=4, page_size=16, prefix_cache=True)
    with Engine(model, config) as engine:
        yield engine


class _client:  # noqa: N801 - used as `with _client(...) as client`
    """A TestClient on a fresh app over the shared engine, from an empty cache; its lifespan is not run (the app's
    shutdown would shut the module's engine down)."""

    def __init__(self, engine, **options) -> None:
        engine.radix.reset()  # every scenario starts from an empty cache
        self.client = TestClient(build_app(engine, model_name="m", api_key=KEYS, **options))

    def __enter__(self) -> TestClient:
        return self.client

    def __exit__(self, *exc) -> None:
        self.client.close()


def _ask(client, key: str, prompt: str, **fields) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, **fields}
    reply = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


def _probe(client, engine, key: str, prompt: str, **fields) -> tuple[int, int]:
    """(cached_tokens the API reports, tokens the radix cache really served) for one probe."""
    before = engine.radix.hit_tokens
    usage = _ask(client, key, prompt, **fields)
    return usage["prompt_tokens_details"]["cached_tokens"], engine.radix.hit_tokens - before


def _oracle(client, engine, victim: dict, attacker: dict) -> dict[str, tuple[int, int]]:
    _ask(client, victim.get("key", KEYS[0]), SECRET, **victim.get("fields", {}))
    key, fields = attacker.get("key", KEYS[0]), attacker.get("fields", {})
    return {"decoy": _probe(client, engine, key, DECOY, **fields), "secret": _probe(client, engine, key, SECRET,
                                                                                      **fields)}  # fmt: skip


def test_without_salts_the_oracle_tells_the_secret(engine):
    with _client(engine, enable_prompt_tokens_details=True) as client:
        seen = _oracle(client, engine, {"key": KEYS[0]}, {"key": KEYS[1]})
    assert seen["secret"][0] > seen["decoy"][0] and seen["secret"][1] > seen["decoy"][1], seen  # the leak


def test_a_different_cache_salt_hides_it_and_the_same_salt_shares(engine):
    with _client(engine, enable_prompt_tokens_details=True) as client:
        other = _oracle(client, engine, {"fields": {"cache_salt": "alice"}}, {"fields": {"cache_salt": "bob"}})
        assert other["secret"] == other["decoy"] == (0, 0), other
        engine.radix.reset()
        same = _oracle(client, engine, {"fields": {"cache_salt": "alice"}}, {"fields": {"cache_salt": "alice"}})
    assert same["secret"][0] > 0 and same["secret"][1] > 0, same  # the cache still works within a salt


def test_salting_by_api_key_separates_keys(engine):
    with _client(engine, enable_prompt_tokens_details=True, cache_salt_by_api_key=True) as client:
        other = _oracle(client, engine, {"key": KEYS[0]}, {"key": KEYS[1]})
        assert other["secret"] == other["decoy"] == (0, 0), other
        engine.radix.reset()
        same = _oracle(client, engine, {"key": KEYS[0]}, {"key": KEYS[0]})
        assert same["secret"][1] > 0, same  # one key's requests still share
        engine.radix.reset()  # a request's own salt joins the key's: bob cannot reach alice's pages with it
        joined = _oracle(client, engine, {"key": KEYS[0], "fields": {"cache_salt": "x"}},
                         {"key": KEYS[1], "fields": {"cache_salt": "x"}})  # fmt: skip
    assert joined["secret"] == (0, 0), joined


def test_cached_tokens_are_not_reported_by_default(engine):
    with _client(engine) as client:
        _ask(client, KEYS[0], SECRET)
        before = engine.radix.hit_tokens
        usage = _ask(client, KEYS[1], SECRET)
    assert "prompt_tokens_details" not in usage
    assert engine.radix.hit_tokens > before  # hidden, not isolated: salts are what isolate


@pytest.mark.parametrize("salt", ["", 5, "x" * 1025])
def test_bad_cache_salts_are_400s_naming_the_field(engine, salt):
    with _client(engine) as client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1, "cache_salt": salt},
                            headers={"Authorization": f"Bearer {KEYS[0]}"})  # fmt: skip
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_salt", reply.text


def test_salting_by_key_needs_a_key(engine):
    with pytest.raises(ValueError, match="needs an api_key"):
        build_app(engine, cache_salt_by_api_key=True)


def _route_body(route: str, prompt: str, salt: str | None) -> dict:
    fields = {} if salt is None else {"cache_salt": salt}
    if route == "/v1/responses":
        return {"model": "m", "input": prompt, "max_output_tokens": 16, "temperature": 0, **fields}
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0,
            **fields}  # fmt: skip


def _radix_hits(client, engine, route: str, key: str, prompt: str, salt: str | None = None) -> int:
    before = engine.radix.hit_tokens
    reply = client.post(route, json=_route_body(route, prompt, salt),
                        headers={"Authorization": f"Bearer {key}", "x-api-key": key})  # fmt: skip
    assert reply.status_code == 200, reply.text
    return engine.radix.hit_tokens - before


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_every_generating_route_is_salted_by_key(engine, route):
    with _client(engine, cache_salt_by_api_key=True) as client:
        _radix_hits(client, engine, route, KEYS[0], SECRET)
        assert _radix_hits(client, engine, route, KEYS[1], SECRET) == 0  # another key: no page shared
        assert _radix_hits(client, engine, route, KEYS[0], SECRET) > 0  # the same key: shared (positive control)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_chat_and_responses_take_a_cache_salt(engine, route):
    with _client(engine) as client:
        _radix_hits(client, engine, route, KEYS[0], SECRET, salt="alice")
        assert _radix_hits(client, engine, route, KEYS[1], SECRET, salt="bob") == 0
        assert _radix_hits(client, engine, route, KEYS[1], SECRET) == 0  # unsalted cannot reach salted pages
        assert _radix_hits(client, engine, route, KEYS[1], SECRET, salt="alice") > 0  # the same salt shares

"""`astrai serve` workers behind SGLang's router (issue 45, item 2): the multi-machine shape on one machine.

Two workers started separately on 127.0.0.1 (each one `astrai serve` process with an API key) behind the real
router process (`python -m sglang_router.launch_router`, the `sglang-router` wheel), under its `cache_aware`,
`round_robin` and `power_of_two` (which reads each worker's /get_load) policies: the openai SDK's models, chat,
streaming, forced tool calls and completions work through it; the router's own calls reach astrai's worker
endpoints (`router_api`: model info, loads, cache flush); then one worker is SIGKILLed while requests run on it:
every non-streaming request (in flight on it or sent later) is answered through the router's retries by the other
worker, streams already relaying from the dead one end (an error, never a hang), and the other keeps serving.
Every worker's KV pool is free at the end (/metrics: nothing running or waiting, no page held by a request). Every
wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import parser

from helpers import tiny_model_dir
from tests.astrai.cli.test_cli import _ServeProcess

try:
    import sglang_router  # noqa: F401  (the router's launcher; its Rust binary ships in the wheel)
except ImportError:
    pytest.skip("sglang-router is not installed (`pip install sglang-router`, in the dev extra): these tests run "
                "the real router process", allow_module_level=True)  # fmt: skip

KEY = "router-test-key"
NAME = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
# bounded arguments, so that the grammar closes the call within the budget (the tiny tokenizer's tokens are short)
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
BUDGET = 400
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Router:
    """sglang-router in a subprocess over `urls`, waited for until it counts every worker healthy; SIGTERM on exit.

    Health checks every second, one failure marks a worker unhealthy (the defaults, 60 s and 3, are for production),
    short shutdown grace; its log goes to `log`."""

    def __init__(self, urls: list[str], policy: str, log: Path) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.urls, self.log = urls, log
        self.argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                     str(self.port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
                     "--policy", policy, "--api-key", KEY, "--worker-urls", *urls, "--health-check-interval-secs",
                     "1", "--health-failure-threshold", "1", "--shutdown-grace-period-secs", "1", "--log-level",
                     "warn"]  # fmt: skip

    def __enter__(self) -> _Router:
        self.out = open(self.log, "w")  # noqa: SIM115  (closed in __exit__)
        self.proc = subprocess.Popen(self.argv, stdout=self.out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ready = httpx.get(f"{self.base_url}/readiness", timeout=1)
                if ready.status_code == 200 and ready.json().get("healthy_workers") == len(self.urls):
                    return self
            assert self.proc.poll() is None, f"the router exited: {self.log.read_text()[-3000:]}"
            time.sleep(0.2)
        self.__exit__()
        raise AssertionError(f"the router did not count {len(self.urls)} healthy workers in 30 s: "
                             f"{self.log.read_text()[-3000:]}")  # fmt: skip

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.out.close()


def _start_workers(model_dir: str, n: int, stack: contextlib.ExitStack) -> list[_ServeProcess]:
    """`n` workers started at once (each its own `astrai serve`), all answering /health."""
    workers = [_ServeProcess(model_dir, "--api-key", KEY, "--served-model-name", NAME) for _ in range(n)]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda w: stack.enter_context(w), workers))
    for w in workers:
        assert httpx.get(f"{w.base_url}/health", timeout=5).status_code == 200, w.proc.poll()
    return workers


def _families(worker: _ServeProcess) -> dict:
    text = httpx.get(f"{worker.base_url}/metrics", headers=AUTH, timeout=5).text
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _value(families: dict, name: str) -> float:
    return sum(s.value for s in families[name].samples)


def _assert_kv_free(workers: list[_ServeProcess]) -> None:
    """Each worker's pool holds no page for a request (cached prefix pages may stay) and nothing runs or waits,
    within 10 s (a stream's last step may still be finishing)."""
    for w in workers:
        deadline = time.monotonic() + 10
        while True:
            fam = _families(w)
            busy = {n: _value(fam, n) for n in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                  "astrai_kv_pages_used")}  # fmt: skip
            health = httpx.get(f"{w.base_url}/health", timeout=5).json()
            if not any(busy.values()) and health["running"] == health["waiting"] == 0:
                assert _value(fam, "vllm:kv_cache_usage_perc") == 0.0
                break
            assert time.monotonic() < deadline, f"worker {w.base_url} still busy: {busy}, {health}"
            time.sleep(0.1)


def _generated(worker: _ServeProcess) -> float:
    return _value(_families(worker), "astrai_generation_tokens")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("router") / "m")


@pytest.fixture(scope="module")
def workers(model_dir):
    with contextlib.ExitStack() as stack:
        yield _start_workers(model_dir, 2, stack)


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "power_of_two"])  # power of two: /get_load
def test_openai_sdk_through_the_router(workers, policy, tmp_path):
    import openai

    with _Router([w.base_url for w in workers], policy, tmp_path / "router.log") as router:
        client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key=KEY, max_retries=0, timeout=30)
        # the worker's served name became the router's model id (astrai's /server_info)
        assert [m.id for m in client.models.list().data] == [NAME]
        before = [_generated(w) for w in workers]

        chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello world"}],
                                              max_tokens=8, temperature=0)  # fmt: skip
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 8
        assert isinstance(chat.choices[0].message.content, str)

        chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "the fox"}],
                                                     max_tokens=6, stream=True,
                                                     stream_options={"include_usage": True}))  # fmt: skip
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
        assert 0 < chunks[-1].usage.completion_tokens <= 6 and not chunks[-1].choices  # the usage chunk, last

        # a forced tool call: the arguments are grammar-constrained, so they parse whatever the random model says
        tool = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "weather in Oslo?"}],
                                              tools=[WEATHER], tool_choice=FORCED, max_tokens=BUDGET,
                                              parallel_tool_calls=False)  # fmt: skip
        (call,) = tool.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
        assert tool.choices[0].finish_reason == "tool_calls"
        streamed = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "and Rome?"}],
                                                  tools=[WEATHER], tool_choice=FORCED, max_tokens=BUDGET,
                                                  parallel_tool_calls=False, stream=True)  # fmt: skip
        calls: dict[int, list[str]] = {}  # index -> [name, arguments], from the deltas
        for chunk in streamed:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += (delta.function.name or "") if delta.function else ""
                call[1] += (delta.function.arguments or "") if delta.function else ""
        (name, arguments), *more = calls.values()  # parallel_tool_calls false: exactly one
        assert name == "get_weather" and isinstance(json.loads(arguments), dict) and not more, calls

        text = client.completions.create(model=NAME, prompt="hello", max_tokens=4, temperature=0)
        assert text.choices[0].finish_reason in ("stop", "length") and text.usage.completion_tokens <= 4

        # concurrent chats with different prompts: round robin alternates, so both workers generate
        prompts = ["hello world", "the quick brown fox", "lazy dog", "a tiny corpus", "jumps over", "brown dog"]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda p: client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": p}], max_tokens=4), prompts))  # fmt: skip
        assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
        grew = [_generated(w) - b for w, b in zip(workers, before, strict=True)]
        assert sum(grew) > 0 and (policy != "round_robin" or all(g > 0 for g in grew)), grew
    _assert_kv_free(workers)


def test_the_routers_own_calls_reach_the_workers(workers, tmp_path):
    with _Router([w.base_url for w in workers], "round_robin", tmp_path / "router.log") as router:
        loads = httpx.get(f"{router.base_url}/get_loads", headers=AUTH, timeout=10).json()["workers"]
        assert sorted(x["worker"] for x in loads) == sorted(w.base_url for w in workers)
        assert all(x["load"] == 0 for x in loads), loads  # astrai's /get_load: KV tokens held (idle: 0), not -1
        flushed = httpx.post(f"{router.base_url}/flush_cache", headers=AUTH, timeout=10).json()
        assert flushed["status"] == "success" and flushed["workers_flushed"] == 2, flushed
        # the router asks clients for its --api-key on generation routes (its /v1/models it answers to anyone)
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{router.base_url}/v1/chat/completions", json=body, timeout=10).status_code == 401


def test_worker_endpoints_follow_the_key_rules(workers):
    url = workers[0].base_url
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load", "/v1/loads"):
        assert httpx.get(url + path, timeout=5).status_code == 401, path
    assert httpx.post(f"{url}/flush_cache", timeout=5).status_code == 401  # keyed although bodiless
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # open: the router's health check sends no key
    info = httpx.get(f"{url}/server_info", headers=AUTH, timeout=5).json()
    assert info["served_model_name"] == NAME and info["dp_size"] == 1 and info["max_total_tokens"] > 0
    assert "model_path" not in info  # else the router would try to load a tokenizer from it
    assert httpx.get(f"{url}/get_model_info", headers=AUTH, timeout=5).json()["is_generation"] is True
    (load,) = httpx.get(f"{url}/get_load", headers=AUTH, timeout=5).json()
    assert load == {**load, "dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert httpx.get(f"{url}/v1/loads", headers=AUTH, timeout=5).json()["loads"][0]["num_used_tokens"] == 0
    # a bodiless POST without a content type (as the router sends it) is taken; GET is not a flush
    assert httpx.post(f"{url}/flush_cache", headers=AUTH, timeout=10).json()["flushed"] is True
    assert httpx.get(f"{url}/flush_cache", headers=AUTH, timeout=5).status_code == 405
    # the routers' fields: defaults folded away, no_stop_trim mapped, the rest refused by name
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "no_stop_trim": True,
            "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
            "include_reasoning": True}  # fmt: skip
    post = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert post.status_code == 200, post.text
    for field, value in (("stream_reasoning", False), ("return_hidden_states", True), ("separate_reasoning", False),
                         ("no_stop_trim", "yes"), ("include_reasoning", False)):  # fmt: skip
        refused = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "hi", field: value},
                             headers=AUTH, timeout=30)  # fmt: skip
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


def test_killing_a_worker_mid_load(model_dir, tmp_path):
    import openai

    with contextlib.ExitStack() as stack:
        doomed, survivor = _start_workers(model_dir, 2, stack)
        router = stack.enter_context(_Router([doomed.base_url, survivor.base_url], "round_robin",
                                             tmp_path / "router.log"))  # fmt: skip
        client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key=KEY, max_retries=0, timeout=30)

        def chat(i: int) -> str:
            messages = [{"role": "user", "content": f"n {i}"}]
            reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=48, temperature=0,
                                                   extra_body={"ignore_eos": True})  # fmt: skip
            return reply.choices[0].finish_reason

        def stream(i: int) -> str:  # a stream relaying when its worker dies cannot be retried: it must end
            try:
                chunks = list(client.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": f"s {i}"}], max_tokens=48, stream=True,
                    extra_body={"ignore_eos": True}))  # fmt: skip
                return [c.choices[0].finish_reason for c in chunks if c.choices][-1] or "none"
            except (openai.APIError, httpx.HTTPError) as err:
                return f"error: {type(err).__name__}"

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            started = time.monotonic()
            streams = [pool.submit(stream, i) for i in range(4)]  # first: round robin puts two on the doomed worker
            chats = [pool.submit(chat, i) for i in range(16)]
            deadline = time.monotonic() + 20  # kill while 3+ requests run on the doomed worker
            while httpx.get(f"{doomed.base_url}/health", timeout=5).json()["running"] < 3:
                assert time.monotonic() < deadline, "no request reached the doomed worker"
                time.sleep(0.02)
            doomed.proc.kill()
            doomed.proc.wait(timeout=10)
            later = [pool.submit(chat, 100 + i) for i in range(8)]  # sent after the kill: all retried elsewhere
            finished = [f.result(timeout=60) for f in chats + later]
            ended = [f.result(timeout=60) for f in streams]
        assert finished == ["length"] * len(finished), finished  # no retryable request lost
        assert all(e == "length" or e.startswith("error") for e in ended), ended  # streams end, never hang
        assert time.monotonic() - started < 60
        # the survivor keeps serving through the router, and the router drops the dead worker within its checks
        assert chat(999) == "length"
        deadline = time.monotonic() + 10
        while httpx.get(f"{router.base_url}/readiness", timeout=5).json().get("healthy_workers") != 1:
            assert time.monotonic() < deadline, "the router still counts the dead worker healthy"
            time.sleep(0.2)
        _assert_kv_free([survivor])

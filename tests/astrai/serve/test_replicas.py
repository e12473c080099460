"""`astrai serve --data-parallel-size 2` (issue 45, item 1): two engine processes behind one address.

One real server start (a front process and two replica processes on a tiny model): requests are spread over both
engines, greedy outputs equal one engine's (`astrai.generate`), streaming and the openai SDK work through the front,
runtime LoRA loads reach every replica, /metrics labels each engine; then one replica is killed while streams are
in flight: its requests end cleanly (an error event or a 502, never a hang), the other keeps serving, and /health
names the dead one. The routing rule and the metrics merge are checked on their own too.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

import astrai
from astrai.io.lora import save_lora
from astrai.nn.lora import LoRAConfig
from astrai.serve.replicas import Replica, ReplicaSet, merge_metrics
from helpers import random_lora, tiny_model_dir
from tests.astrai.cli.test_cli import _ServeProcess

PROMPTS = ["hello world", "the quick brown fox", "lazy dog", "this is a tiny corpus", "hello", "fox jumps"]


def test_routing_prefers_the_least_busy_live_replica():
    replicas = ReplicaSet([Replica(i, f"http://r{i}") for i in range(3)])
    replicas.replicas[0].in_flight, replicas.replicas[1].in_flight = 2, 1
    assert replicas.pick().index == 2
    replicas.replicas[2].dead = "replica 2 exited with code 9"
    assert replicas.pick().index == 1
    assert replicas.pick(exclude=[replicas.replicas[1]]).index == 0
    replicas.replicas[0].in_flight = replicas.replicas[1].in_flight = 0
    assert {replicas.pick().index for _ in range(4)} == {0, 1}  # ties rotate
    for r in replicas.replicas:
        r.dead = "gone"
    assert replicas.pick() is None


def test_metrics_merge_labels_each_engine_once_per_family():
    one = '# HELP a_total A.\n# TYPE a_total counter\na_total{route="x"} 3\na_total 1\n# TYPE g gauge\ng 0.5\n'
    two = '# HELP a_total A.\n# TYPE a_total counter\na_total{route="x"} 4\n# TYPE g gauge\ng 1.5\n'
    merged = merge_metrics([(0, one), (1, two)]).splitlines()
    assert merged.count("# HELP a_total A.") == 1 and merged.count("# TYPE g gauge") == 1
    assert 'a_total{engine="0",route="x"} 3' in merged and 'a_total{engine="0"} 1' in merged
    assert 'a_total{engine="1",route="x"} 4' in merged and 'g{engine="1"} 1.5' in merged
    assert merged.index('g{engine="0"} 0.5') > merged.index("# TYPE g gauge")  # samples follow their family


def test_metrics_merge_replaces_an_engine_label_instead_of_adding_a_second():
    vllm = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m",engine="0"} 2.0\n'
    merged = merge_metrics([(0, vllm), (1, vllm.replace("2.0", "5.0"))]).splitlines()
    assert 'vllm:num_requests_running{model_name="m",engine="0"} 2.0' in merged
    assert 'vllm:num_requests_running{model_name="m",engine="1"} 5.0' in merged
    assert not any(line.count("engine=") > 1 for line in merged)


def _unique_labels(exposition: str) -> None:
    """Every sample parses (prometheus_client's parser) and names each label once, as Prometheus requires."""
    from prometheus_client.parser import text_string_to_metric_families

    assert list(text_string_to_metric_families(exposition))
    for line in exposition.splitlines():
        if line and not line.startswith("#") and "{" in line:
            names = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', line.split("{", 1)[1].rsplit("}", 1)[0])
            assert len(names) == len(set(names)), line


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("dp") / "m")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _generated(metrics: str) -> dict[str, float]:
    """Generated tokens per engine label from the front's merged /metrics."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith("astrai_generation_tokens_total{"):
            out[line.split('engine="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the replica processes through /proc")
def test_two_replicas_behind_one_address(model_dir, tmp_path):
    import openai

    model = astrai.load(model_dir)
    cfg = LoRAConfig(r=4, alpha=8, targets="all-linear")
    adapter = save_lora(random_lora(model.params, cfg, seed=3), cfg, tmp_path / "ad")
    flags = ["--data-parallel-size", "2", "--enable-lora", "--enable-lora-runtime-updates"]
    with _ServeProcess(model_dir, *flags) as server:
        base = server.base_url
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "replicas": 2, "alive": 2, "dead": []}
        expected = astrai.generate(model, PROMPTS, max_tokens=8)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # concurrent: both replicas get some
            replies = list(pool.map(lambda p: httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": "m", "prompt": p, "max_tokens": 8, "temperature": 0}).json(), PROMPTS * 2))  # fmt: skip
        assert [r["choices"][0]["text"] for r in replies] == expected * 2
        exposition = httpx.get(f"{base}/metrics").text
        _unique_labels(exposition)
        per_engine = _generated(exposition)
        assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0, per_engine  # spread over both
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=0, stream=True)  # fmt: skip
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
        loaded = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "ad", "lora_path": str(adapter)})
        assert loaded.status_code == 200, loaded.text
        for _ in range(4):  # whichever replica takes it, the adapter is there
            assert client.completions.create(model="ad", prompt="hi", max_tokens=2).model == "ad"

        # kill replica 1 while streams run: they end cleanly, replica 0 goes on, /health names the dead one
        def stream(prompt: str) -> str:
            try:
                with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json={
                        "model": "m", "prompt": prompt, "max_tokens": 1500, "stream": True,
                        "ignore_eos": True}) as reply:  # fmt: skip
                    if reply.status_code != 200:
                        return f"status {reply.status_code}"
                    body = "".join(reply.iter_text())
            except httpx.HTTPError as err:
                return f"cut: {type(err).__name__}"
            return "error event" if '"error"' in body else "done" if "[DONE]" in body else "cut"

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, p) for p in PROMPTS[:4]]
            time.sleep(1.0)
            os.kill(_children(server.proc.pid)[0], signal.SIGKILL)
            outcomes = [f.result(timeout=90) for f in futures]
        assert "done" in outcomes and all(o in ("done", "error event", "status 502") for o in outcomes), outcomes
        assert set(outcomes) != {"done"}, "no stream was on the killed replica: the test exercised nothing"
        health = httpx.get(f"{base}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert len(health.json()["dead"]) == 1 and "code -9" in health.json()["dead"][0]["error"], health.text
        after = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 8,
                                                            "temperature": 0}, timeout=60)  # fmt: skip
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected[0]
    assert server.returncode == 0, server.out[-2000:]
    assert "serving 2 replicas" in server.out


@pytest.mark.slow  # 5 processes (a front, two replicas, one more TP rank each) on 2 cores: ~20 s
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the replica processes through /proc")
def test_each_replica_can_be_a_tensor_parallel_group(model_dir):
    """`--data-parallel-size 2 --tensor-parallel-size 2`: two replicas, each a 2-rank TP engine (its own gloo
    rendezvous, so the groups do not meet), serve one engine's greedy text, and both replicas take requests."""
    model = astrai.load(model_dir)
    expected = astrai.generate(model, PROMPTS, max_tokens=8)
    with _ServeProcess(model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2") as server:
        base = server.base_url
        assert httpx.get(f"{base}/health").json()["alive"] == 2
        replicas = _children(server.proc.pid)

        def spawned(pid: int) -> list[int]:  # torch.multiprocessing spawn children (not its resource tracker)
            cmdlines = {c: Path(f"/proc/{c}/cmdline").read_bytes() for c in _children(pid)}
            return [c for c, line in cmdlines.items() if b"spawn_main" in line]

        assert len(replicas) == 2 and all(len(spawned(r)) == 1 for r in replicas), "each replica starts its rank 1"
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda p: httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": "m", "prompt": p, "max_tokens": 8, "temperature": 0}).json(), PROMPTS * 2))  # fmt: skip
        assert [r["choices"][0]["text"] for r in replies] == expected * 2
        per_engine = _generated(httpx.get(f"{base}/metrics").text)
        assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0, per_engine
    assert server.returncode == 0, server.out[-2000:]

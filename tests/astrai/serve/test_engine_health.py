"""/health and /metrics report whether the engine can serve: 200 and `astrai_engine_up 1` while it does, 503 with the
reason and `astrai_engine_up 0` once its thread stopped after an error (an orchestrator then restarts the server).

The engine is killed by an exception injected into its step, on a server of its own (Starlette's TestClient), so
the shared test server stays alive. Before the injection the same checks read 200 / 1 (the negative control).
"""

from __future__ import annotations

import time

import pytest
from starlette.testclient import TestClient

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.serve.app import build_app
from helpers import tiny_model_dir

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
def served(tmp_path):
    model = astrai.load(tiny_model_dir(tmp_path / "m"))
    engine = Engine(model, EngineConfig(compile=False, kv_budget_tokens=2048, max_running=4))
    with TestClient(build_app(engine, model_name="m")) as client:
        yield client, engine


def _engine_up(client: TestClient) -> float:
    line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith("astrai_engine_up "))
    return float(line.split()[1])


# the engine thread re-raises what killed it (threading's excepthook prints the traceback for the operator)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_is_503_with_the_reason_once_the_engine_thread_died(served):
    client, engine = served
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and "error" not in health.json()
    assert client.post("/v1/chat/completions", json=BODY).status_code == 200
    assert _engine_up(client) == 1

    def broken(*args, **kwargs):
        raise RuntimeError("injected device failure")

    engine.runner.execute = broken  # the next step raises on the engine thread (a bug or a device error)
    reply = client.post("/v1/chat/completions", json=BODY)
    assert reply.status_code == 503 and "injected device failure" in reply.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while engine._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine._thread.is_alive()
    health = client.get("/health")
    assert health.status_code == 503, health.text
    body = health.json()
    assert body["status"] == "error" and body["model"] == "m"
    assert "injected device failure" in body["error"], body
    assert client.get("/metrics").status_code == 200 and _engine_up(client) == 0
    later = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
    assert later.status_code == 503 and later.json()["error"]["type"] == "server_error"

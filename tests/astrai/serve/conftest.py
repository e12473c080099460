"""A live uvicorn server on 127.0.0.1 serving a tiny random model (ChatML-with-tools template), shared by the
server tests.

`server.script(text)` makes the model "say" `text` (then eos): a `ScriptedRunner` replaces only the forward pass
of the engine, so scheduling, sampling bookkeeping, detokenization, stop handling and every HTTP path stay real.
`server.script(None)` goes back to the real (random) model.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import warnings

import anthropic
import openai
import pytest
import uvicorn

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.plan import SampledToken
from astrai.serve.app import build_app
from helpers import tiny_model_dir

API_KEY = "test-key"
MODEL_NAME = "tiny-test"


class ScriptedRunner:
    """Wraps a ModelRunner: with a script set, every sequence emits the script's tokens, then eos."""

    def __init__(self, runner, eos_id: int) -> None:
        self.runner, self.eos_id, self.ids = runner, eos_id, None

    def execute(self, plan, *, vocab_size):
        if self.ids is None:
            return self.runner.execute(plan, vocab_size=vocab_size)
        out = {}
        for i, item in enumerate(plan):
            if item.sample:
                n = len(item.seq.outputs)
                token = self.ids[n] if n < len(self.ids) else self.eos_id
                top = [(token, 0.0)] * item.seq.params.top_logprobs if item.seq.params.top_logprobs else None
                out[i] = SampledToken(token, 0.0 if item.seq.params.logprobs or top else None, top)
        return out


class LiveServer:
    """Handle on the running server for tests."""

    def __init__(self, app, engine: Engine, port: int, scripted: ScriptedRunner) -> None:
        self.app, self.engine, self.port, self._scripted = app, engine, port, scripted
        self.base_url = f"http://127.0.0.1:{port}"
        self.tokenizer = engine.model.tokenizer

    def script(self, text: str | None) -> None:
        """Make the model emit `text` (then eos) for every request; None: the real random model."""
        self._scripted.ids = None if text is None else self.tokenizer.encode(text, add_special_tokens=False)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no request is running or waiting (e.g. after a client disconnect)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.engine.stats()
            if stats.running == 0 and stats.waiting == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine still busy: {self.engine.stats()}")

    def kv_in_use(self) -> int:
        """KV pages held by requests (the prefix cache's pages excluded)."""
        return self.engine.stats().kv_pages_used


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    model = astrai.load(tiny_model_dir(tmp_path_factory.mktemp("served") / "m"))
    # no prefix cache: scripted requests never compute real K/V, so their pages must not be reused by real ones
    config = EngineConfig(max_running=32, max_waiting=64, compile=False, kv_budget_tokens=16384, prefix_cache=False)
    engine = Engine(model, config)
    scripted = ScriptedRunner(engine.runner, model.tokenizer.eos_token_id)
    engine.runner = scripted
    app = build_app(engine, model_name=MODEL_NAME, api_key=API_KEY, max_body_bytes=1 << 20)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    for _ in range(500):
        if uv.started:
            break
        time.sleep(0.01)
    port = uv.servers[0].sockets[0].getsockname()[1]
    live = LiveServer(app, engine, port, scripted)
    yield live
    uv.should_exit = True
    with contextlib.suppress(Exception):
        thread.join(timeout=10)


@pytest.fixture
def oai(server):
    """An openai SDK client of the live server."""
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def anth(server):
    """An anthropic SDK client of the live server."""
    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def _unscripted(request):
    # every test starts with the real model and leaves no request behind
    if "server" in request.fixturenames:
        live = request.getfixturevalue("server")
        live.script(None)
        yield
        live.script(None)
        live.wait_idle()
    else:
        yield


@pytest.fixture
def close_litellm_loop():
    """litellm's sync path leaves an event loop set (never closed) on the main thread; whichever later test replaces
    it would see its ResourceWarning when it is collected. Close it here, where it was made."""
    yield
    with warnings.catch_warnings(), contextlib.suppress(RuntimeError):  # RuntimeError: none is set
        warnings.simplefilter("ignore", DeprecationWarning)
        loop = asyncio.get_event_loop_policy().get_event_loop()
        assert not loop.is_running()
        loop.close()
        asyncio.set_event_loop(None)


@pytest.fixture
def prompts(server, monkeypatch):
    """Records the token ids of every prompt the server submits to the engine."""
    seen, submit = [], server.engine.submit

    def recording(prompt, params=None, **kw):
        seen.append(list(prompt))
        return submit(prompt, params, **kw)

    monkeypatch.setattr(server.engine, "submit", recording)
    return seen

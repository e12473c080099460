"""Multi-LoRA serving over HTTP (issue 44, the server's side): a live server on a tiny random model with two LoRA
adapters loaded at start and runtime load / unload on, under a LoRA root.

Each adapter is a PEFT folder written by `save_lora` (random A, random non-zero B, so it changes the output); the
reference for an adapter's text is `astrai.generate` on the model with that adapter merged into its weights.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import attrs
import httpx
import openai
import pytest
import torch
import uvicorn
from starlette.testclient import TestClient

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.io.lora import save_lora
from astrai.models.encoder import EncoderConfig
from astrai.nn.lora import LoRAConfig, init_lora, merge_lora
from astrai.serve.app import build_app
from helpers import tiny_model_dir

KEY = "lora-key"
BASE = "tiny-base"
ALIAS = "tiny-alias"  # another served name of the base: adapter-b's parent (vLLM's base_model_name)
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "hello world, the quick"


def _adapter(model, folder, *, r: int, targets, seed: int):
    """A random adapter (B non-zero) saved as a PEFT folder; returns its tree."""
    cfg = LoRAConfig(r=r, alpha=2 * r, targets=targets)
    lora = init_lora(model.params, cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    lora = {k: attrs.evolve(v, lora_b=torch.randn(v.lora_b.shape, generator=gen) * 0.3) for k, v in lora.items()}
    save_lora(lora, cfg, folder)
    return lora


@attrs.define
class LoRAServer:
    base_url: str
    engine: Engine
    model: astrai.Model
    adapters: dict  # name -> the adapter's tree
    root: str  # the LoRA root of runtime loads
    outside: str  # an adapter folder outside it
    app: object

    def post(self, path: str, body: dict, key: str = KEY) -> httpx.Response:
        return httpx.post(self.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    model = astrai.load(tiny_model_dir(tmp / "m"))
    root = tmp / "root"
    trees = {"adapter-a": _adapter(model, tmp / "a", r=4, targets=("all-linear",), seed=1),
             "adapter-b": _adapter(model, tmp / "b", r=8, targets=("q_proj", "v_proj"), seed=2),
             "adapter-c": _adapter(model, root / "c", r=2, targets=("all-linear",), seed=3)}  # fmt: skip
    _adapter(model, tmp / "outside", r=4, targets=("all-linear",), seed=4)
    _adapter(model, root / "wide", r=16, targets=("all-linear",), seed=5)  # above --max-lora-rank 8
    (root / "half").mkdir()
    (root / "half" / "adapter_config.json").write_text((root / "c" / "adapter_config.json").read_text())
    os.symlink(tmp / "outside", root / "link")  # a link inside the root to a folder outside it
    config = EngineConfig(enable_lora=True, max_loras=2, max_lora_rank=8, compile=False, kv_budget_tokens=8192,
                          max_running=16)  # fmt: skip
    engine = Engine(model, config)
    engine.load_lora("adapter-a", tmp / "a")
    engine.load_lora("adapter-b", tmp / "b")
    app = build_app(engine, model_name=BASE, api_key=KEY, lora_runtime_updates=True, lora_root=str(root),
                    model_aliases=[ALIAS], lora_parents={"adapter-b": ALIAS})  # fmt: skip
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    for _ in range(500):
        if uv.started:
            break
        time.sleep(0.01)
    port = uv.servers[0].sockets[0].getsockname()[1]
    yield LoRAServer(f"http://127.0.0.1:{port}", engine, model, trees, str(root), str(tmp / "outside"), app)
    uv.should_exit = True
    with contextlib.suppress(Exception):
        thread.join(timeout=10)


@pytest.fixture
def oai(lora_server):
    with openai.OpenAI(base_url=lora_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        yield client


def _merged_text(server: LoRAServer, name: str | None, prompt: str, max_tokens: int) -> str:
    model = server.model
    if name is not None:
        model = attrs.evolve(model, params=merge_lora(model.params, server.adapters[name]))
    return astrai.generate(model, prompt, max_tokens=max_tokens, temperature=0.0)[0]


def test_models_list_shows_each_adapter_with_its_parent(lora_server, oai):
    cards = {m.id: m for m in oai.models.list().data}
    assert list(cards) == [BASE, "adapter-a", "adapter-b"]
    assert cards[BASE].parent is None
    assert cards["adapter-a"].parent == BASE and cards["adapter-b"].parent == ALIAS
    for name in ("adapter-a", "adapter-b"):
        assert cards[name].root == lora_server.engine.loras()[name]
    assert oai.models.retrieve("adapter-a").id == "adapter-a"


def test_model_picks_the_adapter_and_its_text_is_the_merged_models(lora_server, oai):
    expected = {name: _merged_text(lora_server, name, PROMPT, 8) for name in ("adapter-a", "adapter-b", None)}
    assert len(set(expected.values())) == 3, expected  # negative control: each adapter changes the greedy text
    for name, text in expected.items():
        reply = oai.completions.create(model=name or BASE, prompt=PROMPT, max_tokens=8, temperature=0)
        assert reply.choices[0].text == text and reply.model == (name or BASE), name
    # the routes agree: chat, Responses and a stream run the same adapter (their reply's model echoes its name)
    messages = [{"role": "user", "content": "hello"}]
    chat = oai.chat.completions.create(model="adapter-a", messages=messages, max_tokens=6, temperature=0)
    base = oai.chat.completions.create(model=BASE, messages=messages, max_tokens=6, temperature=0)
    assert chat.model == "adapter-a" and chat.choices[0].message.content != base.choices[0].message.content
    chunks = list(oai.chat.completions.create(model="adapter-a", messages=messages, max_tokens=6, temperature=0,
                                              stream=True))  # fmt: skip
    assert {c.model for c in chunks} == {"adapter-a"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    resp = oai.responses.create(model="adapter-a", input="hello", max_output_tokens=6, temperature=0)
    assert resp.model == "adapter-a" and resp.output_text == chat.choices[0].message.content


def test_concurrent_requests_mix_adapters_in_one_batch(lora_server, oai):
    """Requests for both adapters and the base at once (one engine batch): each gets its own model's text."""
    names = ["adapter-a", "adapter-b", None] * 3
    expected = {name: _merged_text(lora_server, name, PROMPT, 8) for name in set(names)}

    def ask(name):
        return oai.completions.create(model=name or BASE, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(ask, names))
    assert texts == [expected[name] for name in names]


def test_anthropic_messages_run_the_adapter(lora_server, oai):
    messages = [{"role": "user", "content": "hello"}]
    chat = oai.chat.completions.create(model="adapter-b", messages=messages, max_tokens=6, temperature=0)
    with anthropic.Anthropic(base_url=lora_server.base_url, api_key=KEY, max_retries=0, timeout=60) as anth:
        reply = anth.messages.create(model="adapter-b", messages=messages, max_tokens=6, extra_body={"temperature": 0})
        with pytest.raises(anthropic.NotFoundError):
            anth.messages.create(model="adapter-z", messages=messages, max_tokens=6)
    assert reply.model == "adapter-b" and reply.content[0].text == chat.choices[0].message.content


def test_an_unknown_model_is_a_404_model_not_found(lora_server, oai):
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="adapter-z", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="adapter-z", prompt="hi", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="adapter-z", input="hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("adapter-z")
    absent = lora_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})  # no model: the base, as before
    assert absent.status_code == 200 and absent.json()["model"] == BASE


def test_prompt_logprobs_score_under_the_adapter(lora_server):
    """lm-eval's loglikelihood requests (echo + logprobs) against an adapter score with that adapter: the same
    numbers as `prompt_logprobs` on the model with the adapter merged, not the base model's."""
    from astrai.inference.score import prompt_logprobs

    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    served = {name: lora_server.post("/v1/completions", {**body, "model": name}) for name in ("adapter-a", BASE)}
    assert all(r.status_code == 200 for r in served.values()), [r.text for r in served.values()]
    ids = lora_server.model.tokenizer.encode_prompt(PROMPT)
    merged = attrs.evolve(
        lora_server.model, params=merge_lora(lora_server.model.params, lora_server.adapters["adapter-a"])
    )
    expected = prompt_logprobs(merged, [ids])[0].logprobs[1:]
    got = served["adapter-a"].json()["choices"][0]["logprobs"]["token_logprobs"][1:]
    base = served[BASE].json()["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert got == pytest.approx(expected, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(got, base, strict=True)) > 1e-2  # negative control: the adapter matters


def test_embeddings_refuse_an_adapter(lora_server):
    app = build_app(lora_server.engine, model_name=BASE, embeddings=EncoderConfig())
    try:
        reply = TestClient(app).post("/v1/embeddings", json={"model": "adapter-a", "input": "hi"})
        assert reply.status_code == 400 and "base model" in reply.json()["error"]["message"], reply.text
        assert TestClient(app).post("/v1/embeddings", json={"model": BASE, "input": "hi"}).status_code == 200
    finally:
        app.app.state.embedder.close()  # the lifespan that would close it is not run


def test_runtime_routes_exist_only_with_the_flag(lora_server):
    plain = TestClient(build_app(lora_server.engine, model_name=BASE))  # lifespan not run: the engine stays up
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert plain.post(path, json={"lora_name": "x", "lora_path": "c"}).status_code == 404
    assert [m["id"] for m in plain.get("/v1/models").json()["data"]] == [BASE, "adapter-a", "adapter-b"]

    class NoLoRA:  # an engine without LoRA serving, as far as build_app looks
        config = EngineConfig()

    with pytest.raises(ValueError, match="enable_lora"):
        build_app(NoLoRA(), lora_runtime_updates=True)  # type: ignore[arg-type]


def test_runtime_load_use_and_unload_while_a_request_streams(lora_server, oai):
    server = lora_server
    assert server.post("/v1/load_lora_adapter", {"lora_name": "adapter-c", "lora_path": "c"}, key="bad").status_code \
        == 401  # fmt: skip
    loaded = server.post("/v1/load_lora_adapter", {"lora_name": "adapter-c", "lora_path": "c"})  # relative: the root
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'adapter-c' added successfully."
    card = oai.models.retrieve("adapter-c")
    assert card.parent == BASE and card.root == os.path.join(os.path.realpath(server.root), "c")
    expected = _merged_text(server, "adapter-c", PROMPT, 8)
    assert oai.completions.create(model="adapter-c", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text \
        == expected  # fmt: skip
    again = server.post("/v1/load_lora_adapter", {"lora_name": "adapter-c", "lora_path": "c"})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

    # a long request streams with the adapter; it is unloaded mid-stream, and the request still completes
    usage = {"include_usage": True}
    stream = oai.completions.create(model="adapter-c", prompt=PROMPT, max_tokens=300, temperature=0, stream=True,
                                    stream_options=usage, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = iter(stream)
    first = next(chunks)
    assert first.model == "adapter-c"
    metrics = httpx.get(server.base_url + "/metrics", headers=AUTH).text
    assert 'astrai_lora_running_requests{adapter="adapter-c"} 1' in metrics, metrics
    assert 'running_lora_adapters="adapter-c"' in metrics
    gone = server.post("/v1/unload_lora_adapter", {"lora_name": "adapter-c"}, key="bad")
    assert gone.status_code == 401
    gone = server.post("/v1/unload_lora_adapter", {"lora_name": "adapter-c"})
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'adapter-c' removed successfully."
    assert server.engine.stats().lora_running.get("adapter-c") == 1  # still running after the unload answered
    with pytest.raises(openai.NotFoundError):  # the name is gone for new requests at once
        oai.completions.create(model="adapter-c", prompt=PROMPT, max_tokens=1)
    rest = list(chunks)
    finish = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"] and rest[-1].usage.completion_tokens == 300
    merged = attrs.evolve(server.model, params=merge_lora(server.model.params, server.adapters["adapter-c"]))
    whole = astrai.generate(merged, PROMPT, max_tokens=300, stop_token_ids=[])[0]  # ids given: eos ignored
    assert "".join(c.choices[0].text for c in [first, *rest] if c.choices) == whole  # the adapter to the end
    assert "adapter-c" not in [m.id for m in oai.models.list().data]
    again = server.post("/v1/unload_lora_adapter", {"lora_name": "adapter-c"})
    assert again.status_code == 404 and "cannot be found" in again.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"lora_name": "x", "lora_path": "OUTSIDE"}, 400, "outside the LoRA root"),
        ({"lora_name": "x", "lora_path": "link"}, 400, "outside the LoRA root"),  # a symlink out of the root
        ({"lora_name": "x", "lora_path": "../outside"}, 400, "outside the LoRA root"),
        ({"lora_name": "x", "lora_path": "missing"}, 404, "No adapter found"),
        ({"lora_name": "x", "lora_path": "a\x00b"}, 400, "not a usable path"),
        ({"lora_name": "x", "lora_path": "wide"}, 400, "rank"),  # r=16 > --max-lora-rank 8
        ({"lora_name": "x", "lora_path": "half"}, 400, "adapter_model"),  # no weights file
        ({"lora_name": "adapter-a", "lora_path": "c"}, 400, "already been loaded"),
        ({"lora_name": BASE, "lora_path": "c"}, 400, "base model's name"),
        ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path'"),
    ],
)
def test_bad_loads_are_clear_errors_and_change_nothing(lora_server, body, status, says):
    if body.get("lora_path") == "OUTSIDE":
        body = {**body, "lora_path": lora_server.outside}
    before = lora_server.engine.loras()
    reply = lora_server.post("/v1/load_lora_adapter", body)
    assert reply.status_code == status and says in reply.json()["error"]["message"], reply.text
    if "outside" in says:
        assert os.path.realpath(lora_server.root) in reply.json()["error"]["message"]
    assert lora_server.engine.loras() == before


def test_metrics_count_adapters(lora_server):
    text = httpx.get(lora_server.base_url + "/metrics", headers=AUTH).text
    assert "astrai_lora_adapters_loaded 2" in text
    assert 'astrai_lora_running_requests{adapter="adapter-a"} 0' in text
    assert 'astrai_lora_waiting_requests{adapter="adapter-b"} 0' in text
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} ' in text

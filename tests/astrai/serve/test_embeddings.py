"""`POST /v1/embeddings` through a live server, with the official `openai` SDK and raw httpx.

Expected vectors come from `astrai.embed` / `astrai.embed_ids` called directly on the same model (whose encoder
is checked against transformers in tests/astrai/models/test_encoder.py), never from a server run.
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
import uvicorn

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.models.encoder import EncoderConfig
from astrai.serve.app import build_app
from helpers import assert_close, tiny_model_dir

KEY = "test-key"
MODEL = "tiny-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
POOLING, NORMALIZE = "last", False  # not the defaults, so the server's options are seen to apply
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "fox"]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A live server with embeddings enabled (pooling "last", no normalisation)."""
    model = astrai.load(tiny_model_dir(tmp_path_factory.mktemp("embed_served") / "m"))
    engine = Engine(model, EngineConfig(max_running=8, max_waiting=16, compile=False, kv_budget_tokens=4096))
    app = build_app(engine, model_name=MODEL, api_key=KEY,
                    embeddings=EncoderConfig(pooling=POOLING, normalize=NORMALIZE))  # fmt: skip
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    for _ in range(500):
        if uv.started:
            break
        time.sleep(0.01)
    base = f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    yield model, base
    uv.should_exit = True
    with contextlib.suppress(Exception):
        thread.join(timeout=10)


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live[1] + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def _expected(model, texts) -> torch.Tensor:
    return astrai.embed(model, texts, pooling=POOLING, normalize=NORMALIZE)


def _vectors(resp) -> torch.Tensor:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    assert all(d.object == "embedding" for d in resp.data)
    return torch.tensor([d.embedding for d in resp.data])


def test_batch_of_texts_float(live, client):
    model, _ = live
    resp = client.embeddings.create(input=TEXTS, model=MODEL, encoding_format="float")
    assert resp.object == "list" and resp.model == MODEL
    assert_close(_vectors(resp), _expected(model, TEXTS), atol=1e-5)
    n = sum(len(model.tokenizer.encode(t)) for t in TEXTS)
    assert resp.usage.prompt_tokens == n and resp.usage.total_tokens == n


def test_sdk_default_is_base64_and_decodes_to_the_same_vectors(live, client):
    model, base = live
    resp = client.embeddings.create(input="hello world", model=MODEL)  # the SDK asks for base64 and decodes it
    assert len(resp.data) == 1
    assert_close(_vectors(resp), _expected(model, ["hello world"]), atol=1e-5)
    body = {"input": TEXTS, "model": MODEL, "encoding_format": "base64"}
    raw = httpx.post(base + "/v1/embeddings", json=body, headers=HEADERS).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    floats = client.embeddings.create(input=TEXTS, model=MODEL, encoding_format="float")
    assert_close(torch.tensor(np.stack(decoded)), _vectors(floats), atol=0.0)  # float32 both ways: bit-equal


def test_token_id_inputs(live, client):
    model, _ = live
    rows = [[5, 17, 42, 9], [3], [100, 101, 102, 103, 104, 105, 106]]
    many = client.embeddings.create(input=rows, model=MODEL, encoding_format="float")
    expected = astrai.embed_ids(model, rows, pooling=POOLING, normalize=NORMALIZE)
    assert_close(_vectors(many), expected, atol=1e-5)
    assert many.usage.prompt_tokens == 12
    one = client.embeddings.create(input=rows[0], model=MODEL, encoding_format="float")
    assert_close(_vectors(one), expected[:1], atol=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 5}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [1, 10**9]}, "input"),
        ({"input": [True]}, "input"),
        ({}, "input"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "hi", "dimensions": 8}, "dimensions"),
        ({"input": "hi", "model": 3}, "model"),
        ({"input": "hi", "encodng_format": "float"}, "encodng_format"),  # misspelt: not silently ignored
    ],
)
def test_bad_fields_are_400_naming_the_field(live, body, param):
    resp = httpx.post(live[1] + "/v1/embeddings", json={"model": MODEL, **body}, headers=HEADERS)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_user_field_is_accepted(live, client):
    # OpenAI's `user` (an end-user id for abuse monitoring) is part of the API: accepted, unused
    resp = client.embeddings.create(input="hi", model=MODEL, encoding_format="float", user="u-1")
    assert_close(_vectors(resp), _expected(live[0], ["hi"]), atol=1e-5)


def test_dimensions_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(input="hi", model=MODEL, dimensions=8)


def test_requests_and_tokens_are_counted(live, client):
    client.embeddings.create(input=[[1, 2, 3]], model=MODEL, encoding_format="float")
    text = httpx.get(live[1] + "/metrics", headers=HEADERS).text
    assert 'astrai_requests_total{endpoint="/v1/embeddings",status="200"}' in text
    tokens = next(line for line in text.splitlines() if line.startswith("astrai_embedding_tokens_total "))
    assert int(tokens.split()[1]) >= 3


def test_chat_keeps_working_next_to_embeddings(live, client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            stream=True)  # fmt: skip
    first = next(iter(stream))
    vectors = client.embeddings.create(input=TEXTS, model=MODEL, encoding_format="float")
    assert len(vectors.data) == 3 and first.choices[0].delta.role == "assistant"
    assert [c for c in stream][-1].choices[0].finish_reason in ("length", "stop")


def test_disabled_route_is_404(server):
    # the shared server (conftest.py) is built without `embeddings`
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as c:
        with pytest.raises(openai.NotFoundError, match="--embeddings"):
            c.embeddings.create(input="hi", model=MODEL, encoding_format="float")


def test_cli_flags_enable_the_route(live, monkeypatch):
    import astrai.cli.serve as cli
    import astrai.serve.server as server_mod
    from astrai.cli._common import parse

    built = []

    class FakeServer:  # records the app instead of serving it
        def __init__(self, config, engine):
            built.append((config.app, engine))

        def run(self, sockets=None):
            pass

    monkeypatch.setattr(cli, "load_model", lambda *a: live[0])
    monkeypatch.setattr(server_mod, "GracefulServer", FakeServer)
    for argv, expected in [
        (["--model", "m"], None),
        (["--model", "m", "--embeddings", "--embed-pooling", "cls", "--no-embed-normalize"],
         EncoderConfig(pooling="cls", normalize=False)),
    ]:  # fmt: skip
        cli.main(parse(cli.ServeConfig, [*argv, "--no-compile", "--port", "0"]))
        app, engine = built.pop()
        engine.shutdown()
        assert app.state.embeddings == expected


def test_an_unknown_model_is_404_model_not_found(client):
    assert client.embeddings.create(model=MODEL, input="fox").data  # the served name is served
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model="text-embedding-3-small", input="fox")
    assert err.value.code == "model_not_found"

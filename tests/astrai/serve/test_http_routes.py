"""OpenAI's "retrieve model" route, and compressed request bodies, against the live test server.

- `GET /v1/models/{id}` (the SDK's `client.models.retrieve`) answers the served model's card, the same as its entry
  in `/v1/models`, and a 404 in OpenAI's shape (`code: model_not_found`) for any other id.
- A POST body sent with a `Content-Encoding` (gzip, ...) is refused with a 415 naming the encoding: the server
  reads bodies as plain JSON, so a gzipped body used to fail as "not valid UTF-8" and a plain body labelled gzip
  was accepted. Control: `identity` is plain and accepted.
"""

from __future__ import annotations

import gzip
import json

import httpx
import openai
import pytest

API_KEY, MODEL_NAME = "test-key", "tiny-test"  # the `server` fixture's (tests/astrai/serve/conftest.py)
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_retrieve_the_served_model(server, oai):
    card = oai.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    assert card.model_dump() == oai.models.list().data[0].model_dump()


@pytest.mark.parametrize("name", ["other-model", "org/other-model", MODEL_NAME + "x"])
def test_retrieve_another_model_is_404_in_openai_shape(server, oai, name):
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve(name)
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and name in error["message"]


def test_retrieve_needs_the_api_key(server):
    assert httpx.get(f"{server.base_url}/v1/models/{MODEL_NAME}").status_code == 401


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip"])
def test_compressed_bodies_are_415(server, encoding):
    body = gzip.compress(json.dumps(CHAT).encode())
    headers = {**HEADERS, "Content-Type": "application/json", "Content-Encoding": encoding}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", content=body, headers=headers)
    assert resp.status_code == 415, resp.text
    assert "Content-Encoding" in resp.json()["error"]["message"] and encoding in resp.json()["error"]["message"]
    # a plain body labelled gzip is refused the same way, not read as JSON
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
    assert resp.status_code == 415


def test_anthropic_route_answers_415_in_its_shape(server):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    headers = {**HEADERS, "Content-Type": "application/json", "Content-Encoding": "gzip"}
    resp = httpx.post(f"{server.base_url}/v1/messages", content=gzip.compress(json.dumps(body).encode()),
                      headers=headers)  # fmt: skip
    assert resp.status_code == 415 and resp.json()["type"] == "error", resp.text


def test_identity_encoding_is_plain(server):
    headers = {**HEADERS, "Content-Encoding": "identity"}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=CHAT, headers=headers)
    assert resp.status_code == 200, resp.text

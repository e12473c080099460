"""A request's `model` must name a served model (issue 41, item 4): any other name is a 404 `model_not_found` on
every route that takes a `model`, in the route's own error shape, which the official SDKs raise as
`NotFoundError`; the served name, an alias (`--served-model-name a b`) and a missing `model` are served.

The CLI's default names (the folder's name and `--model` as typed) are checked in tests/astrai/cli.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from astrai.cli._common import served_names
from tests.astrai.serve.conftest import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "hi"}]
# every POST route that takes `model`, with a body that is otherwise valid there
ROUTES = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"messages": USER, "max_tokens": 1},
    "/v1/messages/count_tokens": {"messages": USER},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}


@pytest.mark.parametrize("path", list(ROUTES))
def test_every_route_refuses_an_unknown_model_and_serves_the_known_ones(server, path):
    server.script("ok")
    url = server.base_url + path
    assert httpx.post(url, json={"model": MODEL_NAME, **ROUTES[path]}, headers=AUTH, timeout=30).status_code == 200
    if path != "/v1/messages" and path != "/v1/messages/count_tokens":  # Anthropic's `model` is required
        assert httpx.post(url, json=ROUTES[path], headers=AUTH, timeout=30).status_code == 200  # absent: served
    reply = httpx.post(url, json={"model": "gpt-5", **ROUTES[path]}, headers=AUTH, timeout=30)
    assert reply.status_code == 404, reply.text
    if path.startswith("/v1/messages"):
        assert reply.json() == {"type": "error", "error": {"type": "not_found_error", "message": reply.json()[
            "error"]["message"]}} and "gpt-5" in reply.json()["error"]["message"]  # fmt: skip
    else:
        assert reply.json()["error"]["code"] == "model_not_found" and reply.json()["error"]["param"] == "model"
        assert reply.json()["error"]["message"] == "The model `gpt-5` does not exist or you do not have access to it."


def test_the_sdks_raise_not_found(server, oai, anth):
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="gpt-5", messages=USER, max_tokens=1)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-5", input="hi", max_output_tokens=1)
    with pytest.raises(anthropic.NotFoundError):
        anth.messages.create(model="claude-sonnet-4-5", messages=USER, max_tokens=1)
    with pytest.raises(openai.NotFoundError):  # the card route agrees with the request routes
        oai.models.retrieve("gpt-5")


def test_aliases_are_served_and_reported_as_the_served_name(server, oai, monkeypatch):
    server.script("ok")
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="claude-sonnet-4-5", prompt="hi", max_tokens=1)
    monkeypatch.setattr(server.app.state, "model_aliases", ("claude-sonnet-4-5",))
    reply = oai.completions.create(model="claude-sonnet-4-5", prompt="hi", max_tokens=1)
    assert reply.model == MODEL_NAME


def test_cli_default_names(tmp_path):
    folder = tmp_path / "SmolLM2-135M"
    folder.mkdir()
    assert served_names(str(folder)) == ("SmolLM2-135M", str(folder))  # the folder's name, then the path as typed
    assert served_names("HuggingFaceTB/SmolLM2-135M") == ("HuggingFaceTB/SmolLM2-135M",)
    assert served_names(str(folder), ("a", "b")) == ("a", "b")

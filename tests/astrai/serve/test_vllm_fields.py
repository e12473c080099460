"""Issue 15 item 4 through the live server and the official SDKs: vLLM's extension fields change the output as
they should, `chat_template_kwargs` / `documents` / `continue_final_message` / `echo` reach the prompt and the
reply, unknown fields are 400s naming them, and the server's sampling defaults (generation_config.json) fill
unset fields while an explicit field wins.

`server.script(text)` makes the model say `text` (then eos); where the sampler itself must act (min_tokens masks
eos) the real random model runs, pushed towards eos with logit_bias.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.serve.app import build_app
from helpers import tiny_model_dir

KEY, MODEL = "test-key", "tiny-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hi"}]
TEXT = "Hello world. Goodbye world."


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def submitted(server, monkeypatch):
    """Every request the engine receives: prompt ids and SamplingParams."""
    seen, real = [], server.engine.submit

    def record(prompt, params=None, **kwargs):
        seen.append(SimpleNamespace(ids=list(prompt), params=params))
        return real(prompt, params, **kwargs)

    monkeypatch.setattr(server.engine, "submit", record)
    return seen


def ids_of(server, text: str) -> list[int]:
    return server.tokenizer.encode(text, add_special_tokens=False)


def chat(client, **kw):
    """One chat completion through the SDK; vLLM's fields go in extra_body, as vLLM's docs show."""
    extra = {k: kw.pop(k) for k in list(kw) if k not in ("messages", "max_tokens", "stop", "stream", "temperature",
                                                          "seed", "logit_bias", "n")}  # fmt: skip
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", USER), extra_body=extra, **kw)


# ---- the sampling extensions ----------------------------------------------------------------------------------
def test_stop_token_ids_end_generation_at_that_token(server, client):
    server.script(TEXT)
    ids = ids_of(server, TEXT)
    cut = ids.index(server.tokenizer.token_to_id("G"))  # "Hello world. " then "G"
    full = chat(client)
    assert full.choices[0].message.content == TEXT  # control: without the field the whole script comes back
    stopped = chat(client, stop_token_ids=[ids[cut]])
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == cut + 1
    assert stopped.choices[0].message.content == "Hello world. "  # the stop token adds no text, as eos
    legacy = client.completions.create(model=MODEL, prompt="x", extra_body={"stop_token_ids": [ids[cut]]})
    assert legacy.usage.completion_tokens == cut + 1 and legacy.choices[0].text == stopped.choices[0].message.content


def test_min_tokens_holds_eos_off(server, client):
    eos = server.tokenizer.eos_token_id
    kw = {"temperature": 0, "max_tokens": 10, "logit_bias": {str(eos): 100}}  # the real model, eos forced
    early = chat(client, **kw)
    assert (early.usage.completion_tokens, early.choices[0].finish_reason) == (1, "stop")
    held = chat(client, **kw, min_tokens=4)
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (5, "stop")
    legacy = client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=0,
                                       logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})  # fmt: skip
    assert legacy.usage.completion_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop(server, client, stream):
    server.script(TEXT)

    def text(**kw) -> str:
        reply = client.completions.create(model=MODEL, prompt="x", stop=". G", stream=stream, **kw)
        return "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text

    assert text() == "Hello world"
    assert text(extra_body={"include_stop_str_in_output": True}) == "Hello world. G"
    reply = chat(client, stop=". G", include_stop_str_in_output=True)
    assert reply.choices[0].message.content == "Hello world. G"


def test_skip_special_tokens_false_shows_them(server, client):
    server.script("x<|im_start|>y")  # a special token in the middle of the reply
    assert chat(client).choices[0].message.content == "xy"
    shown = chat(client, skip_special_tokens=False).choices[0].message.content
    assert shown == "x<|im_start|>y"  # the final eos ends the reply without text
    legacy = client.completions.create(model=MODEL, prompt="x", extra_body={"skip_special_tokens": False})
    assert legacy.choices[0].text == shown


# ---- chat template fields ---------------------------------------------------------------------------------------
@pytest.fixture
def greeting_template(server, monkeypatch):
    """The ChatML template, preceded by `[greeting]` when the variable is set and by the documents' titles."""
    head = ("{%- if greeting is defined %}{{ '[' + greeting + ']' }}{%- endif %}"
            "{%- for d in documents or [] %}{{ '(' + d.title + ')' }}{%- endfor %}")  # fmt: skip
    monkeypatch.setattr(server.tokenizer, "_chat_template", head + server.tokenizer.chat_template)


def test_chat_template_kwargs_reach_the_template(server, client, submitted, greeting_template):
    server.script("ok")
    chat(client)
    plain = server.tokenizer.decode(submitted[-1].ids, skip_special_tokens=False)
    assert plain.startswith("<|im_start|>user\nhi")  # control: the variable unset
    chat(client, chat_template_kwargs={"greeting": "Bonjour"}, documents=[{"title": "Doc1", "text": "t"}])
    rendered = server.tokenizer.decode(submitted[-1].ids, skip_special_tokens=False)
    assert rendered == "[Bonjour](Doc1)" + plain
    with pytest.raises(openai.BadRequestError) as err:  # a template argument is not a variable to override
        chat(client, chat_template_kwargs={"messages": []})
    assert err.value.body["param"] == "chat_template_kwargs"


def test_continue_final_message_and_echo(server, client, submitted):
    server.script(" 42.")
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    reply = chat(client, messages=messages, continue_final_message=True, add_generation_prompt=False)
    expected = server.tokenizer.apply_chat_template(USER, add_generation_prompt=True) + "The answer is"
    assert submitted[-1].ids == ids_of(server, expected)
    assert reply.choices[0].message.content == " 42."
    echoed = chat(client, messages=messages, continue_final_message=True, echo=True)
    assert echoed.choices[0].message.content == "The answer is 42."
    stream = chat(client, messages=messages, continue_final_message=True, echo=True, stream=True, n=2)
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {0: "The answer is 42.", 1: "The answer is 42."}
    assert chat(client, echo=True).choices[0].message.content == " 42."  # last message is the user's: no echo


def test_unknown_fields_are_400s_naming_them(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, frobnicate=True)
    assert err.value.body["param"] == "frobnicate" and "temperature" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", extra_body={"structural_tag": {"type": "object"}})
    assert err.value.body["param"] == "structural_tag" and "structural tags" in err.value.body["message"]
    server.script("fine")
    # the deliberate no-ops are accepted
    reply = client.chat.completions.create(model=MODEL, messages=USER, user="u", store=False, metadata={"a": "b"},
                                           service_tier="auto", parallel_tool_calls=False)  # fmt: skip
    assert reply.choices[0].message.content == "fine"
    assert client.completions.create(model=MODEL, prompt="x", user="u").choices[0].text == "fine"


# ---- sampling defaults ------------------------------------------------------------------------------------------
def test_sampling_defaults_apply_and_explicit_fields_win(server, client, submitted, monkeypatch):
    kw = {"ignore_eos": True}
    random = chat(client, max_tokens=6, seed=1, **kw).choices[0].message.content
    greedy = chat(client, max_tokens=6, temperature=0, **kw).choices[0].message.content
    assert random != greedy  # control: the default temperature 1 samples
    monkeypatch.setattr(server.app.state, "sampling_defaults", {"temperature": 0.0, "max_tokens": 6, "top_k": 7})
    reply = chat(client, seed=1, **kw)
    assert reply.usage.completion_tokens == 6 and reply.choices[0].message.content == greedy
    assert (submitted[-1].params.temperature, submitted[-1].params.top_k) == (0.0, 7)
    explicit = chat(client, seed=1, temperature=1.0, top_k=0, max_tokens=6, **kw)
    assert explicit.choices[0].message.content == random and submitted[-1].params.top_k == 0
    assert chat(client, max_tokens=2, **kw).usage.completion_tokens == 2
    legacy = client.completions.create(model=MODEL, prompt="x", extra_body=kw)  # OpenAI's default would be 16
    assert legacy.usage.completion_tokens == 6 and submitted[-1].params.temperature == 0.0
    monkeypatch.setattr(server.app.state, "sampling_defaults", {"max_tokens": 100_000})
    server.script("ok")
    capped = client.completions.create(model=MODEL, prompt="x")
    assert submitted[-1].params.max_tokens == server.engine.max_model_len - capped.usage.prompt_tokens


def test_anthropic_takes_the_sampling_defaults(server, submitted, monkeypatch):
    defaults = {"temperature": 0.0, "top_k": 7, "top_p": 0.5, "min_p": 0.1, "repetition_penalty": 1.2,
                "max_tokens": 3}  # fmt: skip
    monkeypatch.setattr(server.app.state, "sampling_defaults", defaults)
    server.script("ok")
    with anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60) as sdk:
        sdk.messages.create(model="tiny-test", max_tokens=8, messages=USER)
        p = submitted[-1].params
        assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.max_tokens) == (
            0.0, 7, 0.5, 0.1, 1.2, 8)  # fmt: skip
        sdk.messages.create(model="tiny-test", max_tokens=8, messages=USER, extra_body={"temperature": 0.5, "top_k": 2})
        assert (submitted[-1].params.temperature, submitted[-1].params.top_k) == (0.5, 2)
        with pytest.raises(anthropic.BadRequestError) as err:
            sdk.messages.create(model="tiny-test", max_tokens=8, messages=USER, extra_body={"min_p": 0.2})
        assert "min_p" in err.value.body["error"]["message"] and "top_k" in err.value.body["error"]["message"]


def test_generation_config_json_reaches_requests(tmp_path):
    """A model folder's generation_config.json -> Model.generation_defaults -> build_app(sampling_defaults=...)."""
    folder = Path(tiny_model_dir(tmp_path / "m"))
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": 4}))
    model = astrai.load(folder)
    assert model.generation_defaults == {"temperature": 0.0, "max_tokens": 4}
    engine = Engine(model, EngineConfig(max_running=4, compile=False, kv_budget_tokens=4096))
    with pytest.raises(ValueError, match="frequency_penalty"):
        build_app(engine, sampling_defaults={"frequency_penalty": 1.0})
    app = build_app(engine, model_name="m", sampling_defaults=model.generation_defaults)

    async def ask() -> list[dict]:
        transport = httpx.ASGITransport(app=app)  # in process, no lifespan: the engine is shut down below
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as http:
            sdk = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=http, max_retries=0)
            out = []
            for extra in ({}, {"temperature": 0}, {"max_tokens": 2}):
                body = {"ignore_eos": True, **extra}
                reply = await sdk.chat.completions.create(model="m", messages=USER, extra_body=body)
                out.append({"text": reply.choices[0].message.content, "tokens": reply.usage.completion_tokens})
            return out

    try:
        default, greedy, short = asyncio.run(asyncio.wait_for(ask(), 120))
    finally:
        engine.shutdown()
    assert default == greedy and default["tokens"] == 4  # temperature 0 and max_new_tokens 4 from the file
    assert short["tokens"] == 2  # an explicit max_tokens wins

"""Fields popular clients send (issue 41, item 3, part): vLLM's `structured_outputs`, TGI's / huggingface_hub's
`response_format` with `value`, `reasoning_effort` and `verbosity` (template variables, as vLLM passes them), and
vLLM's `request_id`.

Independent references: a constrained output is checked with `jsonschema`, Python's `re` and json; the same
constraint given as vLLM's older `guided_*` field yields the same tokens (one engine path); the template variables
are checked against transformers' `apply_chat_template` on the same template and tokenizer.json; the clients are the
real ones (openai SDK, litellm, huggingface_hub's InferenceClient).
"""

from __future__ import annotations

import json
import os
import re

import httpx
import jsonschema
import pytest
import transformers

from astrai.serve.openai_protocol import parse_chat
from tests.astrai.serve.conftest import API_KEY, MODEL_NAME

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise
import litellm  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning")
AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "Give me a number."}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}  # fmt: skip


def chat(server, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 40, "temperature": 0, **fields}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_structured_outputs_is_guided_under_its_new_name(server):
    text = content(chat(server, structured_outputs={"json": SCHEMA}))
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == content(chat(server, guided_json=SCHEMA))  # the same engine path, the same greedy tokens
    assert content(chat(server, structured_outputs={"choice": ["red", "green"]})) in ("red", "green")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", content(chat(server, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"})))
    assert isinstance(json.loads(content(chat(server, structured_outputs={"json_object": True}))), dict)
    assert content(chat(server, structured_outputs={"grammar": 'start: "yes" | "no"'})) in ("yes", "no")
    unconstrained = content(chat(server))
    assert unconstrained != text  # negative control: the random model alone does not write this JSON


@pytest.mark.parametrize(("value", "param"), [
    ({"json": SCHEMA, "regex": "a"}, "structured_outputs"),
    ({}, "structured_outputs"),
    ({"jsn": SCHEMA}, "structured_outputs.jsn"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"json": SCHEMA, "disable_any_whitespace": True}, "structured_outputs.disable_any_whitespace"),
    ("json", "structured_outputs"),
])  # fmt: skip
def test_bad_structured_outputs_are_400_naming_the_field(server, value, param):
    response = chat(server, structured_outputs=value)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_structured_outputs_and_guided_json_together_is_a_400(server):
    response = chat(server, structured_outputs={"json": SCHEMA}, guided_regex="a")
    assert response.status_code == 400 and "both constrain the output" in response.json()["error"]["message"]


def test_huggingface_hub_response_format_with_value(server):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    client = huggingface_hub.InferenceClient(base_url=server.base_url + "/v1", api_key=API_KEY)
    reply = client.chat_completion(USER, model=MODEL_NAME, max_tokens=40, temperature=0,
                                   response_format={"type": "json", "value": SCHEMA})  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert re.fullmatch(r"[0-9]{4}", content(chat(server, response_format={"type": "regex", "value": "[0-9]{4}"})))
    as_text = content(chat(server, response_format={"type": "json_object", "value": json.dumps(SCHEMA)}))
    jsonschema.validate(json.loads(as_text), SCHEMA)  # the value was not ignored (was: any JSON object)
    bad = chat(server, response_format={"type": "grammar", "value": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.type"


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "effort={{ reasoning_effort }} verbosity={{ verbosity }}\nassistant:")  # fmt: skip


def test_reasoning_effort_and_verbosity_reach_the_template(server, tmp_path):
    tokenizer = server.tokenizer.with_chat_template(TEMPLATE)
    body = {"messages": USER, "reasoning_effort": "high", "verbosity": "low"}
    chat_req = parse_chat(body, tokenizer, vocab_size=server.engine.model.config.vocab_size, context=2048)
    tokenizer.save(tmp_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    expected = hf.apply_chat_template(USER, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False,
                                      reasoning_effort="high", verbosity="low")  # fmt: skip
    assert "effort=high verbosity=low" in expected
    assert chat_req.prompt == hf(expected, add_special_tokens=False)["input_ids"]
    plain = parse_chat({"messages": USER}, tokenizer, vocab_size=server.engine.model.config.vocab_size, context=2048)
    assert "effort= verbosity=" in tokenizer.decode(plain.prompt)  # unset: the template sees nothing


@pytest.mark.parametrize(("fields", "param"), [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"verbosity": 3}, "verbosity"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "reasoning_effort"),
    ({"request_id": "has space"}, "request_id"),
    ({"request_id": "x" * 129}, "request_id"),
])  # fmt: skip
def test_bad_client_fields_are_400_naming_them(server, fields, param):
    response = chat(server, **fields)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_request_id_names_the_reply(server, oai):
    reply = oai.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=2, extra_body={"request_id": "r-42"}
    )
    assert reply.id == "chatcmpl-r-42"
    completion = oai.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"request_id": "q-7"})
    assert completion.id == "cmpl-q-7"
    assert oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2).id.startswith("chatcmpl-")


@pytest.mark.usefixtures("close_litellm_loop")
def test_litellm_sends_reasoning_effort_and_it_is_accepted(server):
    server.script("fine")
    try:
        reply = litellm.completion(model=f"openai/{MODEL_NAME}", api_base=server.base_url + "/v1", api_key=API_KEY,
                                   messages=USER, max_tokens=4, reasoning_effort="low", num_retries=0)  # fmt: skip
    finally:
        server.script(None)
    assert reply.choices[0].message.content == "fine"


def test_priority_is_a_400_under_fcfs_and_honoured_under_priority(server):
    response = chat(server, priority=3)  # the session server schedules fcfs, as vLLM's default
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in response.json()["error"]["message"]
    assert chat(server, priority=0).status_code == 200
    assert chat(server, priority="high").json()["error"]["param"] == "priority"


def _ids(tokens: list[str]) -> list[int]:
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens), tokens
    return [int(t.split(":")[1]) for t in tokens]


def test_return_tokens_as_token_ids(server, oai):
    ids_body = {"return_tokens_as_token_ids": True}
    reply = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=6, temperature=0, logprobs=True,
                                        top_logprobs=2, extra_body=ids_body)  # fmt: skip
    entries = reply.choices[0].logprobs.content
    ids = _ids([e.token for e in entries])
    assert server.tokenizer.decode(ids) == reply.choices[0].message.content  # the ids spell the reply
    assert all(len(_ids([t.token for t in e.top_logprobs])) == 2 for e in entries)
    assert [bytes(e.bytes).decode() for e in entries] == [e.token for e in entries]  # vLLM: the bytes of that text
    plain = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=6, temperature=0, logprobs=True)
    assert not any(e.token.startswith("token_id:") for e in plain.choices[0].logprobs.content)  # negative control
    streamed = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=6, temperature=0,
                                           logprobs=True, stream=True, extra_body=ids_body)  # fmt: skip
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert _ids([e.token for lp in chunks for e in lp.content or []]) == ids
    legacy = oai.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=5, temperature=0, logprobs=1,
                                    extra_body=ids_body)  # fmt: skip
    assert server.tokenizer.decode(_ids(legacy.choices[0].logprobs.tokens)) == legacy.choices[0].text

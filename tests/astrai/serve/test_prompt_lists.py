"""Issue 15 item 4: a list of prompts in one `/v1/completions` request (what lm-eval's `local-completions` sends),
through the live server with the official `openai` SDK and raw HTTP.

Each prompt is its own engine request: choices are indexed `prompt_index * n + j` and carry the same text as the
prompt sent alone (greedy, the real random model), usage is summed, a stream interleaves the prompts' chunks and
ends once; a bad prompt is a 400 before anything runs; a disconnect or a full queue aborts every prompt.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from astrai.inference.engine import EngineBusyError

KEY, MODEL = "test-key", "tiny-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["hello world", "the quick brown fox", [5, 17, 42]]
GREEDY = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def submitted(server, monkeypatch) -> list[list[int]]:
    seen, real = [], server.engine.submit

    def record(prompt, params=None, **kwargs):
        seen.append(list(prompt))
        return real(prompt, params, **kwargs)

    monkeypatch.setattr(server.engine, "submit", record)
    return seen


def one_by_one(client, **kw) -> list:
    return [client.completions.create(model=MODEL, prompt=p, **kw) for p in PROMPTS]


def test_prompt_list_matches_one_request_per_prompt(server, client, submitted):
    alone = one_by_one(client, **GREEDY)
    del submitted[:]
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, **GREEDY)
    assert len(submitted) == len(PROMPTS)  # one engine request per prompt
    assert [c.index for c in batch.choices] == list(range(2 * len(PROMPTS)))
    for c in batch.choices:
        assert c.text == alone[c.index // 2].choices[0].text and c.finish_reason == "length"
    assert len({c.text for c in batch.choices}) > 1  # the prompts differ, so do their completions
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)  # each prompt counted once
    assert batch.usage.completion_tokens == 2 * len(PROMPTS) * 6
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[:2], echo=True, **GREEDY)
    assert [c.text for c in echoed.choices] == [
        p + r.choices[0].text for p, r in zip(PROMPTS[:2], alone[:2], strict=True)
    ]


def test_prompt_list_stream(server, client):
    alone = one_by_one(client, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, n=2, stream=True, echo=True,
                                            stream_options={"include_usage": True}, **GREEDY))  # fmt: skip
    texts: dict[int, str] = {}
    finished = []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finished.append(choice.index)
    shown = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in PROMPTS]
    assert texts == {i: shown[i // 2] + alone[i // 2].choices[0].text for i in range(6)}
    assert sorted(finished) == list(range(6))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 36
    assert usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    raw = httpx.post(f"{server.base_url}/v1/completions", headers=HEADERS, timeout=60,
                     json={"model": MODEL, "prompt": PROMPTS, "stream": True, "max_tokens": 3})  # fmt: skip
    assert raw.text.endswith("data: [DONE]\n\n") and raw.text.count("[DONE]") == 1
    events = [json.loads(e[len("data: ") :]) for e in raw.text.split("\n\n")[:-2]]
    assert {e["choices"][0]["index"] for e in events} == {0, 1, 2} and len({e["id"] for e in events}) == 1


def test_lm_eval_payloads(server, client):
    """What lm-eval's local-completions sends: token-id lists (tokenized_requests) or strings, greedy, stop, seed."""
    ids = [server.tokenizer.encode(p) for p in PROMPTS[:2]]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 5, "temperature": 0, "stop": ["\n\n"], "seed": 1234}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1], r.text
    body["prompt"] = PROMPTS[:2]
    r2 = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert [c["text"] for c in r2.json()["choices"]] == [c["text"] for c in r.json()["choices"]]


def test_a_bad_prompt_rejects_the_list_before_anything_runs(server, client, submitted):
    too_long = "hello " * 2500
    for prompt, words in ((["fine", too_long], ["prompt[1]", "2048"]), (["fine", [1, 10**6]], ["prompt[1]"]),
                          (["fine", ""], ["prompt[1]"])):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert err.value.body["param"] == "prompt" and all(w in err.value.body["message"] for w in words)
    assert submitted == []
    with pytest.raises(openai.BadRequestError) as err:  # more sequences than the whole queue (max_waiting 64)
        client.completions.create(model=MODEL, prompt=["a"] * 40, n=2, max_tokens=1)
    assert err.value.body["param"] == "prompt" and submitted == []


def test_a_full_queue_aborts_the_prompts_already_queued(server, client, monkeypatch):
    real, calls = server.engine.submit, []

    def busy_on_the_third(prompt, params=None, **kwargs):
        calls.append(prompt)
        if len(calls) == 3:
            raise EngineBusyError("no room")
        return real(prompt, params, **kwargs)

    monkeypatch.setattr(server.engine, "submit", busy_on_the_third)
    before = server.engine.stats().generated_tokens
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=1500, extra_body={"ignore_eos": True})
    server.wait_idle()
    assert server.kv_in_use() == 0 and server.engine.stats().generated_tokens - before < 2 * 1500


@pytest.fixture
def slow(server, monkeypatch):
    """The real model at >= 5 ms a step, so that 400 tokens take seconds and only a disconnect ends them early."""
    execute = server.engine.runner.execute

    def slow_execute(plan, **kw):
        time.sleep(0.005)
        return execute(plan, **kw)

    monkeypatch.setattr(server.engine.runner, "execute", slow_execute)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_every_prompt(server, slow, stream):
    body = {"model": MODEL, "prompt": ["a", "b", [7, 8]], "max_tokens": 400, "ignore_eos": True, "stream": stream}
    before = server.engine.stats().generated_tokens
    url = f"{server.base_url}/v1/completions"
    if stream:
        with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=60) as r:
            lines = r.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(8), strict=False) if line.startswith("data: ")) >= 4
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, headers=HEADERS, timeout=0.5)
    server.wait_idle()
    assert server.kv_in_use() == 0
    assert server.engine.stats().generated_tokens - before < 3 * 400

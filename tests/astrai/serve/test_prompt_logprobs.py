"""`echo: true` + `logprobs: N` on /v1/completions scores the prompt (lm-eval's `local-completions`
loglikelihood request), checked against transformers' log-softmax on the served weights; `max_tokens: 0` with echo
only scores. vLLM's `prompt_logprobs` field (chat and completions: ids, log-probs and vocabulary ranks) against the
same reference."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

import astrai

KEY, MODEL = "test-key", "tiny-test"
PROMPTS = [[5, 17, 42, 7, 99, 3], [8, 1, 250]]


@pytest.fixture(scope="module")
def reference(server, tmp_path_factory):
    """transformers on the served model's weights (saved and reloaded)."""
    from transformers import AutoModelForCausalLM

    folder = astrai.save(server.engine.model, tmp_path_factory.mktemp("ref"))
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def _expected(hf, ids: list[int]) -> tuple[list[float], list[int]]:
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist(), logp.argmax(-1).tolist()


def test_lm_eval_loglikelihood_request_scores_the_prompt(server, reference):
    # exactly lm-eval's LocalCompletionsAPI._create_payload(generate=False) for a batch of token-id prompts
    body = {"model": MODEL, "prompt": PROMPTS, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}  # fmt: skip
    r = httpx.post(server.base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip(PROMPTS, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the one generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected, greedy = _expected(reference, ids)
        assert torch.allclose(torch.tensor(lp["token_logprobs"][1 : len(ids)]), torch.tensor(expected), atol=1e-4)
        # lm-eval's is_greedy test: the prompt token's logprob equals the best of its top_logprobs iff it is argmax
        for t in range(1, len(ids)):
            is_greedy = lp["token_logprobs"][t] == max(lp["top_logprobs"][t].values())
            assert is_greedy == (greedy[t - 1] == ids[t])
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))


def test_max_tokens_zero_with_echo_only_scores(server, reference):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        out = client.completions.create(model=MODEL, prompt="hello world", echo=True, logprobs=2, max_tokens=0)
        (choice,) = out.choices
        assert choice.text == "hello world" and choice.finish_reason == "length"
        ids = server.tokenizer.encode("hello world")
        assert len(choice.logprobs.token_logprobs) == len(ids) and choice.logprobs.token_logprobs[0] is None
        expected, _ = _expected(reference, ids)
        assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs[1:]), torch.tensor(expected), atol=1e-4)
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs[1:])  # 2 alternatives + the token itself
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
        chunks = list(client.completions.create(model=MODEL, prompt=["hello world", "the quick"], echo=True,
                                                max_tokens=0, stream=True))  # fmt: skip
        assert sorted(c.choices[0].text for c in chunks) == ["hello world", "the quick"]
        streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=1,
                                                  max_tokens=2, temperature=0, stream=True))  # fmt: skip
        first = streamed[0].choices[0].logprobs
        assert first.token_logprobs[0] is None and len(first.token_logprobs) >= len(PROMPTS[0])
        with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
            client.completions.create(model=MODEL, prompt="hello", max_tokens=0)


# ---- vLLM's `prompt_logprobs` field (chat: beside `choices`; completions: in each choice) ----------------------
def _reference_scores(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)  # [len(ids), V]


def _check_vllm_shape(entries: list, ids: list[int], logp: torch.Tensor, top: int) -> None:
    """vLLM's shape against transformers: null first; then each position holds the prompt token (its log-prob
    and vocabulary rank) and the `top` most likely tokens with ranks 1..top."""
    assert len(entries) == len(ids) and entries[0] is None
    for t in range(1, len(ids)):
        row, entry = logp[t - 1], entries[t]
        own = entry[str(ids[t])]
        assert abs(own["logprob"] - row[ids[t]].item()) < 1e-4
        assert own["rank"] == int((row > row[ids[t]]).sum()) + 1
        best = row.topk(top).indices.tolist() if top else []
        assert set(entry) == {str(ids[t]), *map(str, best)}
        for place, token in enumerate(best, 1):
            if token != ids[t]:
                assert entry[str(token)]["rank"] == place and abs(entry[str(token)]["logprob"] - row[token]) < 1e-4
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())


def test_chat_prompt_logprobs_score_the_rendered_prompt(server, reference):
    auth = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "the quick brown fox"}]
    ids = httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "messages": messages}, headers=auth,
                     timeout=60).json()["tokens"]  # what the chat route renders and submits  # fmt: skip
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                               extra_body={"prompt_logprobs": 3})  # fmt: skip
    _check_vllm_shape(reply.model_extra["prompt_logprobs"], ids, _reference_scores(reference, ids), 3)
    plain = httpx.post(server.base_url + "/v1/chat/completions", headers=auth, timeout=60,
                       json={"model": MODEL, "messages": messages, "max_tokens": 1})  # fmt: skip
    assert "prompt_logprobs" not in plain.json()  # only when asked


def test_completions_prompt_logprobs_per_choice_beside_echo(server, reference):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 1, "n": 2, "prompt_logprobs": 4, "echo": True,
            "logprobs": 1}  # fmt: skip
    reply = httpx.post(server.base_url + "/v1/completions", json=body, headers=auth, timeout=60)
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    for index, choice in enumerate(choices):
        ids = PROMPTS[index // 2]
        _check_vllm_shape(choice["prompt_logprobs"], ids, _reference_scores(reference, ids), 4)
        assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1 : len(ids)])  # echo keeps its 1
    body = {**body, "prompt_logprobs": 0, "echo": False, "logprobs": None}
    choice = httpx.post(server.base_url + "/v1/completions", json=body, headers=auth, timeout=60).json()["choices"][0]
    _check_vllm_shape(choice["prompt_logprobs"], PROMPTS[0], _reference_scores(reference, PROMPTS[0]), 0)
    assert choice["logprobs"] is None  # none asked for: prompt_logprobs alone


@pytest.mark.parametrize(("route", "extra", "message"), [
    ("/v1/chat/completions", {"prompt_logprobs": 2, "stream": True}, "not available when stream is true"),
    ("/v1/chat/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "not available when stream is true"),
    ("/v1/completions", {"prompt_logprobs": "3"}, "prompt_logprobs"),
])  # fmt: skip
def test_prompt_logprobs_bounds_are_400s_naming_the_field(server, route, extra, message):
    body = {"model": MODEL, "max_tokens": 1, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"})
    reply = httpx.post(server.base_url + route, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_logprobs"
    assert message in reply.json()["error"]["message"]

"""Issue 18 through the live server: sampling values that underflow float32 are greedy (temperature) or a 400
naming `param` (penalties, filters, logit_bias); engine-side errors fill `param` too; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

HEADERS = {"Authorization": "Bearer test-key"}
USER = [{"role": "user", "content": "hi"}]


def _chat(server, **fields) -> httpx.Response:
    body = {"model": "tiny-test", "messages": USER, "max_tokens": 6, "ignore_eos": True, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=HEADERS, timeout=60)


def _tokens(response: httpx.Response) -> list[tuple[str, float, str, float]]:
    """(token, logprob, top-1 token, top-1 logprob) per generated position."""
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return [(e["token"], e["logprob"], e["top_logprobs"][0]["token"], e["top_logprobs"][0]["logprob"]) for e in content]


@pytest.mark.parametrize("temperature", [1e-39, 1e-45])
def test_underflowing_temperature_is_greedy(server, temperature):
    """These drew token 0 forever with logprobs that named another top-1; now they are temperature 0's tokens."""
    greedy = _tokens(_chat(server, temperature=0, logprobs=True, top_logprobs=1))
    tiny = _tokens(_chat(server, temperature=temperature, logprobs=True, top_logprobs=1))
    assert [t[0] for t in tiny] == [t[0] for t in greedy] and len(tiny) == 6
    assert all(tok == top and lp == pytest.approx(top_lp, abs=1e-5) for tok, lp, top, top_lp in tiny)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 5e-324),
        ("repetition_penalty", 1e-300),
        ("frequency_penalty", 1e-45),
        ("presence_penalty", -1e-40),
        ("min_p", 5e-324),
        ("top_p", 1e-300),
        ("logit_bias", {"5": 1e-40}),
    ],
)
def test_underflowing_values_are_400s_naming_the_param(server, field, value):
    r = _chat(server, **{field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error" and field in error["message"]
    assert _chat(server, temperature=0).status_code == 200  # still serving


def test_engine_errors_fill_param(server):
    """Checked by the engine itself (not the protocol layer): context overflow and out-of-vocab prompt ids."""
    r = _chat(server, max_tokens=5000)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    body = {"model": "tiny-test", "prompt": [1, 10**6], "max_tokens": 2}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert server.kv_in_use() == 0

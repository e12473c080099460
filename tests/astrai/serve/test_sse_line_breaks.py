"""Every server-sent event is one line for every client: a token holding U+0085, U+2028 or U+2029 (raw in JSON
under ensure_ascii=False, and not an SSE line end) is written as a `\\u` escape, because httpx's `aiter_lines`
splits lines with `str.splitlines` and would cut the event in two (found by benchmarks/bench_soak.py).

Through the session's live server (tests/astrai/serve/conftest.py), the model scripted to say such text, read with
httpx's `aiter_lines` on the OpenAI, Anthropic and Responses streams, and with the openai SDK (its own decoder).
"""

from __future__ import annotations

import json

import httpx
import pytest

API_KEY, MODEL_NAME = "test-key", "tiny-test"  # the conftest server's
HEADERS = {"Authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY}
TEXT = "one\u2028two\x85three\u2029four"
USER = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 64, "stream": True},
    "/v1/completions": {"prompt": "hi", "max_tokens": 64, "stream": True},
    "/v1/messages": {"messages": USER, "max_tokens": 64, "stream": True},
    "/v1/responses": {"input": "hi", "max_output_tokens": 64, "stream": True},
}


def _text(path: str, event: dict) -> str:
    if path == "/v1/chat/completions":
        return "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
    if path == "/v1/completions":
        return "".join(c["text"] for c in event.get("choices", []))
    if path == "/v1/messages":
        return event.get("delta", {}).get("text", "") if event.get("type") == "content_block_delta" else ""
    return event.get("delta", "") if event.get("type") == "response.output_text.delta" else ""


@pytest.mark.parametrize("path", list(BODIES))
def test_stream_events_stay_one_line_for_line_splitting_clients(server, path):
    server.script(TEXT)
    text = ""
    with httpx.stream("POST", server.base_url + path, json={"model": MODEL_NAME, **BODIES[path]}, headers=HEADERS,
                      timeout=30) as response:  # fmt: skip
        assert response.status_code == 200
        for line in response.iter_lines():  # str.splitlines underneath
            assert not line or line.startswith(("data: ", "event: ")), repr(line)
            if line.startswith("data: ") and line != "data: [DONE]":
                text += _text(path, json.loads(line[6:]))
    assert text == TEXT  # the characters arrive intact (positive control: the script was said)


def test_the_sdk_reads_the_same_text(server, oai):
    server.script(TEXT)
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=64, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == TEXT

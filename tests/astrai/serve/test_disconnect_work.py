"""A client that leaves stops its host work (issue 42, item 2): rendering and tokenizing queued behind other
requests never start, and started work stops at its next checkpoint (`astrai/serve/disconnect.py`).

Through the session's live server (tests/astrai/serve/conftest.py) with its tokenizer pool narrowed to one worker
and the tokenizer's `encode_chat` instrumented: a blocker request holds the worker, a victim queues behind it and
hangs up; the victim's prompt must never be encoded. A victim that stays is encoded (positive control).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import anyio
import httpx
import pytest

from astrai.serve import disconnect
from astrai.serve.openai_protocol import parse_completion

API_KEY, MODEL_NAME = "test-key", "tiny-test"  # the conftest server's
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _chat(text: str) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 1}


@pytest.fixture
def one_worker(server, monkeypatch):
    """The live server with one tokenizer worker; `encode_chat` records each prompt and blocks on "BLOCKER"."""
    release, entered, seen = threading.Event(), threading.Event(), []
    original = server.tokenizer.encode_chat

    def encode_chat(messages, *args, **kwargs):
        text = messages[-1]["content"]
        seen.append(text)
        if text == "BLOCKER":
            entered.set()
            release.wait(30)
        return original(messages, *args, **kwargs)

    monkeypatch.setattr(server.tokenizer, "encode_chat", encode_chat)
    monkeypatch.setattr(server.app.state, "_tokenizing", anyio.CapacityLimiter(1))
    yield server, release, entered, seen
    release.set()


def _hang_up_after_queueing(server, text: str) -> None:
    body = json.dumps(_chat(text)).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + body)
        time.sleep(0.3)  # read, and queued for the one worker


@pytest.mark.parametrize("victim_leaves", [True, False])
def test_work_queued_for_a_client_that_left_never_runs(one_worker, victim_leaves):
    server, release, entered, seen = one_worker
    replies: dict[str, httpx.Response] = {}

    def send(name: str) -> None:
        replies[name] = httpx.post(server.base_url + "/v1/chat/completions", json=_chat(name), headers=AUTH,
                                   timeout=30)  # fmt: skip

    blocker = threading.Thread(target=send, args=("BLOCKER",))
    blocker.start()
    assert entered.wait(10), "the blocker never reached the tokenizer"
    if victim_leaves:
        _hang_up_after_queueing(server, "VICTIM")
        release.set()
    else:  # positive control: the victim stays connected and is encoded once the worker is free
        victim = threading.Thread(target=send, args=("VICTIM",))
        victim.start()
        time.sleep(0.3)
        release.set()
        victim.join(30)
        assert replies["VICTIM"].status_code == 200
    blocker.join(30)
    assert replies["BLOCKER"].status_code == 200
    witness = httpx.post(server.base_url + "/v1/chat/completions", json=_chat("WITNESS"), headers=AUTH, timeout=30)
    assert witness.status_code == 200
    assert ("VICTIM" in seen) is not victim_leaves, seen


class _Tokenizer:
    """Sets `gone` once it has encoded `after` prompts (the client leaves mid-list)."""

    def __init__(self, tokenizer, gone: threading.Event, after: int) -> None:
        self.tokenizer, self.gone, self.after, self.encoded = tokenizer, gone, after, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode_nogil(self, *args, **kwargs):
        self.encoded += 1
        if self.encoded >= self.after:
            self.gone.set()
        return self.tokenizer.encode_nogil(*args, **kwargs)


def test_a_prompt_list_stops_tokenizing_at_the_next_prompt(server):
    gone = threading.Event()
    tokenizer = _Tokenizer(server.tokenizer, gone, after=2)
    body = {"prompt": [f"prompt number {i}" for i in range(10)], "max_tokens": 1}
    vocab = server.engine.model.config.vocab_size
    with pytest.raises(disconnect.ClientGone):
        disconnect.run_unless_gone(gone, parse_completion, body, tokenizer, vocab_size=vocab, context=256)
    assert tokenizer.encoded == 2  # the third prompt was never tokenized
    kept = _Tokenizer(server.tokenizer, threading.Event(), after=100)  # positive control: nobody left
    req = disconnect.run_unless_gone(threading.Event(), parse_completion, body, kept, vocab_size=vocab, context=256)
    assert len(req.prompts) == 10 and kept.encoded == 10
    disconnect.checkpoint()  # outside run_unless_gone it does nothing

"""Issue 15 item 5: request logs never hold the API key, nor prompt text unless `log_requests` asks for prompts.

Every log record of every logger that the server side wrote (it runs on threads of this process, so caplog sees
them all) is searched for a marker planted in the prompts and for the API key, the requests sent through the
official SDKs to the live server; the same requests with `log_requests` on are the control that the marker would
be seen.
"""

from __future__ import annotations

import logging
import threading

import anthropic
import openai
import pytest

from astrai.serve.app import build_app
from astrai.serve.common import PROMPT_LOG_CHARS

KEY = "test-key"
SECRET = "zebra-quartz-7731"  # planted in every prompt


def _traffic(server) -> None:
    """One request of each kind, each prompt holding SECRET, one of them longer than PROMPT_LOG_CHARS."""
    server.script("ok")
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as sdk:
        sdk.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": f"chat {SECRET}"}])
        sdk.chat.completions.create(
            model="tiny-test", messages=[{"role": "user", "content": f"s {SECRET}"}], stream=True
        )
        sdk.completions.create(model="tiny-test", prompt=f"legacy {SECRET} " + "x" * 1000, temperature=0.5)
        sdk.completions.create(model="tiny-test", prompt=["first prompt", f"second {SECRET}"])
        with pytest.raises(openai.BadRequestError):
            sdk.chat.completions.create(
                model="tiny-test", messages=[{"role": "user", "content": SECRET}], temperature=9
            )
    with anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60) as sdk:
        sdk.messages.create(model="tiny-test", max_tokens=4, messages=[{"role": "user", "content": f"claude {SECRET}"}])
    server.wait_idle()


def _logged(caplog) -> str:
    """Every record the server side logged: its threads (uvicorn's, the engine's, the tokenizer workers'), not
    this test's thread, where the SDKs' own debug logs show the request they send."""
    here = threading.get_ident()
    return "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records if r.thread != here)


def test_no_prompt_and_no_key_in_logs_by_default(server, caplog, monkeypatch):
    assert server.app.state.log_requests is False  # build_app's default
    with caplog.at_level(logging.DEBUG):
        _traffic(server)
        with monkeypatch.context() as patch:  # a bug while serving: logged with its traceback, still no prompt
            patch.setattr(server.engine, "submit", lambda *a, **k: 1 / 0)
            with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as sdk:
                with pytest.raises(openai.InternalServerError):
                    sdk.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": SECRET}])
    text = _logged(caplog)
    assert "internal error in POST /v1/chat/completions" in text and "ZeroDivisionError" in text  # seen here
    assert SECRET not in text and KEY not in text


def test_log_requests_logs_prompts_truncated_but_never_the_key(server, caplog, monkeypatch):
    monkeypatch.setattr(server.app.state, "log_requests", True)
    with caplog.at_level(logging.DEBUG):
        _traffic(server)
    lines = [r.getMessage() for r in caplog.records if r.name == "astrai.serve" and r.levelno == logging.INFO]
    assert KEY not in _logged(caplog)
    by_route = {route: [line for line in lines if f" {route} " in line]
                for route in ("/v1/chat/completions", "/v1/completions", "/v1/messages")}  # fmt: skip
    assert all(SECRET in " ".join(found) for found in by_route.values()), lines
    (legacy,) = [line for line in by_route["/v1/completions"] if "legacy" in line]
    assert "x" * PROMPT_LOG_CHARS not in legacy and "characters)" in legacy and "temperature=0.5" in legacy
    listed = by_route["/v1/completions"]
    assert any("[0] " in line and "first prompt" in line for line in listed)
    assert any("[1] " in line and SECRET in line for line in listed)


def test_build_app_passes_the_flag(server):
    assert build_app(server.engine, log_requests=True).state.log_requests is True
    assert build_app(server.engine).state.log_requests is False

"""Issue 18, item 4: client input is answered 4xx in the API's shape, never 500; a real 500 is logged with its
traceback and tells the client only a request id.

The attacks go to the live server as raw bytes (a lone surrogate escape, UTF-8-encoded surrogates, JSON nested
10,000 levels, a 5,000-digit integer), so the server's own JSON parsing meets them; each is followed by a normal
request that must still work.
"""

import json
import logging
import re

import httpx
import pytest

from astrai.serve.common import MAX_JSON_DEPTH, APIError, parse_json

OPENAI = {"Authorization": "Bearer test-key", "content-type": "application/json"}
ANTHROPIC = {"x-api-key": "test-key", "anthropic-version": "2023-06-01", "content-type": "application/json"}
CHAT = '{"model": "tiny-test", "messages": [{"role": "user", "content": %s}], "max_tokens": %s%s}'
COMPLETION = '{"model": "tiny-test", "prompt": %s, "max_tokens": %s%s}'
# (path, body template, headers, API shape)
ENDPOINTS = [
    ("/v1/chat/completions", CHAT, OPENAI, "openai"),
    ("/v1/completions", COMPLETION, OPENAI, "openai"),
    ("/v1/messages", CHAT, ANTHROPIC, "anthropic"),
    ("/v1/messages/count_tokens", CHAT, ANTHROPIC, "anthropic"),
]
DIGITS = "7" * 5000  # over Python's 4,300-digit int parsing limit
# (name, text, max_tokens, extra fields, words the 400 message must hold)
ATTACKS = [
    ("lone high surrogate", r'"a\ud800b"', "2", "", ["surrogate"]),
    ("lone low surrogate", r'"a\udc00b"', "2", "", ["surrogate"]),
    ("surrogate at the end", r'"ab\udbff"', "2", "", ["surrogate"]),
    ("surrogate in a stop string", '"hi"', "2", r', "stop": ["x\ud800"]', ["surrogate"]),
    ("surrogate in a key", '"hi"', "2", r', "\ud800": 1', ["surrogate"]),
    ("utf-8-encoded surrogate", '"a\xed\xa0\x80b"', "2", "", ["UTF-8"]),
    ("nested 10,000 levels", '"hi"', "2", ', "x": ' + "[" * 10_000 + "]" * 10_000, [str(MAX_JSON_DEPTH)]),
    (
        "nested past the limit",
        '"hi"',
        "2",
        ', "x": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH,
        [str(MAX_JSON_DEPTH)],
    ),  # fmt: skip
    ("5,000-digit max_tokens", '"hi"', DIGITS, "", ["number"]),
    ("5,000-digit seed", '"hi"', "2", f', "seed": -{DIGITS}', ["number"]),
]


def _raw(template: str, text: str, max_tokens: str, extra: str) -> bytes:
    # latin-1 keeps the attack's bytes as written (the \xed\xa0\x80 case); everything else is ASCII
    return (template % (text, max_tokens, extra)).encode("latin-1")


def _assert_shape(response: httpx.Response, status: int, api: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    if api == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["message"]


@pytest.mark.parametrize(("path", "template", "headers", "api"), ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_hostile_json_is_a_400_in_the_api_shape(server, path, template, headers, api):
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as client:
        for name, text, max_tokens, extra, words in ATTACKS:
            response = client.post(path, content=_raw(template, text, max_tokens, extra))
            message = _assert_shape(response, 400, api)
            assert all(word in message for word in words), (name, message)
            assert "Error" not in message and "Traceback" not in message, (name, message)  # no exception text
        fine = client.post(path, content=_raw(template, '"hi"', "2", ""))
        assert fine.status_code == 200, fine.text


def test_allowed_input_near_the_limits_still_works(server):
    deep = ', "metadata": ' + '{"a": ' * (MAX_JSON_DEPTH - 1) + "1" + "}" * (MAX_JSON_DEPTH - 1)
    pair = r'"emoji \ud83d\ude00 ok"'  # a surrogate *pair* escape is one valid character
    with httpx.Client(base_url=server.base_url, headers=OPENAI, timeout=30) as client:
        assert client.post("/v1/chat/completions", content=_raw(CHAT, pair, "2", deep)).status_code == 200
        assert client.post("/v1/chat/completions", content=_raw(CHAT, '"hi"', "2", ', "seed": 4300')).status_code == 200


def test_parse_json_limits():
    assert parse_json(b'{"a": [[1]]}') == {"a": [[1]]}
    assert parse_json('\ufeff{"s": "\\ud83d\\ude00"}'.encode()) == {"s": "\U0001f600"}  # BOM; a valid pair
    assert parse_json(b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}")
    assert parse_json(b'{"ids": [' + b"1, " * 100_000 + b'1], "s": "\\\\ud800"}')["s"] == "\\ud800"  # escaped \
    bad = [b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}", b'{"s": "\\udfff"}',
           b'{"n": 1' + b"0" * 4300 + b"}", b"[1]", b"{", b'{"s": "\xff"}']  # fmt: skip
    for raw in bad:
        with pytest.raises(APIError) as err:
            parse_json(raw)
        assert err.value.status == 400, raw[:40]


def _logged_internal_error(caplog, request_id: str) -> logging.LogRecord:
    records = [r for r in caplog.records if r.name == "astrai.serve" and request_id in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    assert records[0].exc_info is not None and "secret-detail" in str(records[0].exc_info[1])  # the traceback
    return records[0]


def _boom(*args, **kwargs):
    raise RuntimeError("secret-detail /internal/path")


@pytest.mark.parametrize(("path", "headers", "api"), [("/v1/chat/completions", OPENAI, "openai"),
                                                      ("/v1/messages", ANTHROPIC, "anthropic")])  # fmt: skip
def test_a_bug_is_a_logged_500_with_a_request_id_only(server, monkeypatch, caplog, path, headers, api):
    caplog.set_level(logging.ERROR, logger="astrai.serve")
    body = _raw(CHAT, '"hi"', "2", "")
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as client:
        monkeypatch.setattr(server.engine, "submit", _boom)  # a handler dependency fails unexpectedly
        response = client.post(path, content=body)
        message = _assert_shape(response, 500, api)
        assert "secret" not in response.text and "RuntimeError" not in response.text
        request_id = re.fullmatch(r"internal error; request id (req-[0-9a-f]+)", message).group(1)
        _logged_internal_error(caplog, request_id)
        monkeypatch.undo()
        assert client.post(path, content=body).status_code == 200


class _FailingHandle:
    """A request handle whose stream fails after the 200 went out."""

    completion = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        _boom()

    def abort(self) -> None:
        pass


@pytest.mark.parametrize(("path", "headers"), [("/v1/chat/completions", OPENAI), ("/v1/messages", ANTHROPIC)])
def test_a_bug_mid_stream_is_logged_and_ends_the_stream_with_a_generic_error_event(server, monkeypatch, caplog, path,
                                                                                 headers):  # fmt: skip
    caplog.set_level(logging.ERROR, logger="astrai.serve")
    monkeypatch.setattr(server.engine, "submit", lambda *args, **kwargs: _FailingHandle())
    body = _raw(CHAT, '"hi"', "2", ', "stream": true')
    response = httpx.post(server.base_url + path, content=body, headers=headers, timeout=30)
    assert response.status_code == 200 and "secret" not in response.text
    last = response.text.strip().split("\n\n")[-1]
    data = json.loads(last.split("data: ", 1)[1])
    if path == "/v1/messages":
        assert last.startswith("event: error\n") and data["type"] == "error"
    message = data["error"]["message"]
    _logged_internal_error(caplog, re.fullmatch(r"internal error; request id (req-[0-9a-f]+)", message).group(1))

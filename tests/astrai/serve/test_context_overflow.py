"""A request longer than the context, as the clients that act on it see it (issue 41, item 4).

OpenAI's shape: 400, `code: "context_length_exceeded"`, OpenAI's "This model's maximum context length is N tokens"
wording with the numbers, `param` naming the field to shorten. Anthropic's: "prompt is too long: N tokens > M
maximum" and "input length and `max_tokens` exceed context limit". The independent check is litellm's own
exception mapping (the real client, through `litellm.completion` against the live server): it must raise its
`ContextWindowExceededError`, which drives its fallbacks and trimming, for both providers. Negative control: a
request that fits is answered, and a different 400 (a bad temperature) is not classified as a context error.
"""

from __future__ import annotations

import os

import httpx
import openai
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise
import litellm  # noqa: E402

from tests.astrai.serve.conftest import API_KEY

# litellm's own import-time and call-time warnings (pydantic's ReadOnly TypedDict note), not this server's
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning")


def context(server) -> int:
    engine = server.engine
    return min(engine.max_model_len, (engine.pool.num_pages - 1) * engine.config.page_size)


def long_text(server) -> str:
    return "hello world " * context(server)


def test_openai_sdk_sees_the_code_and_numbers(server, oai):
    client = oai
    n = context(server)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": long_text(server)}])
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    assert body["message"].startswith(f"This model's maximum context length is {n} tokens. However, your messages "
                                      "resulted in ")  # fmt: skip
    with pytest.raises(openai.BadRequestError) as err:  # fits alone, not with the completion asked for
        client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}], max_tokens=n)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "max_tokens"
    assert f", {n} in the completion)" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-test", prompt=long_text(server), max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:  # negative control: another 400 carries no such code
        client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert err.value.body["code"] != "context_length_exceeded"


def _litellm(server, provider: str, content: str, **kw):
    base = server.base_url + ("/v1" if provider == "openai" else "")
    return litellm.completion(model=f"{provider}/tiny-test", api_base=base, api_key=API_KEY, num_retries=0,
                              messages=[{"role": "user", "content": content}], **kw)  # fmt: skip


@pytest.mark.usefixtures("close_litellm_loop")
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_litellm_classifies_the_overflow_as_a_context_window_error(server, provider):
    server.script("fine")
    try:
        with pytest.raises(litellm.ContextWindowExceededError):
            _litellm(server, provider, long_text(server), max_tokens=4)
        with pytest.raises(litellm.ContextWindowExceededError):  # prompt + max_tokens past the context
            _litellm(server, provider, "hi", max_tokens=context(server))
        with pytest.raises(litellm.BadRequestError) as err:  # negative control: not every 400 is an overflow
            _litellm(server, provider, "hi", max_tokens=4, temperature=-1)
        assert not isinstance(err.value, litellm.ContextWindowExceededError)
        reply = _litellm(server, provider, "hi", max_tokens=4)  # and a request that fits is answered
        assert reply.choices[0].message.content == "fine"
    finally:
        server.script(None)
    assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"

"""Reasoning parsers (`--reasoning-parser qwen3|deepseek_r1`): the `<think>` split on its own (expected values
written out by hand; streaming equals one-shot at every split), where the output starts from the prompt, and
the split through the live server with the official SDKs: OpenAI `reasoning_content` (whole and streamed),
Anthropic `thinking` blocks (whole and streamed), tool calls after the reasoning, and `enable_thinking` reaching
the chat template from both APIs.
"""

from __future__ import annotations

import json

import anthropic
import pytest

from astrai.cli._common import parse as cli_parse
from astrai.cli.serve import ServeConfig
from astrai.serve.anthropic_protocol import parse_request, render_prompt
from astrai.serve.openai_protocol import parse_chat
from astrai.serve.reasoning import AnswerDelta, ReasoningDelta, ReasoningParser, prompt_start, split, start_state
from astrai.serve.state import ServerState

# (parser, start, output, expected reasoning, expected answer)
CASES = [
    ("qwen3", "undecided", "<think>\nAdd 2 and 2.\n</think>\n\nThe answer is 4.", "Add 2 and 2.", "The answer is 4."),
    ("qwen3", "undecided", "The answer is 4.", None, "The answer is 4."),  # Qwen3 without thinking: all answer
    ("qwen3", "undecided", "  <think>x</think>y", "x", "y"),
    ("qwen3", "reasoning", "Add 2 and 2.\n</think>\n\n4", "Add 2 and 2.", "4"),  # <think> was in the prompt
    ("qwen3", "answer", "4 </think> <think>", None, "4 </think> <think>"),  # enable_thinking false: tags are text
    ("deepseek_r1", "undecided", "Add 2 and 2.\n</think>\n\n4", "Add 2 and 2.", "4"),  # R1 skips the open tag
    ("deepseek_r1", "undecided", "<think>\nhm\n</think>4", "hm", "4"),
    (
        "deepseek_r1",
        "undecided",
        "still thinking when the budget ran out\n",
        "still thinking when the budget ran out",
        "",
    ),  # fmt: skip
    ("qwen3", "undecided", "<think>\nline one\n\nline two\n</think>", "line one\n\nline two", ""),
    ("qwen3", "undecided", "<thin", None, "<thin"),  # not a tag after all
    ("qwen3", "undecided", "<think></think>\n\nok", None, "ok"),  # an empty think block
]


@pytest.mark.parametrize(("name", "start", "output", "reasoning", "answer"), CASES)
def test_split_and_every_streaming_split_agree(name, start, output, reasoning, answer):
    assert split(name, output, start) == (reasoning, answer)
    cuts = [[output[:i], output[i:]] for i in range(len(output) + 1)] + [list(output)]
    for chunks in cuts:
        parser = ReasoningParser(name, start)
        events = [e for c in chunks for e in parser.feed(c)] + parser.finish()
        got_r = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        got_a = "".join(e.text for e in events if isinstance(e, AnswerDelta))
        assert (got_r or None, got_a) == (reasoning, answer), chunks
        assert all(e.text for e in events)  # no empty deltas


def test_start_state_reads_the_prompt_end():
    assert start_state("<|im_start|>assistant\n") == "undecided"
    assert start_state("<|im_start|>assistant\n<think>\n") == "reasoning"  # DeepSeek-R1, Qwen3 thinking-2507
    assert start_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "answer"  # enable_thinking: false
    assert start_state("<|im_start|>assistant\n<think>\n", constrained=True) == "answer"  # a grammar: no thinking
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        ReasoningParser("nope")


QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def test_enable_thinking_and_earlier_reasoning_reach_the_template(server):
    tok = server.tokenizer.with_chat_template(QWEN3_LIKE)
    limits = dict(vocab_size=tok.vocab_size, context=4096)
    messages = [{"role": "user", "content": "2+2?"}]
    text = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    off = parse_chat({"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}, tok, **limits)
    on = parse_chat({"messages": messages}, tok, **limits)
    assert text(off.prompt).endswith("<think>\n\n</think>\n\n") and not text(on.prompt).endswith("</think>\n\n")
    assert prompt_start(tok, off.prompt, constrained=False) == "answer"
    assert prompt_start(tok, on.prompt, constrained=False) == "undecided"
    history = [*messages, {"role": "assistant", "content": "4", "reasoning_content": "two plus two"},
               {"role": "user", "content": "and 3+3?"}]  # fmt: skip
    assert "<think>\ntwo plus two\n</think>" in text(parse_chat({"messages": history}, tok, **limits).prompt)

    body = {"model": "tiny-test", "max_tokens": 2048, "messages": messages}
    disabled = render_prompt(tok, parse_request({**body, "thinking": {"type": "disabled"}}))
    enabled = render_prompt(tok, parse_request({**body, "thinking": {"type": "enabled", "budget_tokens": 1024}}))
    assert text(disabled).endswith("<think>\n\n</think>\n\n") and not text(enabled).endswith("</think>\n\n")
    turn = {"role": "assistant", "content": [{"type": "thinking", "thinking": "two plus two", "signature": "s"},
                                              {"type": "redacted_thinking", "data": "opaque"},
                                              {"type": "text", "text": "4"}]}  # fmt: skip
    req = parse_request({**body, "messages": [*messages, turn, {"role": "user", "content": "and 3+3?"}]})
    assert "<think>\ntwo plus two\n</think>\n\n4" in text(render_prompt(tok, req))
    for bad, field in [({"type": "enabled", "budget_tokens": 10}, "1024"), ({"type": "enabled"}, "budget_tokens"),
                       ({"type": "enabled", "budget_tokens": 4096}, "less than max_tokens"),
                       ({"type": "sometimes"}, "thinking.type")]:  # fmt: skip
        with pytest.raises(Exception, match=field):
            parse_request({**body, "thinking": bad})


@pytest.fixture
def thinking_server(server, monkeypatch):
    monkeypatch.setattr(server.app.state, "reasoning_parser", "qwen3")
    return server


SAID = "<think>\nThe user adds 2 and 2.\n</think>\n\nThe answer is 4."
MSGS = [{"role": "user", "content": "What is 2+2?"}]


def test_openai_reasoning_content_whole_and_streamed(thinking_server, oai):
    thinking_server.script(SAID)
    msg = oai.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=64).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("The user adds 2 and 2.", "The answer is 4.")
    reasoning = content = ""
    for chunk in oai.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=64, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == ("The user adds 2 and 2.", "The answer is 4.")


def test_without_a_parser_the_text_is_left_alone(server, oai):
    server.script(SAID)  # negative control: the default server does not split
    msg = oai.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=64).choices[0].message
    assert msg.content.startswith("<think>") and getattr(msg, "reasoning_content", None) is None


def test_tool_calls_are_parsed_after_the_reasoning(thinking_server, oai):
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    thinking_server.script(f"<think>\nI need the weather.\n</think>\n\n<tool_call>\n{json.dumps(call)}\n</tool_call>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    choice = oai.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=512, tools=tools).choices[0]
    assert choice.message.reasoning_content == "I need the weather." and choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert choice.message.content is None


def test_anthropic_thinking_blocks_whole_and_streamed(thinking_server, anth):
    thinking_server.script(SAID)
    kw = dict(model="tiny-test", max_tokens=1500, messages=MSGS, thinking={"type": "enabled", "budget_tokens": 1024})
    reply = anth.messages.create(**kw)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert (reply.content[0].thinking, reply.content[1].text) == ("The user adds 2 and 2.", "The answer is 4.")
    with anth.messages.stream(**kw) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds and "text_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in reply.content]


def test_anthropic_thinking_needs_a_parser(server, anth):
    with pytest.raises(anthropic.BadRequestError, match="--reasoning-parser"):
        anth.messages.create(model="tiny-test", max_tokens=1500, messages=MSGS,
                               thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip


def test_setting_and_flag():
    assert cli_parse(ServeConfig, ["m", "--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    assert cli_parse(ServeConfig, ["m"]).reasoning_parser is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ServerState(engine=None, model_name="m", reasoning_parser="qwen4")

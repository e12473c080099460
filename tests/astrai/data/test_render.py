"""Rendering records: ids equal the tokenizer's own chat rendering; masks equal transformers' assistant masks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astrai.data.config import config_from_dict
from astrai.data.render import ChatPart, RecordError, plan_side, render_batch, render_conversation, truncate
from astrai.io.templates import chatml_template
from astrai.io.tokenizer import Tokenizer

SFT = {"kind": "sft", "inputs": ["x.jsonl"], "sections": [{"field": "messages", "action": "$role", "template": True}]}


def _cfg(**kw):
    return config_from_dict({**SFT, **kw})


@pytest.fixture(scope="module")
def hf_tokenizer(tok_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


def _render_one(tokenizer, record, cfg=None):
    cfg = cfg or _cfg()
    (result,) = render_batch(tokenizer, [record], cfg, [cfg.sections])
    if isinstance(result, RecordError):
        raise result
    return result[0]


def _reference(hf_tokenizer, messages):
    out = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=False, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


CONVERSATIONS = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the quick brown fox"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "héllo wörld 你好"},
        {"role": "assistant", "content": "lazy dog 🐕"},
        {"role": "user", "content": "again?"},
        {"role": "assistant", "content": ""},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "system-unicode-empty", "ends-with-user"])
def test_chat_ids_and_masks_match_transformers(tokenizer, hf_tokenizer, messages):
    doc = _render_one(tokenizer, {"messages": messages})
    ids, mask = _reference(hf_tokenizer, messages)
    assert (
        doc.ids.tolist() == ids == tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    )
    assert doc.mask.tolist() == mask


_text = st.text(alphabet=st.sampled_from("abcdefghij xyz,.!é你🐕\n"), max_size=20)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(_text, _text), min_size=1, max_size=4), system=st.none() | _text)
def test_random_conversations_match_transformers(tokenizer, hf_tokenizer, turns, system):
    messages = [{"role": "system", "content": system}] if system is not None else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    doc = _render_one(tokenizer, {"messages": messages})
    assert (doc.ids.tolist(), doc.mask.tolist()) == _reference(hf_tokenizer, messages)


def test_role_map_and_fixed_actions(tokenizer):
    messages = CONVERSATIONS[1]
    everything = _render_one(tokenizer, {"messages": messages}, _cfg(mask={"user": "train"}, mask_default="train"))
    # users and system train too now; only the assistant headers stay masked
    decoded = tokenizer.decode(everything.ids[everything.mask == 0].tolist(), skip_special_tokens=False)
    assert decoded == "<|im_start|>assistant\n<|im_start|>assistant\n"
    fixed = _cfg(sections=[{"field": "messages", "action": "mask", "template": True}])
    (result,) = render_batch(tokenizer, [{"messages": messages}], fixed, [fixed.sections])
    assert result[0].mask.sum() == 0


def test_tool_calls_and_consecutive_tool_results_with_bundled_chatml(tokenizer):
    tok = Tokenizer(tokenizer.backend, special_tokens=tokenizer.special_tokens_map, chat_template=chatml_template())
    call = {"type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "warm"},
        {"role": "assistant", "content": "It is sunny and warm."},
    ]
    doc = _render_one(tok, {"messages": messages})
    assert doc.ids.tolist() == tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    # the trained text is exactly both assistant turns' bodies (independent of how spans were attributed)
    trained = tok.decode(doc.ids[doc.mask == 1].tolist(), skip_special_tokens=False)
    calls = '<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert trained == f"{calls}\n{calls}<|im_end|>\nIt is sunny and warm.<|im_end|>\n"


def test_generation_prompt_is_masked_and_last(tokenizer):
    part = ChatPart([{"role": "user", "content": "hi"}], [False], generation_prompt=True)
    text, segments = render_conversation(tokenizer, part)
    assert text == tokenizer.apply_chat_template(part.messages, add_generation_prompt=True)
    assert segments[-1] == (len(text) - len("<|im_start|>assistant\n"), len(text), False)


def test_template_that_rewrites_earlier_turns_is_rejected(tokenizer):
    # shows only the last assistant message's content: earlier contents vanish once a later turn exists
    template = (
        "{% for m in messages %}<{{ m.role }}>{% if m.role != 'assistant' or loop.last %}{{ m.content }}"
        "{% endif %}</{{ m.role }}>{% endfor %}"
    )
    tok = Tokenizer(tokenizer.backend, special_tokens=tokenizer.special_tokens_map, chat_template=template)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "secret"}]
    _render_one(tok, {"messages": messages})  # fine when the assistant is last
    with pytest.raises(RecordError) as err:
        _render_one(tok, {"messages": [*messages, {"role": "user", "content": "again"}]})
    assert err.value.reason == "template_not_prefix"


def test_text_sections_and_string_messages(tokenizer):
    cfg = _cfg(
        sections=[
            {"field": "title", "action": "mask"},
            {"field": "q", "template": True, "role": "user", "action": "mask"},
            {"field": "a", "template": True, "role": "assistant", "action": "train"},
            {"field": "note", "action": "train", "optional": True},
        ]
    )
    record = {"title": "the fox", "q": "hello", "a": "world"}
    doc = _render_one(tokenizer, record, cfg)
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    expected = tokenizer.encode("the fox") + tokenizer.apply_chat_template(
        chat, add_generation_prompt=False, tokenize=True
    )
    assert doc.ids.tolist() == expected
    assert tokenizer.decode(doc.ids[doc.mask == 1].tolist(), skip_special_tokens=False) == "world<|im_end|>\n"


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({}, "missing_field"),
        ({"messages": None}, "missing_field"),
        ({"messages": "hello"}, "wrong_type"),
        ({"messages": [{"content": "no role"}]}, "wrong_type"),
        ({"messages": [{"role": "user", "content": 3}]}, "wrong_type"),
        ({"messages": []}, "empty"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "template_error"),
    ],
)
def test_bad_records_raise_a_counted_reason(tokenizer, record, reason):
    with pytest.raises(RecordError) as err:
        _render_one(tokenizer, record)
    assert err.value.reason == reason


def test_char_limits(tokenizer):
    cfg = _cfg(preprocessing={"min_chars": 6, "max_chars": 10})
    short = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]}
    long = {"messages": [{"role": "user", "content": "abcdef"}, {"role": "assistant", "content": "ghijk"}]}
    ok = {"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "def"}]}
    results = render_batch(tokenizer, [short, long, ok], cfg, [cfg.sections])
    assert [r.reason for r in results[:2]] == ["too_short", "too_long"]
    assert not isinstance(results[2], RecordError)


def test_batch_equals_one_by_one(tokenizer):
    records = [{"messages": m} for m in CONVERSATIONS] + [{"messages": 5}]
    cfg = _cfg()
    batched = render_batch(tokenizer, records, cfg, [cfg.sections])
    for record, got in zip(records, batched, strict=True):
        (alone,) = render_batch(tokenizer, [record], cfg, [cfg.sections])
        if isinstance(alone, RecordError):
            assert got.reason == alone.reason
        else:
            assert got[0].ids.tolist() == alone[0].ids.tolist() and got[0].mask.tolist() == alone[0].mask.tolist()


def test_plan_merges_consecutive_template_sections(tokenizer):
    cfg = _cfg(
        sections=[
            {"field": "p", "template": True, "role": "user", "action": "mask"},
            {"field": "r", "template": True, "role": "assistant", "action": "train"},
        ]
    )
    (part,) = plan_side({"p": "q", "r": "a"}, cfg.sections, cfg)
    assert [m["role"] for m in part.messages] == ["user", "assistant"] and part.trained == [False, True]


def test_truncate_keeps_the_chosen_end():
    from astrai.data.render import Doc

    doc = Doc(np.arange(10), np.arange(10) % 2)
    start, cut = truncate(doc, 4, "keep_start")
    end, _ = truncate(doc, 4, "keep_end")
    assert cut and start.ids.tolist() == [0, 1, 2, 3] and end.ids.tolist() == [6, 7, 8, 9]
    assert end.mask.tolist() == [0, 1, 0, 1]
    assert truncate(doc, None, "keep_start") == (doc, False)

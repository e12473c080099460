"""Chat template rendering against transformers' apply_chat_template as the reference.

Every rendering test renders the same conversation with our Tokenizer and with transformers'
``AutoTokenizer.from_pretrained`` over the same saved folder, and requires identical text (and ids).
"""

import json
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from astrai.io.chat_template import render_chat_template
from astrai.io.tokenizer import Tokenizer, train_tokenizer

ASSET = Path(__file__).parents[2] / "assets" / "chatml_tools.jinja"
CORPUS = [
    "<|im_start|>user\nWhat is the weather in Paris today?<|im_end|>\n",
    "<|im_start|>assistant\nIt is sunny, 22 degrees.<|im_end|>\n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "你好，世界！天气很好。 Emoji: 😀🎉",
] * 8

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city <in °C>.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name, e.g. 東京"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {}}},
]
TOOL_TURN = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}},
    ],
}
CONVERSATIONS = {
    "system_user": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}],
    "user_only": [{"role": "user", "content": "Bonjour, ça va ? 😀"}],
    "multi_turn": [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "天气怎么样？"},
    ],
    "tool_calls": [
        {"role": "user", "content": "Weather in Paris, and the time?"},
        TOOL_TURN,
        {"role": "tool", "name": "get_weather", "content": '{"temp": 22}'},
        {"role": "tool", "name": "now", "content": "12:00"},
        {"role": "assistant", "content": "22 °C at noon."},
    ],
    "tool_call_with_text": [
        {"role": "user", "content": "Weather?"},
        {**TOOL_TURN, "content": "Let me check."},
        {"role": "tool", "content": "sunny"},
    ],
}


def _save(tokenizer: Tokenizer, folder: Path) -> tuple[Tokenizer, object]:
    tokenizer.save(folder)
    return Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, object]:
    tok = train_tokenizer(CORPUS, vocab_size=420, chat_template=ASSET.read_text(encoding="utf-8"))
    return _save(tok, tmp_path_factory.mktemp("chatml"))


def _pair(tmp_path: Path, template, **special) -> tuple[Tokenizer, object]:
    return _save(train_tokenizer(CORPUS, vocab_size=300, chat_template=template, **special), tmp_path)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chatml_tools_matches_transformers(chatml, name: str, with_tools: bool, add_generation_prompt: bool) -> None:
    ours, hf = chatml
    messages, tools = CONVERSATIONS[name], TOOLS if with_tools else None
    kw = {"tools": tools, "add_generation_prompt": add_generation_prompt}
    text = ours.apply_chat_template(messages, **kw)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kw)
    ids = ours.apply_chat_template(messages, tokenize=True, **kw)
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_chatml_render_shape(chatml) -> None:
    # The asset itself must do what it claims, independently of transformers agreeing with us.
    text = chatml[0].apply_chat_template(CONVERSATIONS["tool_calls"], tools=TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '{"name": "now", "arguments": {"tz": "UTC"}}' in text  # string arguments are not re-encoded
    assert "<|im_start|>user\n<tool_response>\n" in text and text.count("<|im_start|>user") == 2
    assert "None" not in text and text.endswith("<|im_start|>assistant\n")


def test_messages_are_not_mutated(chatml) -> None:
    messages = json.loads(json.dumps(CONVERSATIONS["tool_calls"]))
    chatml[0].apply_chat_template(messages, tools=TOOLS)
    assert messages == CONVERSATIONS["tool_calls"]


def test_raise_exception_message_surfaces(chatml, tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    ours, hf = _pair(tmp_path, template)
    messages = [{"role": "assistant", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="must start with a user turn"):
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ValueError, match="Conversations must start with a user turn"):
        ours.apply_chat_template(messages)
    with pytest.raises(ValueError, match="Unknown message role: robot"):  # the asset's own check
        chatml[0].apply_chat_template([{"role": "robot", "content": "beep"}])


def test_tojson_options_and_no_html_escaping(tmp_path: Path) -> None:
    template = (
        "{{ tools | tojson(indent=2) }}\n{{ tools | tojson(sort_keys=true, separators=(',', ':')) }}\n"
        "{% for m in messages %}{{ m | tojson }}|{{ m.content | tojson(ensure_ascii=true) }}\n{% endfor %}"
    )
    ours, hf = _pair(tmp_path, template)
    messages = [{"role": "user", "content": "<b>&'\"中文😀</b>"}]
    expected = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert ours.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False) == expected
    assert "<b>&'" in expected and json.dumps(TOOLS, indent=2, ensure_ascii=False) in expected


def test_special_token_variables(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
        "{{ pad_token }}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    ours, hf = _pair(tmp_path, template, bos_token="<|begin|>")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for gen in (False, True):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
        ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True) == ids
    assert expected.startswith("<|begin|>[user]hi<|im_end|>")
    # Caller variables override the special-token ones, as in transformers.
    kw = {"eos_token": "</e>", "add_generation_prompt": False}
    assert ours.apply_chat_template(messages, **kw) == hf.apply_chat_template(messages, tokenize=False, **kw)


def test_jinja_features_match(tmp_path: Path) -> None:
    template = (
        "    {% if true %}lstrip_blocks drops the indent{% endif %}\n"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m.content | trim }}{% endgeneration %}\n{% endfor %}"
        "{{ ns.n }}|{{ dict(a=1) | tojson }}|{{ strftime_now('%Y') }}|{{ enable_thinking }}|"
        "{{ messages[-1].reasoning_content }}|{{ messages[-1].thinking }}|{{ messages[0].keys() | list | tojson }}"
        "{% for d in documents %}|{{ d.title }}: {{ d.text }}{% endfor %}"
    )
    ours, hf = _pair(tmp_path, template)
    messages = [
        {"role": "system", "content": "  sys  ", "name": None},
        {"role": "user", "content": " a "},
        {"role": "assistant", "content": "b", "reasoning": "because"},
    ]
    kw = {"enable_thinking": False, "documents": [{"title": "Doc", "text": "Body"}]}
    expected = hf.apply_chat_template(messages, tokenize=False, **kw)
    assert ours.apply_chat_template(messages, add_generation_prompt=False, **kw) == expected
    assert expected.endswith("|Doc: Body") and "|because|because|" in expected
    assert expected.startswith("lstrip_blocks drops the indent")  # no leading spaces
    assert '["role", "content"]' in expected  # the None-valued key was dropped


def test_continue_final_message(chatml) -> None:
    ours, hf = chatml
    messages = [{"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": "1, 2,"}]
    kw = {"continue_final_message": True, "add_generation_prompt": False}
    expected = hf.apply_chat_template(messages, tokenize=False, **kw)
    assert ours.apply_chat_template(messages, **kw) == expected
    assert expected.endswith("<|im_start|>assistant\n1, 2,")


def test_named_templates_list_form(tmp_path: Path) -> None:
    default = "{% for m in messages %}D:{{ m.content }};{% endfor %}"
    tool_use = (
        "{% for t in tools or [] %}T:{{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tok = train_tokenizer(CORPUS, vocab_size=300)
    tok.save(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    config_path.write_text(json.dumps(config))
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.chat_template == default and set(ours.chat_templates) == {"default", "tool_use"}
    for tools in (None, TOOLS):
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=False) == expected
    assert ours.apply_chat_template(messages, tools=TOOLS).startswith("T:get_weather;")
    assert ours.apply_chat_template(messages, chat_template="tool_use") == "hi"
    # Saving keeps both templates, and both loaders still agree.
    ours.save(tmp_path / "resaved")
    again = AutoTokenizer.from_pretrained(tmp_path / "resaved")
    assert Tokenizer.from_dir(tmp_path / "resaved").chat_templates == ours.chat_templates
    assert again.apply_chat_template(messages, tools=TOOLS, tokenize=False) == "T:get_weather;T:now;hi"


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    tok = train_tokenizer(CORPUS, vocab_size=300, chat_template="CONFIG {{ messages[0].content }}")
    tok.save(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("FILE {{ messages[0].content }}", encoding="utf-8")
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False) == "FILE x"
    # save() must not leave a stale chat_template.jinja that would shadow the saved template.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "chat_template.jinja").write_text("STALE", encoding="utf-8")
    ours.save(tmp_path / "other")
    assert AutoTokenizer.from_pretrained(tmp_path / "other").apply_chat_template(messages, tokenize=False) == "FILE x"


def test_errors(tmp_path: Path) -> None:
    no_template = train_tokenizer(CORPUS, vocab_size=300)
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat_template("{{ messages }}", [])
    with pytest.raises(ValueError, match="not valid jinja2"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="chat template error"):  # the sandbox blocks internals
        render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="chat template error"):
        render_chat_template("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "x"}])

"""Hostile chat templates: every failure to compile or render is one `ChatTemplateError` (a ValueError) with the
template's message, and rendering is bounded (value sizes, loop iterations, output) so that no template can
allocate gigabytes or loop for hours. Attacks go through `Tokenizer.apply_chat_template` and `astrai.chat`.

The allocation attacks ask for 100 GB or more, so that a regression fails at once with a MemoryError (which is
also wrapped in ChatTemplateError: the tests match the limit's message, not just the type).
"""

from pathlib import Path

import pytest

import astrai
from astrai.io.chat_template import ChatTemplateError
from astrai.io.template_limits import MAX_ITEMS
from helpers import deadline, tiny_model_dir

MESSAGES = [{"role": "user", "content": "hi"}]
BIG = 10**11


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(Path(tmp_path_factory.mktemp("tiny")) / "model"))


def render(model, template, messages=MESSAGES):
    return model.tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=False)


NESTED = "{% set a = ['x' * 1000] %}" + "".join("{% set a = [a, a] %}" for _ in range(25)) + "{{ a }}"
ATTACKS = {
    "range": ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError: Range too big"),
    "string repeat": (f"{{{{ 'x' * {BIG} }}}}", "a repeated value would be 100,000,000,000 long"),
    "list repeat": (f"{{{{ [0] * {BIG} }}}}", "a repeated value would be"),
    "int power": ("{{ 7 ** 2000000 }}", "a power \\(in bits\\) would be 4,000,001 long"),
    "printf width": (f"{{{{ '%{BIG}s' % 'x' }}}}", "a format width over the chat-template limit"),
    "str.ljust": (f"{{{{ 'x'.ljust({BIG}) }}}}", "str.ljust would be"),
    "str.format width": (f"{{{{ '{{:>{BIG}}}'.format('x') }}}}", "a format width"),
    "center filter": (f"{{{{ 'x' | center({BIG}) }}}}", "filter center: argument"),
    "format filter": (f"{{{{ '%{BIG}s' | format('x') }}}}", "a format width"),
    "replace amplification": ("{% set s = 'x' * 1000000 %}{{ s.replace('', s) }}", "str.replace would be"),
    "indent amplification": ("{% set s = '\n' * 1000000 %}{{ s | indent(s) }}", "filter indent would be"),
    "join amplification": ("{% set s = 'x' * 1000000 %}{{ ([s] * 100000) | join }}", "str.join|the text"),
    "shared nesting": (NESTED, "the text of a value would be"),
    "namespace doubling": ("{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}"
                           "{% endfor %}", "namespace attribute 's' would be"),
    "output loop": ("{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
                    "wrote over 67,108,864 characters"),
    "macro output": ("{% set s = 'x' * 1000000 %}{% macro m() %}{% for i in range(100000) %}{{ s }}{% endfor %}"
                     "{% endmacro %}{% set y = m() %}", "wrote over"),
    "text loop": ("{% for i in range(100000) %}{% for j in range(1000) %}" + "y" * 1000 + "{% endfor %}{% endfor %}",
                  "wrote over|loop iterations"),
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "ran over 8,388,608 loop iterations"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    "lipsum": ("{{ lipsum(10**6) }}", "lipsum"),
    "tojson indent": ("{{ messages | tojson(indent=10**6) }}", "tojson indent 1000000 is over the limit"),
    "raise_exception": ("{{ raise_exception('no system messages') }}", "chat template error: no system messages"),
    "sandbox": ("{{ messages.__class__.__mro__ }}", "chat template error"),
    "missing attribute": ("{{ messages[0].role.nothere.foo }}", "has no attribute 'nothere'"),
    "type error": ("{{ messages[0].content + 1 }}", "TypeError"),
    "syntax": ("{% for m in messages %}", "not valid jinja2"),
    "non-string template": (5, "a chat template must be a string, got int"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ATTACKS))
def test_hostile_templates_raise_one_error_type(model, name):
    template, match = ATTACKS[name]
    with deadline(60), pytest.raises(ChatTemplateError, match=match) as err:
        render(model, template)
    assert isinstance(err.value, ValueError)  # what the server and the CLIs turn into a 400 / an error line


def test_astrai_chat_reports_template_failures(model):
    with pytest.raises(ChatTemplateError, match="Range too big"):
        astrai.chat(model, MESSAGES, chat_template="{% for i in range(10**9) %}x{% endfor %}", max_tokens=2)
    with pytest.raises(ChatTemplateError, match="must be a string"):
        astrai.chat(model, MESSAGES, chat_template=5, max_tokens=2)
    assert isinstance(astrai.chat(model, MESSAGES, max_tokens=2), str)  # positive control: the model's template


def test_limits_leave_ordinary_templates_alone(model):
    template = (
        "{% set ns = namespace(n=0) %}{% macro tag(r) %}<{{ r | upper }}>{% endmacro %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ tag(m.role) }}{{ m.content | trim }}"
        "{{ '%03d' % loop.index }}{{ '{:>4}'.format(m.role[:2]) }}{% endfor %}"
        "{{ tools | tojson(indent=2) }}{{ ('ab' * 3) ~ (2 ** 10) }}{{ ns.n }}"
    )
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    out = model.tokenizer.apply_chat_template(messages, chat_template=template, tools=[{"type": "function"}],
                                              add_generation_prompt=False)  # fmt: skip
    assert out == '<USER>hi001  us<ASSISTANT>yo002  as[\n  {\n    "type": "function"\n  }\n]ababab10242'


def test_values_up_to_the_limit_render(model):
    out = render(model, f"{{{{ ('x' * {MAX_ITEMS}) | length }}}}{{{{ 'y'.ljust(1000) | length }}}}")
    assert out == f"{MAX_ITEMS}1000"
    # long numbers in a format string's literal text are not widths
    out = render(model, "{{ '{} of 123456789012'.format('a') }} {{ '%s of 123456789012 %%99999999999d' % 'b' }}")
    assert out == "a of 123456789012 b of 123456789012 %99999999999d"
    with pytest.raises(ChatTemplateError, match="a repeated value would be 16,777,217 long"):
        render(model, f"{{{{ 'x' * {MAX_ITEMS + 1} }}}}")

"""Tool-call parsers and the reasoning split against each model family's real chat template.

The reference is not written here: each family's own Hugging Face chat template (llama.cpp's copies, read out of
the pinned llama-cpp-python sdist by `real_templates`) renders an assistant turn with one and with two tool calls
(arguments with nested JSON, unicode, quotes, backslashes, numbers, booleans, null) and, where the template has
it, reasoning. The output is what follows the template's generation prompt, up to its end-of-turn token (the
engine stops on that token, so it is not in the text). astrai's parser for the family (`--tool-call-parser`), and
the one `detect_parser` picks from the template, must read back exactly the calls, content and reasoning, whole
(`parse` / `reasoning.split`) and streamed in small pieces through the same feed/finish sequence as the server's
`_chat_stream`. astrai's renderer is checked against transformers' on every rendering. Negative controls: another
family's parser reads none of the calls, and an output cut inside the first call's arguments yields no call.

Without the sdist (`make test-data` downloads it) the tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import json
import os
import random

import attrs
import pytest
import real_templates
from transformers.utils.chat_template_utils import render_jinja_template

from astrai.io.chat_template import render_chat_template
from astrai.serve.reasoning import ReasoningParser, sort_events, split, start_state
from astrai.serve.tool_calls import TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from astrai.serve.tool_parsers import detect_parser, new_parser, parse, tool_schemas
from astrai.serve.tools_common import function_tool

DS_END = "<｜end▁of▁sentence｜>"


@attrs.frozen
class Family:
    """A model family's real template and how its output is read.

    `end`: the end-of-turn token the template closes the assistant turn with. `header`: where the output starts
    when the template's generation prompt is not a prefix of its rendered assistant turn (None: it is).
    `one_call`: the template refuses more than one call per turn. `content`: it renders text beside the calls.
    `reasoning`: the reasoning parser for a thinking template. `variables`: special tokens the template reads.
    """

    template: str
    parser: str
    end: str
    header: str | None = None
    one_call: bool = False
    content: bool = False
    reasoning: str | None = None
    variables: dict = attrs.field(factory=dict)


LLAMA = {"bos_token": "<|begin_of_text|>", "date_string": "26 Jul 2024"}
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>"}
DEEPSEEK = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": DS_END}
FAMILIES = {
    "qwen2.5": Family("Qwen-Qwen2.5-7B-Instruct", "hermes", "<|im_end|>", content=True),
    "qwen3": Family("Qwen-Qwen3-0.6B", "hermes", "<|im_end|>", content=True, reasoning="qwen3"),
    "qwen3-coder": Family("Qwen3-Coder", "qwen3_coder", "<|im_end|>", content=True),
    "hermes3": Family("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes", "<|im_end|>"),  # drops content
    "llama3.1": Family(
        "meta-llama-Llama-3.1-8B-Instruct", "llama3_json", "<|eot_id|>", one_call=True, variables=LLAMA
    ),  # fmt: skip
    "llama3.2": Family(
        "meta-llama-Llama-3.2-3B-Instruct", "llama3_json", "<|eot_id|>", one_call=True, variables=LLAMA
    ),  # fmt: skip
    "mistral-nemo": Family("mistralai-Mistral-Nemo-Instruct-2407", "mistral", "</s>", variables=MISTRAL),
    "mistral-small-3.2": Family("Mistral-Small-3.2-24B-Instruct-2506", "mistral", "</s>", variables=MISTRAL),
    "deepseek-v3.1": Family(
        "deepseek-ai-DeepSeek-V3.1", "deepseek_v3", DS_END, content=True, reasoning="deepseek_r1", variables=DEEPSEEK
    ),  # fmt: skip
    # DeepSeek-V3's call markup (`function<｜tool▁sep｜>NAME` and a ```json fence), as R1 and its distills render it
    "deepseek-r1": Family(
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek_v3", DS_END, header="<｜Assistant｜>", variables=DEEPSEEK
    ),  # fmt: skip
}
# a parser of another family: it must not read these outputs' calls
RIVAL = {"hermes": "mistral", "qwen3_coder": "hermes", "llama3_json": "deepseek_v3", "mistral": "qwen3_coder",
         "deepseek_v3": "hermes"}  # fmt: skip

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "exact": {"type": "boolean"},
    "opts": {"type": "object"}, "ratio": {"type": "number"}}}  # fmt: skip
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "array"},
                                           "strict": {"type": "boolean"}}}  # fmt: skip
TOOLS = [function_tool("get_weather", "Weather for a city.", WEATHER), function_tool("search", "Search.", SEARCH)]
NAMES, SCHEMAS = ["get_weather", "search"], tool_schemas(TOOLS)
CALLS = [
    ("get_weather", {"city": 'São Paulo "Centro" d\'Oeste', "days": 3, "exact": True, "ratio": 2.5,
                     "opts": {"units": ["°C", "mm/h"], "deep": {"k": [1, None, {"x": "日本語 \\ back"}]}}}),
    ("search", {"query": "naïve café ☕ — \"quoted\", 'single', {braces} [brackets]", "strict": False,
                "filters": [{"field": "tag", "in": ["a", "b"]}, {"nested": {"empty": {}, "list": []}}]}),
]  # fmt: skip
CONTENT = "I'll check the weather, then search."
REASONING = "The user wants two things.\nFirst the weather; then a search."
CASES = [(f, n) for f, fam in FAMILIES.items() for n in ((1,) if fam.one_call else (1, 2))]


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    """Template text per family, out of the pinned sdist (skip locally without it; fail under CI)."""
    try:
        texts = real_templates.load([f.template for f in FAMILIES.values()])
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            pytest.fail(f"{e}: the real-template tests must run in CI")
        pytest.skip(str(e))
    return {name: texts[f.template] for name, f in FAMILIES.items()}


def _render(template: str, messages: list[dict], **kw) -> str:
    """astrai's rendering, checked against transformers' own."""
    ours = render_chat_template(template, messages, tools=TOOLS, **kw)
    theirs = render_jinja_template([messages], tools=TOOLS, chat_template=template, **kw)[0][0]
    assert ours == theirs
    return ours


def rendered_output(template: str, fam: Family, n: int, *, reasoning: str | None = None, **variables):
    """(generation prompt, the assistant output) of a turn with the first `n` CALLS as the real template renders
    it: the rendered turn after the prompt, up to the template's end-of-turn token."""
    calls = [{"id": f"call{k}abcd", "type": "function", "function": {"name": name, "arguments": args}}
             for k, (name, args) in enumerate(CALLS[:n])]  # fmt: skip
    turn = {"role": "assistant", "content": CONTENT if fam.content else "", "tool_calls": calls}
    if reasoning is not None:
        turn["reasoning_content"] = reasoning
    asked = [{"role": "user", "content": "Weather in São Paulo?"}]  # no system: Mistral's moves it to the last user
    variables = {**fam.variables, **variables}
    full = _render(template, [*asked, turn], **variables)
    if fam.header is None:
        prompt = _render(template, asked, add_generation_prompt=True, **variables)
    else:
        prompt = _render(template, asked, **variables) + fam.header
    assert full.startswith(prompt), "the output is what follows the generation prompt"
    rest = full[len(prompt) :]
    assert fam.end in rest
    return prompt, rest[: rest.index(fam.end)]


def expected(n: int) -> list[tuple[str, dict]]:
    return [(name, args) for name, args in CALLS[:n]]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def served(fam: Family, parser_name: str, pieces: list[str], state: str) -> tuple[str, str, list]:
    """(reasoning, content, calls) as `openai_api._chat_stream` streams them: each engine delta goes through the
    reasoning parser (when the family has one), and its answer part through the tool-call parser; both finish on
    the last delta. Calls are assembled from their start/args/end events."""
    parser = new_parser(parser_name, NAMES, SCHEMAS)
    thinker = ReasoningParser(fam.reasoning, state) if fam.reasoning else None
    reasoning, content, calls, ended = "", "", {}, set()
    for k, piece in enumerate(pieces):
        last, text = k == len(pieces) - 1, piece
        if thinker is not None:
            r, text = sort_events(thinker.feed(piece) + (thinker.finish() if last else []))
            reasoning += r
        for ev in parser.feed(text) + (parser.finish() if last else []):
            if isinstance(ev, TextDelta):
                content += ev.text
            elif isinstance(ev, ToolCallStart):
                calls[ev.index] = [ev.name, ""]
            elif isinstance(ev, ToolCallArgs):
                calls[ev.index][1] += ev.text
            elif isinstance(ev, ToolCallEnd):
                ended.add(ev.index)
    assert ended == set(calls), "every started call ended"
    return reasoning, content, [(name, json.loads(args)) for name, args in calls.values()]


def pieces_of(text: str, seed: int) -> list[str]:
    """`text` in pieces of 1-6 characters (token-like; special tokens are split too)."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        out.append(text[i : i + k])
        i += k
    return out


def read_back(fam: Family, parser_name: str, output: str, state: str, want_reasoning, want_content, want_calls):
    """The output's calls, content and reasoning, whole and streamed in every way tried, are the wanted ones."""
    answer = output
    if fam.reasoning:
        reasoning, answer = split(fam.reasoning, output, state)
        assert reasoning == want_reasoning
    content, calls = parse(parser_name, answer, NAMES, SCHEMAS)
    assert (content, calls_of(calls)) == (want_content, want_calls)
    splits = [list(output), *(pieces_of(output, s) for s in range(4))]
    splits += [[output[:i], output[i:]] for i in range(0, len(output), 3)]
    for pieces in splits:
        got = served(fam, parser_name, pieces, state)
        assert got == (want_reasoning or "", want_content, want_calls), pieces


@pytest.mark.parametrize(("family", "n"), CASES)
def test_the_family_parser_reads_back_the_real_rendering(templates, family, n):
    fam = FAMILIES[family]
    prompt, output = rendered_output(templates[family], fam, n)
    content = CONTENT if fam.content else ""
    want_reasoning = None
    read_back(fam, fam.parser, output, start_state(prompt), want_reasoning, content, expected(n))
    # the parser picked from the template reads them back too (Llama 3.2's template has no <|python_tag|>, so it
    # gets hermes, whose bare-JSON path reads Llama's `{"name", "parameters"}` object)
    detected = detect_parser(templates[family])
    assert detected == fam.parser or (family, detected) == ("llama3.2", "hermes")
    assert calls_of(parse(detected, output, NAMES, SCHEMAS)[1]) == expected(n)


@pytest.mark.parametrize(("family", "n"), CASES)
def test_negative_controls(templates, family, n):
    """Another family's parser reads none of the calls; an output cut inside the first call's arguments (the
    budget ran out) has no call, and its text comes back."""
    fam = FAMILIES[family]
    _, output = rendered_output(templates[family], fam, n)
    assert parse(RIVAL[fam.parser], output, NAMES, SCHEMAS)[1] == []
    cut = output[: output.index("Paulo")]
    content, calls = parse(fam.parser, cut, NAMES, SCHEMAS)
    assert calls == [] and "São" in content


@pytest.mark.parametrize("n", [1, 2])
def test_qwen3_reasoning_and_calls_split(templates, n):
    """Qwen3's template renders the last turn's `reasoning_content` in `<think>` before the content and calls
    (generation prompt `<|im_start|>assistant\\n`: undecided); without reasoning it renders an empty think block;
    with `enable_thinking: false` the prompt holds that empty block and the output starts in the answer."""
    fam = FAMILIES["qwen3"]
    prompt, output = rendered_output(templates["qwen3"], fam, n, reasoning=REASONING)
    assert output.startswith("<think>\n") and start_state(prompt) == "undecided"
    read_back(fam, "hermes", output, "undecided", REASONING, CONTENT, expected(n))
    prompt, output = rendered_output(templates["qwen3"], fam, n, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and start_state(prompt) == "answer"
    read_back(fam, "hermes", output, "answer", None, CONTENT, expected(n))


@pytest.mark.parametrize("n", [1, 2])
def test_deepseek_v31_thinking_split(templates, n):
    """DeepSeek-V3.1's thinking prompt ends with `<think>` and its rendered turn closes the block (`</think>`)
    before the content and calls: the output is that turn after the prompt, the model's reasoning before the
    template's `</think>` (the template drops past reasoning, so that text is the only part written here)."""
    fam = FAMILIES["deepseek-v3.1"]
    prompt, output = rendered_output(templates["deepseek-v3.1"], fam, n, thinking=True)
    assert prompt.endswith("<｜Assistant｜><think>") and start_state(prompt) == "reasoning"
    assert output.startswith("</think>")
    read_back(fam, "deepseek_v3", REASONING + output, "reasoning", REASONING, CONTENT, expected(n))
    prompt, output = rendered_output(templates["deepseek-v3.1"], fam, n, thinking=False)
    assert prompt.endswith("<think></think>") and start_state(prompt) == "answer"
    read_back(fam, "deepseek_v3", output, "answer", None, CONTENT, expected(n))


def test_single_call_templates_refuse_two(templates):
    """Llama 3.1/3.2's templates raise on two calls in a turn, which is why they are tested with one."""
    for family in ("llama3.1", "llama3.2"):
        with pytest.raises(ValueError, match="single tool-calls"):
            rendered_output(templates[family], FAMILIES[family], 2)

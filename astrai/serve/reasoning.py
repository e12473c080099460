"""Reasoning parsers (`astrai serve --reasoning-parser qwen3|deepseek_r1`): split `<think>…</think>` off the output.

A thinking model writes `<think>` reasoning `</think>` and then its answer. With a parser chosen, the OpenAI API
returns the reasoning as `reasoning_content` beside `content` (as vLLM does; streamed as `reasoning_content`
deltas) and the Anthropic API as a `thinking` content block before the text; tool calls are parsed from the
answer only. Without one (the default) the text is left as the model wrote it.

Where the output starts, the prompt says: a chat template that ends its generation prompt with `<think>`
(DeepSeek-R1, Qwen3 thinking-2507) puts the model inside the reasoning already, and one that ends it with an
empty `<think></think>` block (Qwen3 with `enable_thinking: false`) puts it in the answer. Otherwise the first
characters decide: an output that opens with `<think>` is reasoning up to `</think>`; one that does not is, for
`qwen3`, all answer (Qwen3 writes `<think>` itself when it thinks), and for `deepseek_r1`, reasoning up to
`</think>` (R1 is known to skip the opening tag). Reasoning that never closes (the token budget ran out) stays
reasoning. A request whose output is grammar-constrained (a JSON schema, a forced tool call) starts in the answer:
the grammar does not allow a think block.

Whitespace: newlines around the reasoning and at the start of the answer (the template's `\n` after each tag)
are dropped. Streaming gives exactly the non-streaming split: `feed` holds back text that may still turn out to be
a tag or trailing whitespace, so the reasoning deltas concatenate to `reasoning` and the answer deltas to `text`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from astrai.serve.tool_calls import _partial_suffix

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"
_NL = "\r\n"


@attrs.frozen
class ReasoningDelta:
    """A fragment of the reasoning text."""

    text: str


@attrs.frozen
class AnswerDelta:
    """A fragment of the answer (what the tool-call parser reads next)."""

    text: str


def check_parser(name: str | None) -> None:
    """Raise ValueError naming the accepted parsers unless `name` is None or one of them."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(PARSERS)})")


def start_state(prompt_text: str, *, constrained: bool = False) -> str:
    """Where the output begins, from the rendered prompt's end: `"reasoning"`, `"answer"` or `"undecided"`."""
    if constrained:
        return "answer"
    tail = prompt_text.rstrip()
    if tail.endswith(CLOSE):
        return "answer"
    if tail.endswith(OPEN):
        return "reasoning"
    return "undecided"


class ReasoningParser:
    """Incremental `<think>` splitter: `feed(text)` and `finish()` return `ReasoningDelta` / `AnswerDelta` events.

    Args:
        name: `qwen3` or `deepseek_r1` (how an output without an opening tag is read).
        state: `start_state(...)` of the prompt.
    """

    def __init__(self, name: str, state: str = "undecided") -> None:
        check_parser(name)
        self.name, self.state = name, state
        self.reasoning, self.text = "", ""
        self._held = ""  # text not yet classified (a possible tag, or whitespace that may be trimmed)
        self._answer_started = False  # leading newlines of the answer are dropped until this is set

    def feed(self, text: str) -> list[ReasoningDelta | AnswerDelta]:
        """Classify `text` appended to the output; returns the events it settles."""
        self._held += text
        return self._drain(final=False)

    def finish(self) -> list[ReasoningDelta | AnswerDelta]:
        """The output ended: settle what is held (an unclosed reasoning stays reasoning)."""
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> list[ReasoningDelta | AnswerDelta]:
        out: list[ReasoningDelta | AnswerDelta] = []
        while True:
            if self.state == "undecided":
                start = self._held.lstrip(_NL + " \t")
                if OPEN.startswith(start) and not final:
                    return out  # still possibly `<think>`
                if start.startswith(OPEN):
                    self._held, self.state = start[len(OPEN) :], "reasoning"
                else:
                    self.state = "answer" if self.name == "qwen3" else "reasoning"
                continue
            if self.state == "reasoning":
                end = self._held.find(CLOSE)
                if end < 0:
                    keep = 0 if final else _undecided_tail(self._held)
                    self._emit_reasoning(self._held[: len(self._held) - keep], out, final=final)
                    self._held = self._held[len(self._held) - keep :]
                    return out
                self._emit_reasoning(self._held[:end], out, final=True)
                self._held, self.state = self._held[end + len(CLOSE) :], "answer"
                continue
            text, self._held = self._held, ""
            if not self._answer_started:
                text = text.lstrip(_NL)
                self._answer_started = bool(text)
            if text:
                self.text += text
                out.append(AnswerDelta(text))
            return out

    def _emit_reasoning(self, text: str, out: list, *, final: bool) -> None:
        if not self.reasoning:
            text = text.lstrip(_NL)
        if final:
            text = text.rstrip(_NL)
        if text:
            self.reasoning += text
            out.append(ReasoningDelta(text))


def _undecided_tail(text: str) -> int:
    """Length of the end of reasoning text that may still be trimmed: a possible `</think>` start and the
    newlines before it."""
    tag = _partial_suffix(text, CLOSE)
    rest = text[: len(text) - tag]
    return tag + len(rest) - len(rest.rstrip(_NL))


def split(name: str, output: str, state: str = "undecided") -> tuple[str | None, str]:
    """(reasoning or None when there was none, answer) of a whole output: what the stream would give."""
    parser = ReasoningParser(name, state)
    parser.feed(output)
    parser.finish()
    return (parser.reasoning or None), parser.text


def prompt_start(tokenizer: Any, prompt: Sequence[int], *, constrained: bool) -> str:
    """`start_state` of a tokenized prompt (its last 16 tokens decoded, special tokens kept)."""
    tail = tokenizer.decode(list(prompt[-16:]), skip_special_tokens=False) if tokenizer is not None else ""
    return start_state(tail, constrained=constrained)


def new_parsers(
    name: str | None, tokenizer: Any, prompt: Sequence[int], *, constrained: bool, n: int = 1
) -> list[ReasoningParser] | None:
    """One parser per choice of a request (None without a reasoning parser), started where the prompt ends."""
    if name is None:
        return None
    state = prompt_start(tokenizer, prompt, constrained=constrained)
    return [ReasoningParser(name, state) for _ in range(n)]


def sort_events(events: Sequence[ReasoningDelta | AnswerDelta]) -> tuple[str, str]:
    """(reasoning text, answer text) of one step's events (reasoning always comes first in a step)."""
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    return reasoning, "".join(e.text for e in events if isinstance(e, AnswerDelta))

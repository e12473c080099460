"""Exact-match evaluation of a chat model on quickstart problems, with greedy decoding.

Each problem's question is rendered with the model's chat template (user turn + assistant header, as
``astrai serve`` renders a request), completed greedily by ``astrai.generate`` in batches, and the completion up
to the end-of-turn token, whitespace-stripped, must equal the answer exactly. ``generate_fn`` replaces the
generator (tests inject an oracle to check the scoring; a server client could be plugged in the same way).

Not here: sampling-based metrics (pass@k), partial credit, per-token likelihood scoring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from astrai.inference.generate import generate
from astrai.io.model import Model
from astrai.io.tokenizer import Tokenizer
from astrai.quickstart.task import Problem, to_chat

# (prompts, max_tokens) -> one completion text per prompt, in order
GenerateFn = Callable[[Sequence[str], int], Sequence[str]]
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")  # cut here if a generator returns special tokens as text


@attrs.frozen
class EvalSample:
    """One scored problem.

    Attributes:
        problem: the problem asked.
        prediction: the extracted answer (completion cut at end of turn, stripped).
        correct: whether ``prediction == problem.answer``.
    """

    problem: Problem
    prediction: str
    correct: bool


@attrs.frozen
class EvalResult:
    """Exact-match accuracy over a problem set.

    Attributes:
        accuracy: ``correct / n`` in [0, 1].
        n: problems scored.
        correct: problems answered exactly.
        samples: every scored problem, in the input order.
    """

    accuracy: float
    n: int
    correct: int
    samples: tuple[EvalSample, ...]

    @property
    def summary(self) -> str:
        """``"accuracy: 93.2% (755/810)"``, the line the quickstart prints."""
        return f"accuracy: {100 * self.accuracy:.1f}% ({self.correct}/{self.n})"

    def by_kind(self) -> dict[str, float]:
        """Accuracy per problem kind, for mixed problem sets."""
        totals: dict[str, list[int]] = {}
        for s in self.samples:
            hits = totals.setdefault(s.problem.kind, [0, 0])
            hits[0] += s.correct
            hits[1] += 1
        return {kind: right / total for kind, (right, total) in totals.items()}


def render_prompt(tokenizer: Tokenizer, problem: Problem) -> str:
    """The question as a chat prompt ending in the assistant header, as a server renders it."""
    return tokenizer.apply_chat_template(to_chat(problem, with_answer=False), add_generation_prompt=True)


def extract_answer(completion: str) -> str:
    """The answer in a completion: the text before the first end-of-turn marker, whitespace-stripped."""
    for marker in _END_MARKERS:
        completion = completion.split(marker, 1)[0]
    return completion.strip()


def evaluate(
    model: Model,
    problems: Sequence[Problem],
    *,
    max_tokens: int = 8,
    batch_size: int = 256,
    generate_fn: GenerateFn | None = None,
) -> EvalResult:
    """Greedy exact-match accuracy of ``model`` on ``problems``.

    Args:
        model: a chat model with a tokenizer that has a chat template.
        problems: the problems to ask (held-out ones, to measure generalisation).
        max_tokens: most new tokens per answer; longer answers are cut and so count as wrong.
        batch_size: prompts per ``generate`` call (each call sizes a fresh engine's KV cache to its batch).
        generate_fn: ``(prompts, max_tokens) -> completions``; default ``astrai.generate`` at temperature 0.

    Raises:
        ValueError: no problems, a model without tokenizer, or a generator returning the wrong count.
    """
    if not problems:
        raise ValueError("no problems to evaluate")
    if model.tokenizer is None:
        raise ValueError("the model has no tokenizer to render chat prompts with")
    if generate_fn is None:

        def generate_fn(prompts: Sequence[str], n_tokens: int) -> list[str]:
            return generate(model, list(prompts), max_tokens=n_tokens, temperature=0.0)

    prompts = [render_prompt(model.tokenizer, p) for p in problems]
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        out = list(generate_fn(batch, max_tokens))
        if len(out) != len(batch):
            raise ValueError(f"generate_fn returned {len(out)} completions for {len(batch)} prompts")
        completions += out
    samples = []
    for problem, completion in zip(problems, completions, strict=True):
        prediction = extract_answer(completion)
        samples.append(EvalSample(problem, prediction, prediction == problem.answer))
    correct = sum(s.correct for s in samples)
    return EvalResult(accuracy=correct / len(samples), n=len(samples), correct=correct, samples=tuple(samples))

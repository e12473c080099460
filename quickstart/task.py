"""The quickstart's synthetic chat tasks: deterministic question/answer problems, train/held-out splits, JSONL.

Kinds (``KINDS``), each a one-turn chat with a short, exactly checkable answer:
- ``add2``: "What is 47 + 85?" -> "132", both operands in 10..99 (8100 ordered pairs);
- ``add3``: the same with operands in 100..999;
- ``reverse``: "Reverse the word 'cat'." -> "tac" (random lowercase letters, 3-6 of them);
- ``upper``: "Uppercase the word 'cat'." -> "CAT" (3-6 letters);
- ``count``: "How many letters are in 'banana'?" -> "6" (3-9 letters).

Problems are drawn with a ``random.Random`` seeded by a string, so a (kind, n, seed) gives the same list on every
machine and Python version (string seeds do not depend on ``PYTHONHASHSEED``). Within one call the questions are
distinct. ``split_problems`` draws the held-out set first and the training set from the rest, so a held-out
question never appears in training; for ``add2`` the default holds out a random 10% of the 8100 pairs.

``write_jsonl`` writes one ``{"messages": [user, assistant]}`` object per line, the SFT format ``astrai
preprocess`` reads. No system message is written: the bundled ChatML template adds its default one, which is
also what a served model sees when a client sends none.

Not here: multi-turn problems, tokenization (``vocab.py``), scoring (``evaluate.py``).
"""

from __future__ import annotations

import json
import math
import random
import string
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

KINDS = ("add2", "add3", "reverse", "upper", "count")
HELDOUT_FRACTION = 0.1  # default share of a kind's problem space held out by `split_problems`
MAX_HELDOUT = 1000  # ... capped, so evaluation stays quick for the large spaces
_ENUMERATE_LIMIT = 10_000  # spaces this small are enumerated and shuffled; larger ones are sampled
_OPERANDS = {"add2": (10, 99), "add3": (100, 999)}
_WORD_LENGTHS = {"reverse": (3, 6), "upper": (3, 6), "count": (3, 9)}


@attrs.frozen
class Problem:
    """One synthetic chat problem.

    Attributes:
        kind: one of ``KINDS``.
        question: the user's message.
        answer: the exact assistant reply that counts as correct.
    """

    kind: str
    question: str
    answer: str


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown problem kind {kind!r}; expected one of {KINDS}")


def space_size(kind: str) -> int:
    """Number of distinct problems of ``kind`` (ordered operand pairs, or words)."""
    _check_kind(kind)
    if kind in _OPERANDS:
        lo, hi = _OPERANDS[kind]
        return (hi - lo + 1) ** 2
    lo, hi = _WORD_LENGTHS[kind]
    return sum(26**k for k in range(lo, hi + 1))


def _addition(kind: str, a: int, b: int) -> Problem:
    return Problem(kind, f"What is {a} + {b}?", str(a + b))


def _word_problem(kind: str, word: str) -> Problem:
    if kind == "reverse":
        return Problem(kind, f"Reverse the word '{word}'.", word[::-1])
    if kind == "upper":
        return Problem(kind, f"Uppercase the word '{word}'.", word.upper())
    return Problem(kind, f"How many letters are in '{word}'?", str(len(word)))


def _sample(kind: str, rng: random.Random) -> Problem:
    if kind in _OPERANDS:
        lo, hi = _OPERANDS[kind]
        return _addition(kind, rng.randint(lo, hi), rng.randint(lo, hi))
    lo, hi = _WORD_LENGTHS[kind]
    # uniform over lengths, not over words: otherwise nearly every word would have the longest length
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(lo, hi)))
    return _word_problem(kind, word)


def _enumerate(kind: str) -> list[Problem]:
    lo, hi = _OPERANDS[kind]
    return [_addition(kind, a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]


def make_problems(kind: str, n: int, *, seed: int, exclude: Iterable[str] = frozenset()) -> list[Problem]:
    """``n`` distinct random problems of ``kind``, the same for the same arguments.

    Args:
        kind: one of ``KINDS``.
        n: how many problems.
        seed: seed of the draw.
        exclude: questions that must not be drawn (e.g. a held-out set's).

    Raises:
        ValueError: unknown kind, negative ``n``, or fewer than ``n`` problems left after ``exclude``.
    """
    _check_kind(kind)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    exclude = set(exclude)
    rng = random.Random(f"astrai.quickstart:{kind}:{seed}")
    if space_size(kind) <= _ENUMERATE_LIMIT:
        pool = _enumerate(kind)
        rng.shuffle(pool)
        out = [p for p in pool if p.question not in exclude][:n]
        if len(out) < n:
            raise ValueError(f"asked for {n} {kind} problems but only {len(out)} are left after exclusions")
        return out
    if n > space_size(kind):
        raise ValueError(f"asked for {n} {kind} problems but there are only {space_size(kind)}")
    out, seen, tries = [], set(exclude), 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 10_000:  # only reachable when `exclude` covers most of the space
            raise ValueError(f"could not draw {n} distinct {kind} problems outside the {len(exclude)} excluded")
        problem = _sample(kind, rng)
        if problem.question not in seen:
            seen.add(problem.question)
            out.append(problem)
    return out


def split_problems(
    kind: str, *, n_train: int | None = None, n_test: int | None = None, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint (train, held-out) problem lists of ``kind``.

    The held-out set is drawn first; training problems are drawn from everything else.

    Args:
        kind: one of ``KINDS``.
        n_train: training problems; None takes every remaining problem (only for small spaces such as ``add2``).
        n_test: held-out problems; None means ``HELDOUT_FRACTION`` of the space, at most ``MAX_HELDOUT``
            (810 for ``add2``).
        seed: seed of both draws.

    Raises:
        ValueError: as ``make_problems``, or ``n_train=None`` for a space too large to enumerate.
    """
    size = space_size(kind)
    if n_test is None:
        n_test = min(math.ceil(HELDOUT_FRACTION * size), MAX_HELDOUT)
    if n_train is None:
        if size > _ENUMERATE_LIMIT:
            raise ValueError(f"{kind} has {size} problems: pass n_train explicitly")
        n_train = size - n_test
    test = make_problems(kind, n_test, seed=seed)
    train = make_problems(kind, n_train, seed=seed, exclude={p.question for p in test})
    return train, test


def to_chat(problem: Problem, *, with_answer: bool = True) -> list[dict[str, str]]:
    """The problem as chat messages: the user question, then (``with_answer``) the assistant's answer."""
    messages = [{"role": "user", "content": problem.question}]
    if with_answer:
        messages.append({"role": "assistant", "content": problem.answer})
    return messages


def write_jsonl(problems: Sequence[Problem], path: str | Path) -> Path:
    """Write one ``{"messages": [...]}`` line per problem (the SFT format); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for problem in problems:
            f.write(json.dumps({"messages": to_chat(problem)}, ensure_ascii=False) + "\n")
    return path

"""Quickstart problems: answers checked by re-deriving them from the question text, deterministic draws (also
across processes with different hash seeds), disjoint train/held-out splits, and the SFT JSONL format."""

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.quickstart.task import KINDS, Problem, make_problems, space_size, split_problems, to_chat, write_jsonl

_PATTERNS = {
    "add2": re.compile(r"What is (\d+) \+ (\d+)\?"),
    "add3": re.compile(r"What is (\d+) \+ (\d+)\?"),
    "reverse": re.compile(r"Reverse the word '([a-z]+)'\."),
    "upper": re.compile(r"Uppercase the word '([a-z]+)'\."),
    "count": re.compile(r"How many letters are in '([a-z]+)'\?"),
}


def _expected(problem: Problem) -> str:
    """The answer recomputed from the question text alone."""
    match = _PATTERNS[problem.kind].fullmatch(problem.question)
    assert match, problem.question
    if problem.kind in ("add2", "add3"):
        a, b = map(int, match.groups())
        digits = 2 if problem.kind == "add2" else 3
        assert len(str(a)) == digits and len(str(b)) == digits, problem.question
        return str(a + b)
    word = match.group(1)
    lo, hi = (3, 9) if problem.kind == "count" else (3, 6)
    assert lo <= len(word) <= hi, word
    return {"reverse": "".join(reversed(word)), "upper": word.upper(), "count": str(len(word))}[problem.kind]


@pytest.mark.parametrize("kind", KINDS)
def test_answers_are_right_and_questions_distinct(kind):
    problems = make_problems(kind, 300, seed=3)
    assert len(problems) == 300
    assert all(p.kind == kind and p.answer == _expected(p) for p in problems)
    assert len({p.question for p in problems}) == 300


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_per_seed(kind):
    a = make_problems(kind, 50, seed=1)
    assert a == make_problems(kind, 50, seed=1)
    assert a != make_problems(kind, 50, seed=2)
    assert make_problems(kind, 20, seed=1) == a[:20]  # a longer draw extends a shorter one


def test_same_problems_in_a_process_with_another_hash_seed():
    code = (
        "from astrai.quickstart.task import KINDS, make_problems, split_problems\n"
        "print([make_problems(k, 5, seed=7, exclude={'What is 10 + 10?'}) for k in KINDS])\n"
        "print(split_problems('add2', n_train=5, n_test=5, seed=7))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # this process's own hash seed is random
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    here = [make_problems(k, 5, seed=7, exclude={"What is 10 + 10?"}) for k in KINDS]
    assert out.stdout.splitlines() == [repr(here), repr(split_problems("add2", n_train=5, n_test=5, seed=7))]


def test_word_lengths_all_occur():
    lengths = {len(p.answer) for p in make_problems("reverse", 400, seed=0)}
    assert lengths == {3, 4, 5, 6}
    assert {p.answer for p in make_problems("count", 400, seed=0)} == {str(n) for n in range(3, 10)}


def test_space_sizes():
    assert space_size("add2") == 90 * 90
    assert space_size("add3") == 900 * 900
    assert space_size("upper") == 26**3 + 26**4 + 26**5 + 26**6


def test_add2_default_split_holds_out_ten_percent_of_all_pairs():
    train, test = split_problems("add2", seed=0)
    assert (len(train), len(test)) == (7290, 810)
    train_q, test_q = {p.question for p in train}, {p.question for p in test}
    assert not train_q & test_q
    every_pair = {f"What is {a} + {b}?" for a, b in itertools.product(range(10, 100), repeat=2)}
    assert train_q | test_q == every_pair
    assert split_problems("add2", seed=0) == (train, test)
    assert {p.question for p in split_problems("add2", seed=1)[1]} != test_q


@pytest.mark.parametrize("kind", ["add3", "reverse", "count"])
def test_split_is_disjoint_for_sampled_kinds(kind):
    train, test = split_problems(kind, n_train=2000, n_test=300, seed=5)
    assert (len(train), len(test)) == (2000, 300)
    assert not {p.question for p in train} & {p.question for p in test}


def test_exclude_and_exhaustion():
    excluded = {p.question for p in make_problems("add2", 8000, seed=0)}
    rest = make_problems("add2", 100, seed=9, exclude=excluded)
    assert len(rest) == 100 and not {p.question for p in rest} & excluded
    with pytest.raises(ValueError, match="only 100 are left"):
        make_problems("add2", 101, seed=9, exclude=excluded)
    with pytest.raises(ValueError, match="pass n_train"):
        split_problems("add3", n_test=10)
    with pytest.raises(ValueError, match="unknown problem kind"):
        make_problems("mul", 1, seed=0)
    assert make_problems("upper", 0, seed=0) == []


def test_chat_messages_and_jsonl(tmp_path):
    problems = make_problems("add2", 3, seed=0) + make_problems("reverse", 2, seed=0)
    path = write_jsonl(problems, tmp_path / "sub" / "train.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 5
    for row, problem in zip(rows, problems, strict=True):
        assert row == {
            "messages": [
                {"role": "user", "content": problem.question},
                {"role": "assistant", "content": problem.answer},
            ]
        }
    assert to_chat(problems[0], with_answer=False) == [{"role": "user", "content": problems[0].question}]

"""GRPO reward functions (`astrai.train.rewards`): answer extraction, exact match, regex/format, code execution in
the sandbox, name resolution, and counted skips for rewards that raise or return NaN/inf.

References are the hand-written expected values below (each case states the rule it checks); the code reward runs
real programs through `astrai.eval.sandbox`.
"""

from __future__ import annotations

import logging
import math

import pytest

from astrai.train.rewards import (
    answers_equal,
    code_reward,
    extract_answer,
    register_reward,
    resolve_reward,
    score,
)


@pytest.mark.parametrize(
    ("text", "how", "want"),
    [
        ("so the total is \\boxed{1{,}2} or \\boxed{\\frac{1}{2}}.", "auto", "\\frac{1}{2}"),  # last box, nested
        ("Answer: 42. Then answer: 17.", "auto", "17"),  # the last "answer:" wins
        ("47 + 85 = 132", "auto", "132"),  # last number
        ("It is 1,234 apples", "number", "1234"),  # thousands separators dropped
        ("  tac  ", "auto", "tac"),  # no number: the stripped text
        ("no box here 7", "boxed", None),  # one rule only: no fallback
        ("answer:\n", "answer", None),
        ("", "auto", None),
    ],
)
def test_extract_answer(text, how, want):
    assert extract_answer(text, how) == want


def test_answers_equal_compares_numbers_by_value():
    assert answers_equal("12.0", "12") and answers_equal("1,000", "1000") and answers_equal(" abc ", "abc")
    assert not answers_equal("12", "13") and not answers_equal(None, "1") and not answers_equal("abc", "abd")


def test_exact_match_and_regex_and_format():
    em = resolve_reward("exact_match")
    assert em("What is 47 + 85?", "132", answer="132") == 1.0
    assert em("q", "I think 131", answer="132") == 0.0
    assert resolve_reward("exact_match:boxed")("q", "132", answer="132") == 0.0  # boxed only, and there is none
    assert resolve_reward("exact_match:text")("q", " tac\n", answer="tac") == 1.0
    digits = resolve_reward(r"regex:\d+")
    assert digits("q", " 132 ") == 1.0 and digits("q", "132 apples") == 0.0  # the whole completion must match
    fmt = resolve_reward("format")
    assert fmt("q", "<think>add</think>\n<answer>132</answer>") == 1.0
    assert fmt("q", "<answer>132</answer>") == 0.0
    with pytest.raises(ValueError, match="answer"):
        em("q", "132")  # no reference answer in the record: a ValueError (a counted skip in `score`)


def test_resolve_reward_names_and_errors():
    assert resolve_reward("math:isfinite") is math.isfinite  # an import path
    for bad, message in [("nope", "unknown reward"), ("regex:(", "bad regular expression"),
                         ("exact_match:roman", "unknown answer extraction"), ("math:nope", "cannot import"),
                         ("math:pi", "not callable")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            resolve_reward(bad)
    with pytest.raises(ValueError, match="':'"):
        register_reward("a:b", lambda p, c, **r: 0.0)


def test_code_reward_runs_the_tests_in_the_sandbox():
    good = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    tests = "def check(f):\n    assert f(2, 3) == 5\n"
    assert code_reward("q", good, test=tests, entry_point="add") == 1.0
    assert code_reward("q", bad, test=tests, entry_point="add") == 0.0
    assert code_reward("q", "def add(a, b): return a + b", answer="assert add(1, 1) == 2") == 1.0  # no fence
    assert resolve_reward("code") is code_reward


def test_score_counts_raising_and_nonfinite_rewards_as_skips(caplog):
    def broken(prompt, completion, **record):
        if completion == "boom":
            raise RuntimeError("boom")
        return float("nan") if completion == "nan" else float("inf") if completion == "inf" else 1.0

    fns = {"exact_match": resolve_reward("exact_match"), "broken": broken}
    completions = ["7", "boom", "nan", "inf", "8"]
    with caplog.at_level(logging.WARNING, logger="astrai.train"):
        scores = score(fns, (1.0, 0.5), ["q"] * 5, completions, [{"answer": "7"}] * 5)
    assert scores.skipped == {"exact_match": 0, "broken": 3}
    assert scores.per_function["broken"] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert scores.total == [1.5, 0.0, 0.0, 0.0, 0.5]
    (warning,) = [r for r in caplog.records if "broken" in r.getMessage()]  # one warning per function and batch
    assert "3 of 5" in warning.getMessage() and "RuntimeError: boom" in warning.getMessage()
    with pytest.raises(ValueError, match="weights"):
        score(fns, (1.0,), ["q"], ["7"], [{}])

"""GRPO reward functions: plain callables `(prompt: str, completion: str, **record) -> float`, looked up by name.

`record` holds the prompt's extra fields (from GRPO shards: `answer`, the reference string kept by `astrai
preprocess` with `answer_field`). A reward reads what it needs and ignores the rest, so any Python function of
that shape works; `register_reward(name, fn)` makes it selectable from a recipe or the CLI (`--grpo.rewards`).

Names `resolve_reward` understands:
- `exact_match`: 1.0 when the answer extracted from the completion equals `record["answer"]` (both stripped;
  numbers compared as numbers, so "12.0" matches "12"), else 0.0. Extraction (`extract_answer`) tries, in order,
  the last `\\boxed{...}`, the text after the last "answer:" (case-insensitive), the last number, and the whole
  stripped completion; `exact_match:boxed`, `exact_match:answer`, `exact_match:number`, `exact_match:text` use
  one rule only (no fallback).
- `format`: 1.0 when the completion is `<think>...</think><answer>...</answer>` (R1's format, TRL's example
  format reward); `regex:PATTERN`: 1.0 when PATTERN (Python `re`, DOTALL) matches the whole stripped completion.
- `code`: 1.0 when the completion's Python (the last ```python fenced block, else the whole text) followed by
  the test code (`record["test"]`, else `record["answer"]`, plus `check(entry_point)` when the record names
  an `entry_point`, as HumanEval) exits 0 in `astrai.eval.sandbox` within `CODE_TIMEOUT_S`.
- `package.module:function`: any importable callable.

`score` runs several rewards over a batch with weights. A reward that raises or returns NaN/inf (or a
non-number) is a *counted skip*: that function contributes 0 to that completion, `skipped` counts it, and one
warning per function and batch names the function and the first error; training never stops for it.

Not here: batched or asynchronous reward servers, model-based (reward-model) rewards, per-token rewards.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

RewardFn = Callable[..., float]
"""`(prompt: str, completion: str, **record) -> float`."""

CODE_TIMEOUT_S = 10.0
FORMAT_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"
EXTRACTORS = ("auto", "boxed", "answer", "number", "text")

_log = logging.getLogger("astrai.train")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER = re.compile(r"answer\s*[:：]\s*", re.IGNORECASE)
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


# ---- answer extraction ---------------------------------------------------------------------------------------------


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced; None when there is none (or it never closes)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def _after_answer(text: str) -> str | None:
    found = list(_ANSWER.finditer(text))
    if not found:
        return None
    rest = text[found[-1].end() :].strip()
    return rest.splitlines()[0].strip().rstrip(".") if rest else None


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_answer(text: str, how: str = "auto") -> str | None:
    """The answer in `text` by rule `how` (one of EXTRACTORS; "auto" tries boxed, answer, number, then text)."""
    rules = {"boxed": _boxed, "answer": _after_answer, "number": _last_number, "text": lambda t: t.strip() or None}
    if how == "auto":
        for rule in ("boxed", "answer", "number", "text"):
            found = rules[rule](text)
            if found is not None:
                return found
        return None
    if how not in rules:
        raise ValueError(f"unknown answer extraction {how!r}; expected one of {', '.join(EXTRACTORS)}")
    return rules[how](text)


def answers_equal(got: str | None, want: str | None) -> bool:
    """Stripped strings equal, or both numbers (commas dropped) of equal value."""
    if got is None or want is None:
        return False
    got, want = got.strip(), want.strip()
    if got == want:
        return True
    try:
        return float(got.replace(",", "")) == float(want.replace(",", ""))
    except ValueError:
        return False


# ---- built-in rewards ------------------------------------------------------------------------------------------------


def exact_match_reward(how: str = "auto") -> RewardFn:
    """A reward: 1.0 when `extract_answer(completion, how)` equals `record["answer"]` (see `answers_equal`)."""
    extract_answer("", how)  # validates `how`

    def exact_match(prompt: str, completion: str, answer: str | None = None, **record: Any) -> float:
        if answer is None:
            raise ValueError("exact_match needs the record's 'answer' (preprocess with answer_field)")
        return float(answers_equal(extract_answer(completion, how), str(answer)))

    exact_match.__name__ = "exact_match" if how == "auto" else f"exact_match:{how}"
    return exact_match


def regex_reward(pattern: str, name: str | None = None) -> RewardFn:
    """A reward: 1.0 when `pattern` (DOTALL) matches the whole stripped completion, else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def regex(prompt: str, completion: str, **record: Any) -> float:
        return float(compiled.fullmatch(completion.strip()) is not None)

    regex.__name__ = name or f"regex:{pattern}"
    return regex


def extract_code(completion: str) -> str:
    """The last ```python fenced block of `completion`, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def code_reward(prompt: str, completion: str, *, test: str | None = None, answer: str | None = None,
                entry_point: str | None = None, **record: Any) -> float:  # fmt: skip
    """1.0 when the completion's code followed by the record's test code runs cleanly in the sandbox."""
    from astrai.eval.sandbox import Limits, run_program

    checks = test if test is not None else answer
    if checks is None:
        raise ValueError("code needs the record's 'test' (or 'answer') with the test code")
    program = f"{extract_code(completion)}\n\n{checks}\n"
    if entry_point:
        program += f"\ncheck({entry_point})\n"
    return float(run_program(program, Limits(timeout_s=CODE_TIMEOUT_S)).passed)


_REGISTRY: dict[str, RewardFn] = {
    "exact_match": exact_match_reward("auto"),
    "format": regex_reward(FORMAT_PATTERN, name="format"),
    "code": code_reward,
}


def register_reward(name: str, fn: RewardFn) -> None:
    """Make `fn` selectable as `name` (in `GRPOConfig.rewards`); names with ':' are reserved."""
    if ":" in name:
        raise ValueError(f"reward names may not contain ':' (reserved for arguments and import paths): {name!r}")
    _REGISTRY[name] = fn


def reward_names() -> list[str]:
    """The registered names (arguments and import paths come on top, see the module docstring)."""
    return sorted(_REGISTRY)


def resolve_reward(name: str) -> RewardFn:
    """The reward function `name` stands for (module docstring).

    Raises:
        ValueError: an unknown name, a bad pattern or extraction rule, or an import path that gives no callable.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    head, sep, arg = name.partition(":")
    if sep and head == "exact_match":
        return exact_match_reward(arg)
    if sep and head == "regex":
        try:
            return regex_reward(arg)
        except re.error as err:
            raise ValueError(f"reward {name!r}: bad regular expression ({err})") from None
    if sep and head and arg:
        try:
            fn = getattr(importlib.import_module(head), arg)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward {name!r}: cannot import it ({err})") from None
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
        return fn
    raise ValueError(
        f"unknown reward {name!r}; built-ins: {', '.join(reward_names())}, exact_match:RULE (RULE in "
        f"{', '.join(EXTRACTORS[1:])}), regex:PATTERN, or an import path package.module:function"
    )


# ---- scoring a batch -------------------------------------------------------------------------------------------------


@attrs.frozen
class Scores:
    """Rewards of a batch of completions.

    Attributes:
        total: the weighted sum per completion.
        per_function: name -> that function's reward per completion (0.0 where it was skipped).
        skipped: name -> completions where it raised or returned a non-finite value.
    """

    total: list[float]
    per_function: dict[str, list[float]]
    skipped: dict[str, int]


def score(
    fns: Mapping[str, RewardFn],
    weights: Sequence[float],
    prompts: Sequence[str],
    completions: Sequence[str],
    records: Sequence[Mapping[str, Any]],
) -> Scores:
    """Run every reward on every (prompt, completion, record); counted skips as in the module docstring."""
    if len(weights) != len(fns):
        raise ValueError(f"{len(fns)} reward functions but {len(weights)} weights")
    per_function, skipped = {}, {}
    for name, fn in fns.items():
        values, errors = [], []
        for prompt, completion, record in zip(prompts, completions, records, strict=True):
            try:
                value = float(fn(prompt, completion, **record))
                if not math.isfinite(value):
                    raise ValueError(f"returned {value}")
            except Exception as err:  # a broken reward must not stop training: count it and go on
                errors.append(f"{type(err).__name__}: {err}")
                value = 0.0
            values.append(value)
        per_function[name], skipped[name] = values, len(errors)
        if errors:
            _log.warning(f"warning: reward {name!r} failed on {len(errors)} of {len(values)} completions (counted "
                         f"as 0 and skipped); first: {errors[0]}")  # fmt: skip
    total = [sum(w * per_function[name][i] for w, name in zip(weights, fns, strict=True)) for i in range(len(prompts))]
    return Scores(total=total, per_function=per_function, skipped=skipped)

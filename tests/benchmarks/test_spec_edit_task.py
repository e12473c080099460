"""benchmarks/spec_edit_task.py: the rename task is deterministic, its answers are exact whole-word renames, the
held-out problems are never trained on, and a tiny training run leaves a folder `astrai.load` loads and
`edit_accuracy` scores (no accuracy claim: 5 steps; the full run's accuracy is in its report)."""

import importlib.util
import io
import json
import re
from pathlib import Path

from rich.console import Console

from astrai.io.model import load
from astrai.quickstart.vocab import ALPHABET

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("spec_edit_task", ROOT / "benchmarks" / "spec_edit_task.py")
task = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(task)

_QUESTION = re.compile(r"Rename `(\w+)` to `(\w+)`:\n(.*)", re.S)


def test_generator_is_deterministic_and_in_range():
    a, b = task.make_edit_problems(50, stream="x"), task.make_edit_problems(50, stream="x")
    assert a == b and a != task.make_edit_problems(50, stream="y")
    assert task.edit_prompts(3, seed=0) == task.edit_prompts(3, seed=0)
    assert len({p.question for p in a}) == 50
    for p in a:
        old, new, code = _QUESTION.fullmatch(p.question).groups()
        lines = code.split("\n")
        assert task.MIN_CHARS <= len(code) <= task.MAX_CHARS and task.MIN_LINES <= len(lines) <= task.MAX_LINES
        assert set(p.question + p.answer) <= set(ALPHABET)  # the quickstart's character vocabulary covers it
        assert task.occurrences(code, old) >= 2 and new not in code


def test_answers_are_whole_word_renames():
    # negative control: identifiers that merely contain the old name keep it
    code = "acc = 0\nfor x in accs:\n    acc += my_acc + acc_max + acc2\nreturn acc"
    assert task.rename(code, "acc", "total") == (
        "total = 0\nfor x in accs:\n    total += my_acc + acc_max + acc2\nreturn total"
    )
    problems = task.make_edit_problems(300, stream="check")
    distractors = 0
    for p in problems:
        old, new, code = _QUESTION.fullmatch(p.question).groups()
        assert p.answer == task.rename(code, old, new) and p.answer != code
        assert task.occurrences(p.answer, old) == 0 and task.occurrences(p.answer, new) == task.occurrences(code, old)
        # every other identifier is copied unchanged, including the longer ones that contain `old`
        others = [w for w in re.findall(r"\w+", code) if w != old]
        assert [w for w in re.findall(r"\w+", p.answer) if w != new] == others
        distractors += any(old in w for w in others)
    assert distractors > 30  # the whole-word rule is exercised, not just possible (57 of these 300)


def test_heldout_never_trained_on():
    train, test = task.split_edit_problems(2000, seed=0)
    assert len(test) == task.HELDOUT_POOL and not {p.question for p in train} & {p.question for p in test}
    assert task.heldout_problems(5, seed=0) == test[:5]
    assert task.heldout_problems(5, seed=1) != test[:5]
    prompt = task.edit_prompts(1, seed=0)[0]
    assert prompt.startswith("<|im_start|>user\nRename `") and prompt.endswith("<|im_start|>assistant\n")


def test_tiny_training_run_saves_a_loadable_model(tmp_path):
    out = io.StringIO()
    cfg = task.edit_model_config(hidden=32, layers=1)
    model_dir = task.build_edit_model(tmp_path / "edit", steps=3, console=Console(file=out), model_cfg=cfg,
                                      n_train=32, batch_size=2, compile=False)  # fmt: skip
    assert model_dir == tmp_path / "edit" / "model"
    model = load(model_dir)
    assert model.tokenizer is not None and model.tokenizer.chat_template and model.config.hidden_size == 32
    assert json.loads((tmp_path / "edit" / "build.json").read_text())["steps"] == 3
    exact, agreement = task.edit_accuracy(model_dir, n=2)
    assert 0.0 <= exact <= 1.0 and 0.0 <= agreement <= 1.0
    # cached: a second call returns the folder without training
    again = io.StringIO()
    assert task.build_edit_model(tmp_path / "edit", console=Console(file=again)) == model_dir
    assert "reusing the trained model" in again.getvalue()

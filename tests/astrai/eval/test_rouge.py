"""ROUGE equals Google's `rouge-score` (precision, recall and F1 of rouge1/2/L/Lsum, with and without the
stemmer) on hand-picked edge cases (unicode, empty strings, repeats, several lines) and random pairs; and
`astrai eval rouge` end to end, with given and with generated predictions."""

from __future__ import annotations

import json
import random

import pytest

from astrai.eval import rouge

rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")

CASES = [
    ("the cat sat on the mat", "the cat was on the mat"),
    ("", ""),
    ("", "something here"),
    ("only reference", ""),
    ("   ", "!!! ..."),
    ("The THE the, the; the", "the the"),
    ("héllo wörld naïve café", "hello world naive cafe"),
    ("世界 你好 🙂", "世界 你好"),
    ("İstanbul KELVIN \u212a 3.14 x86_64", "istanbul kelvin k 3 14 x86 64"),
    ("running runners ran easily fairly", "run runner running easy fair"),
    ("first line here\nsecond line there\n\nthird", "second line here\nfirst line there"),
    ("a b a b a b", "b a b a"),
    ("police killed the gunman", "the gunman police killed"),
    ("one\ntwo\nthree", "three two one"),
    # 3-letter words the Porter stemmer would change ("was" -> "wa"): rouge-score stems only tokens longer than 3
    ("he was here and has gone", "he wa here and ha gone"),
]


def _random_pairs(n: int) -> list[tuple[str, str]]:
    rng = random.Random(0)
    vocab = ["the", "cat", "dog", "runs", "running", "ran", "a", "mat", "Éclair", "2024", "x-ray", "über", "\n"]
    text = lambda: " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 14)))  # noqa: E731
    return [(text(), text()) for _ in range(n)]


@pytest.mark.parametrize("stem", [False, True])
def test_rouge_equals_rouge_score(stem):
    ref_scorer = rouge_scorer.RougeScorer(list(rouge.TYPES), use_stemmer=stem)
    stemmer = rouge.porter_stemmer() if stem else None
    for reference, prediction in CASES + _random_pairs(300):
        expected = ref_scorer.score(reference, prediction)
        got = rouge.scores(reference, prediction, stemmer)
        for kind in rouge.TYPES:
            e = expected[kind]
            assert got[kind] == pytest.approx(
                {"precision": e.precision, "recall": e.recall, "fmeasure": e.fmeasure}, abs=1e-12
            ), (kind, reference, prediction)


def test_tokenizer_matches_rouge_score():
    from rouge_score import tokenize as ref

    for text, _ in CASES:
        assert rouge.tokenize(text) == ref.tokenize(text, None)
    assert rouge.tokenize("héllo 世界") == ["h", "llo"]  # non-ASCII letters separate tokens, as in rouge-score


def test_eval_rouge_given_predictions(tmp_path):
    rows = [{"prediction": p, "reference": r} for r, p in CASES]
    data = tmp_path / "preds.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = rouge.evaluate(rouge.Config(data=data))  # no model needed: predictions are given
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    expected = [scorer.score(r, p) for r, p in CASES]
    for kind in ("rouge1", "rouge2", "rougeL"):
        assert report.metrics[kind] == pytest.approx(sum(e[kind].fmeasure for e in expected) / len(CASES))
    assert report.metrics["samples"] == len(CASES) and report.metrics["generated"] == 0
    data.write_text(json.dumps({"prompt": "p", "reference": "r"}) + "\n")
    with pytest.raises(rouge.DataError, match=r"preds.jsonl:1: no 'prediction' field, and no --model"):
        rouge.evaluate(rouge.Config(data=data))


def test_eval_rouge_generates_missing_predictions(tmp_path):
    import astrai
    from helpers import tiny_model_dir

    folder = tiny_model_dir(tmp_path / "m")
    model = astrai.load(folder)
    rows = [{"prompt": "hello world", "reference": "this is a tiny corpus"},
            {"prompt": "the quick brown", "reference": "fox jumps", "prediction": "fox jumps over"},
            {"prompt": "the lazy", "reference": "dog"}]  # fmt: skip
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = rouge.evaluate(rouge.Config(model=folder, data=data, max_tokens=6, batch_size=2), model)
    expected = astrai.generate(model, ["hello world", "the lazy"], max_tokens=6)
    assert [s["prediction"] for s in report.samples] == [expected[0], "fox jumps over", expected[1]]
    assert [s["generated"] for s in report.samples] == [True, False, True]
    assert report.metrics["generated"] == 2

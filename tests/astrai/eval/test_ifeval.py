"""IFEval: lm-eval's verifiers through `evaluate` on hand-made responses (strict vs loose, prompt- vs
instruction-level arithmetic done by hand), bad input named by line, and generation on a tiny random model."""

import json
import sys

import pytest

from astrai.eval.data import DataError
from astrai.eval.ifeval import Config, evaluate
from helpers import tiny_model_dir

pytest.importorskip("lm_eval")
pytest.importorskip("langdetect")
pytest.importorskip("immutabledict")

END = "Is there anything else I can help with?"
LOWERCASE_CAT = "a cat is a small soft animal that sleeps most of the day and purrs when it is happy."

# (instruction ids, kwargs, response, expected strict flags, expected loose flags)
CASES = [
    (["punctuation:no_comma"], [{}], "red bloom on iron\nslow fire eats the hull", [True], [True]),
    (["punctuation:no_comma"], [{}], "Hello, world", [False], [False]),
    # strict vs loose: a chatty first line breaks "all lowercase"; loose also tries the response without it
    (["change_case:english_lowercase"], [{}], f"Sure, here it is:\n{LOWERCASE_CAT}", [False], [True]),
    (["length_constraints:number_words"], [{"num_words": 10, "relation": "less than"}], "Five words are right here.",
     [True], [True]),
    (["length_constraints:number_words"], [{"num_words": 10, "relation": "at least"}], "Five words are right here.",
     [False], [False]),
    (["detectable_format:title"], [{}], "<<A Day at Sea>>\nThe boat left early.", [True], [True]),
    (["detectable_format:title"], [{}], "A Day at Sea\nThe boat left early.", [False], [False]),
    (["startend:end_checker"], [{"end_phrase": END}], f"Here you go. {END}", [True], [True]),
    (["keywords:existence"], [{"keywords": ["ocean", "salt"]}], "The ocean tastes of salt.", [True], [True]),
    (["keywords:existence", "punctuation:no_comma", "startend:end_checker"],
     [{"keywords": ["ocean"]}, {}, {"end_phrase": END}], f"The ocean is wide, and blue. {END}",
     [True, False, True], [True, False, True]),
    # markdown bold around the end phrase: strict fails, loose (with `*` removed) passes
    (["startend:end_checker"], [{"end_phrase": END}], f"Thanks.\n**{END}**", [False], [True]),
]  # fmt: skip


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path):
    data = [{"key": i, "prompt": f"prompt {i}", "instruction_id_list": ids, "kwargs": kw}
            for i, (ids, kw, *_) in enumerate(CASES)]  # fmt: skip
    responses = [{"prompt": f"prompt {i}", "response": case[2]} for i, case in enumerate(CASES)]
    return _write(tmp_path / "data.jsonl", data), _write(tmp_path / "responses.jsonl", responses)


def test_verifiers_strict_and_loose(files):
    data, responses = files
    report = evaluate(Config(model="given", data=data, responses=responses))
    assert [s["strict"] for s in report.samples] == [case[3] for case in CASES]
    assert [s["loose"] for s in report.samples] == [case[4] for case in CASES]
    # by hand: 11 prompts, 13 instructions; strict follows all of prompts 0, 3, 5, 7, 8 and 7 instructions,
    # loose adds prompts 2 and 10 (and their instructions)
    m = report.metrics
    assert (m["prompts"], m["instructions"]) == (11, 13)
    assert m["prompt_level_strict_acc"] == pytest.approx(5 / 11) and m["inst_level_strict_acc"] == pytest.approx(7 / 13)
    assert m["prompt_level_loose_acc"] == pytest.approx(7 / 11) and m["inst_level_loose_acc"] == pytest.approx(9 / 13)
    assert report.groups["punctuation:no_comma"] == {"count": 3, "strict": pytest.approx(1 / 3),
                                                     "loose": pytest.approx(1 / 3)}  # fmt: skip
    assert report.groups["startend:end_checker"]["strict"] == pytest.approx(2 / 3)
    assert report.groups["startend:end_checker"]["loose"] == 1.0


def test_responses_passed_in_python_and_limit(files):
    data, _ = files
    given = {f"prompt {i}": case[2] for i, case in enumerate(CASES)}
    report = evaluate(Config(model="given", data=data, limit=3), responses=given)
    assert report.metrics["prompts"] == 3 and report.metrics["prompt_level_loose_acc"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"key": 1, "prompt": "p", "kwargs": [{}]}', "instruction_id_list"),
        ('{"key": 1, "prompt": "p", "instruction_id_list": ["punctuation:no_comma"], "kwargs": []}', "kwargs"),
        ('{"key": 1, "prompt": "p", "instruction_id_list": ["nope:unknown"], "kwargs": [{}]}', "unknown instruction"),
        ('{"key": 1, "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}', "prompt"),
        ('{"key": 1, "prompt": "p", "instruction_id_list": ["punctuation:no_comma"]', "not valid JSON"),
    ],
)
def test_malformed_record_names_its_line(tmp_path, line, message):
    good = '{"key": 0, "prompt": "q", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}'
    data = tmp_path / "data.jsonl"
    data.write_text(f"{good}\n{line}\n")
    with pytest.raises(DataError, match=rf"data\.jsonl:2: .*{message}"):
        evaluate(Config(model="given", data=data), responses={"q": "x", "p": "x"})


def test_missing_response_and_missing_file(files, tmp_path):
    data, _ = files
    with pytest.raises(DataError, match=r"data\.jsonl:1"):
        evaluate(Config(model="given", data=data), responses={})
    with pytest.raises(FileNotFoundError):
        evaluate(Config(model="given", data=tmp_path / "missing.jsonl"), responses={})


def test_missing_lm_eval_says_what_to_install(files, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval.tasks.ifeval", None)  # makes the import fail
    with pytest.raises(ValueError, match=r"pip install .lm-eval\[ifeval\]"):
        evaluate(Config(model="given", data=files[0]), responses={})


@pytest.mark.parametrize("raw_prompt", [False, True])
def test_tiny_random_model_generates_and_is_scored(files, tmp_path_factory, raw_prompt):
    tiny = tiny_model_dir(tmp_path_factory.mktemp("tiny"))  # has a ChatML template: raw_prompt=False uses it
    report = evaluate(Config(model=tiny, device="cpu", data=files[0], limit=3, max_tokens=8, raw_prompt=raw_prompt))
    assert report.metrics["prompts"] == 3 and len(report.samples) == 3
    assert all(isinstance(s["response"], str) for s in report.samples)
    assert 0.0 <= report.metrics["inst_level_strict_acc"] <= report.metrics["inst_level_loose_acc"] <= 1.0


def test_bad_kwargs_and_missing_nltk_data_are_named(tmp_path):
    bogus = {"key": 1, "prompt": "p", "instruction_id_list": ["length_constraints:number_words"],
             "kwargs": [{"num_words": 5, "relation": "roughly"}]}  # fmt: skip
    data = _write(tmp_path / "data.jsonl", [bogus])
    with pytest.raises(DataError, match=r"data\.jsonl:1: the verifiers .* rejected"):
        evaluate(Config(model="given", data=data), responses={"p": "one two three"})
    sentences = {"key": 2, "prompt": "s", "instruction_id_list": ["length_constraints:number_sentences"],
                 "kwargs": [{"num_sentences": 2, "relation": "at least"}]}  # fmt: skip
    data = _write(tmp_path / "sentences.jsonl", [sentences])
    try:
        report = evaluate(Config(model="given", data=data), responses={"s": "One. Two. Three."})
    except ValueError as err:  # NLTK's punkt data is not installed here: the message says how to get it
        assert "sentences.jsonl:1" in str(err) and "nltk.downloader punkt" in str(err)
    else:
        assert report.samples[0]["strict"] == [True]

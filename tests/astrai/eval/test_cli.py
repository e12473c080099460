"""`astrai eval TASK` through `astrai.cli.eval.cli`: the JSON summary is the last stdout line, `--out` writes one
JSON line per sample, and bad input (a missing file, a malformed record, an empty dataset, a model without a
tokenizer) gives exactly one `error:` line on stderr and exit status 2."""

from __future__ import annotations

import json

import attrs
import pytest

import astrai
from astrai.cli.eval import cli, model_positional_to_flag
from helpers import tiny_model_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    folder = tiny_model_dir(root / "model")
    bare = str(astrai.save(attrs.evolve(astrai.load(folder), tokenizer=None), root / "no_tokenizer"))
    write = lambda name, text: (root / name).write_text(text) and str(root / name)  # noqa: E731
    rows = lambda items: "".join(json.dumps(r) + "\n" for r in items)  # noqa: E731
    return {
        "model": folder,
        "bare": bare,
        "root": root,
        "texts": write("texts.jsonl", rows([{"text": "hello world"}, {"text": "the quick brown fox jumps"}])),
        "mc": write(
            "mc.jsonl",
            rows([{"question": "q?", "choices": ["a", "b", "c", "d"], "answer": "B", "subject": "tiny"}] * 3),
        ),  # fmt: skip
        "rouge": write("rouge.jsonl", rows([{"prediction": "the cat sat", "reference": "the cat sat down"}])),
        "ifd": write("ifd.jsonl", rows([{"instruction": "say hello", "output": "hello world"}])),
        "bad_json": write("bad.jsonl", '{"text": "ok"}\n{"text": "broken\n'),
        "bad_field": write("bad_field.jsonl", '{"text": "ok"}\n\n{"txt": "no text field"}\n'),
        "bad_csv": write("bad_test.csv", "q,a,b,c,d,A\nq,a,b,c,d,B\nq,a,b,c,d,Z\n"),
        "empty": write("empty.jsonl", "\n\n"),
        "empty_txt": write("empty.txt", "  \n"),
    }


def run(capsys, args: list[str]) -> tuple[int, list[str], list[str]]:
    code = 0
    try:
        cli(args)
    except SystemExit as err:
        code = err.code
    out, err = capsys.readouterr()
    return code, out.splitlines(), [line for line in err.splitlines() if line.strip()]


def test_ppl_summary_is_the_last_line_and_out_has_one_line_per_sample(files, capsys, tmp_path):
    out = tmp_path / "sub" / "ppl.jsonl"
    code, stdout, _ = run(capsys, ["ppl", "--model", files["model"], "--data", files["texts"], "--out", str(out)])
    assert code == 0
    summary = json.loads(stdout[-1])
    assert summary["task"] == "ppl" and summary["model"] == files["model"]
    assert summary["ppl"] > 1 and summary["tokens"] == sum(json.loads(r)["tokens"] for r in out.read_text().split("\n")
                                                           if r)  # fmt: skip
    assert len(out.read_text().splitlines()) == 2
    assert any("ppl" in line for line in stdout[:-1])  # the rich table came first


@pytest.mark.parametrize(
    ("task", "data", "keys"),
    [("mc", "mc", {"acc", "acc_macro", "questions"}), ("rouge", "rouge", {"rouge1", "rouge2", "rougeL"}),
     ("ifd", "ifd", {"ifd", "ifd_median", "ifd_ce"})],
)  # fmt: skip
def test_tasks_from_the_cli_with_the_model_first(files, capsys, task, data, keys):
    code, stdout, _ = run(capsys, [task, files["model"], "--data", files[data], "--limit", "2"])
    assert code == 0
    summary = json.loads(stdout[-1])
    assert summary["task"] == task and keys <= set(summary)
    if task == "mc":
        assert summary["questions"] == 2  # --limit


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ppl", "--data", "{root}/missing.jsonl"], r"missing.jsonl: no such file"),
        (["ppl", "--data", "{bad_json}"], r"bad.jsonl:2: not valid JSON"),
        (["ppl", "--data", "{bad_field}"], r"bad_field.jsonl:3: missing field 'text'"),
        (["mc", "--data", "{bad_csv}"], r"bad_test.csv:3: answer 'Z' is not one of the 4 choices"),
        (["ppl", "--data", "{empty}"], r"empty.jsonl: no records \(the dataset is empty\)"),
        (["ppl", "--data", "{empty_txt}"], r"empty.txt: the file is empty"),
        (["mc", "--data", "{mc}", "--num-fewshot", "2"], r"--num-fewshot 2 needs --dev"),
        (["ppl", "--data", "{texts}", "--stride", "0"], r"--stride must be in \[1"),
        (["ifd", "--data", "{ifd}", "--batch-size", "0"], r"--batch-size must be >= 1"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(files, capsys, args, message):
    import re

    args = [a.format(**files) for a in args] + ["--model", files["model"]]
    code, stdout, stderr = run(capsys, args)
    assert code == 2
    assert len(stderr) == 1 and stderr[0].startswith("error:"), stderr
    assert re.search(message, stderr[0]), stderr[0]
    assert not any(line.startswith("{") for line in stdout)


@pytest.mark.parametrize("task", ["ppl", "mc", "rouge", "ifd"])
def test_model_without_tokenizer_is_an_error(files, capsys, task):
    data = {"ppl": "texts", "mc": "mc", "rouge": "ifd", "ifd": "ifd"}[task]
    extra = ["--prompt-field", "instruction", "--reference-field", "output"] if task == "rouge" else []
    code, _, stderr = run(capsys, [task, "--model", files["bare"], "--data", files[data], *extra])
    assert code == 2
    assert len(stderr) == 1 and stderr[0].startswith("error:") and "has no tokenizer" in stderr[0], stderr


def test_missing_model_is_an_error(files, capsys):
    code, _, stderr = run(capsys, ["ppl", "--model", str(files["root"] / "nope"), "--data", files["texts"]])
    assert code == 2 and len(stderr) == 1 and stderr[0].startswith("error:"), stderr


def test_model_positional_to_flag():
    assert model_positional_to_flag(["ppl", "M", "--data", "x"]) == ["ppl", "--model", "M", "--data", "x"]
    assert model_positional_to_flag(["ppl", "--model", "M"]) == ["ppl", "--model", "M"]
    assert model_positional_to_flag(["--help"]) == ["--help"]

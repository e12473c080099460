"""`astrai eval --out FILE` never replaces an input, and never leaves a temp file behind.

A red-team audit found `--out data.jsonl` (the `--data` file) exiting 0 after replacing the dataset with the
results, and `--out <a folder>` failing with a raw `[Errno 21]` and a `.NAME.tmpPID` file left behind. Each
attack checks exit status 2, an `error:` line naming the problem, and that every file survives byte for byte;
positive controls check that `--out` to a new file, and over the previous results file, work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.cli.eval import cli
from astrai.eval.report import write_samples
from helpers import tiny_model_dir

TEXTS = '{"text": "hello world"}\n{"text": "the quick brown fox jumps"}\n'


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("eval_out") / "model")


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def _run(capsys, args):
    code = 0
    try:
        cli(args)
    except SystemExit as err:
        code = err.code
    out, err = capsys.readouterr()
    return code, out.splitlines(), " ".join(err.split())


def test_out_is_the_data_file_through_the_astrai_command(model, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(TEXTS)
    args = ["eval", "ppl", "--model", model, "--data", "data.jsonl", "--out", "data.jsonl"]
    proc = subprocess.run([sys.executable, "-m", "astrai.cli.main", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stderr
    assert "error: --out data.jsonl is the input --data data.jsonl" in message and "Traceback" not in message
    assert data.read_text() == TEXTS and sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


@pytest.mark.parametrize("link", [os.symlink, os.link])
def test_out_linked_to_the_data_file_is_refused(model, tmp_path, capsys, link):
    data = tmp_path / "data.jsonl"
    data.write_text(TEXTS)
    link(data, tmp_path / "alias.jsonl")
    code, stdout, message = _run(capsys, ["ppl", model, "--data", str(data), "--out", str(tmp_path / "alias.jsonl")])
    assert code == 2 and "is the input --data" in message and stdout == []
    assert data.read_text() == TEXTS


def test_out_is_a_folder(model, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(TEXTS)
    (tmp_path / "results").mkdir()
    before = _tree(tmp_path)
    code, _, message = _run(capsys, ["ppl", model, "--data", str(data), "--out", str(tmp_path / "results")])
    assert code == 2 and f"error: --out {tmp_path / 'results'} is a folder" in message and "Errno" not in message
    assert _tree(tmp_path) == before  # no .results.tmpPID left


def test_out_is_a_model_file(model, tmp_path, capsys):
    import astrai

    data = tmp_path / "data.jsonl"
    data.write_text(TEXTS)
    config = Path(model) / "config.json"
    before = config.read_bytes()
    code, _, message = _run(capsys, ["ppl", model, "--data", str(data), "--out", str(config)])
    assert code == 2 and "is a file of the model folder" in message
    assert config.read_bytes() == before
    astrai.load(model)


def test_out_to_a_new_file_then_over_the_previous_results(model, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(TEXTS)
    out = tmp_path / "ppl.jsonl"
    for _ in range(2):  # the second run replaces the first run's results
        code, stdout, _ = _run(capsys, ["ppl", model, "--data", str(data), "--out", str(out)])
        assert code == 0 and json.loads(stdout[-1])["task"] == "ppl"
        assert [set(json.loads(line)) >= {"tokens"} for line in out.read_text().splitlines()] == [True, True]
    assert data.read_text() == TEXTS and sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "ppl.jsonl"]


def test_results_beside_the_model_are_allowed(model, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(TEXTS)
    out = Path(model) / "ppl_results.jsonl"
    try:
        code, _, _ = _run(capsys, ["ppl", model, "--data", str(data), "--out", str(out)])
        assert code == 0 and len(out.read_text().splitlines()) == 2
    finally:
        out.unlink(missing_ok=True)


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temp(tmp_path):
    out = tmp_path / "ppl.jsonl"
    out.write_text("previous\n")
    with pytest.raises(TypeError):
        write_samples([{"ok": 1}, {"bad": object()}], out)  # not JSON-serialisable: fails mid-write
    assert out.read_text() == "previous\n" and sorted(p.name for p in tmp_path.iterdir()) == ["ppl.jsonl"]
    with pytest.raises(IsADirectoryError, match="it is a folder"):
        write_samples([{"ok": 1}], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ppl.jsonl"]

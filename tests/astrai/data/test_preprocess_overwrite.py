"""`astrai preprocess --overwrite` replaces only a previous run's output, never the inputs or user files.

The run renames a complete new output folder over the old one, so a red-team audit found `--overwrite` with the
output set to the tokenizer/model folder, or to the folder holding the input .jsonl, deleting them. Each attack
below checks exit status 2, an `error:` line naming the problem, and that every file survives byte for byte;
positive controls check that `--overwrite` over a previous output, and an output folder beside the inputs, work.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from astrai.cli.preprocess import PreprocessConfig, main

RECORDS = [{"text": f"hello world the quick brown fox {i}"} for i in range(8)]


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def _setup(tmp_path, tok_dir, write_jsonl):
    """A private tokenizer copy (the session fixture must survive a regression) and data/in.jsonl."""
    tok = tmp_path / "model"
    shutil.copytree(tok_dir, tok)
    (tmp_path / "data").mkdir()
    data = write_jsonl(tmp_path / "data" / "in.jsonl", RECORDS)
    config = {"kind": "pretrain", "inputs": [str(data)], "tokenizer": str(tok), "sections": [{"field": "text"}],
              "preprocessing": {"max_seq_len": 64}}  # fmt: skip
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    return tmp_path / "cfg.json", tok, data


def _run(capsys, cfg, out):
    with pytest.raises(SystemExit) as err:
        main(PreprocessConfig(config=cfg, output=out, overwrite=True, progress=False))
    assert err.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def _hidden(folder):
    return [p.name for p in folder.rglob(".*")]


def test_output_is_the_tokenizer_folder_through_the_astrai_command(tmp_path, tok_dir, write_jsonl):
    cfg, tok, _ = _setup(tmp_path, tok_dir, write_jsonl)
    before = _tree(tok)
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.cli.main", "preprocess", str(cfg), "--output", str(tok), "--overwrite",
         "--no-progress"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stderr
    assert "error:" in message and f"holds the tokenizer folder {tok}" in message and "Traceback" not in message
    assert _tree(tok) == before and _hidden(tmp_path) == []


def test_output_is_the_input_folder(tmp_path, tok_dir, write_jsonl, capsys):
    cfg, _, data = _setup(tmp_path, tok_dir, write_jsonl)
    (data.parent / "precious.txt").write_text("keep me\n")
    before = _tree(data.parent)
    message = _run(capsys, cfg, data.parent)
    assert f"holds the input {data}" in message
    assert _tree(data.parent) == before and _hidden(tmp_path) == []


def test_output_above_the_inputs_is_refused(tmp_path, tok_dir, write_jsonl, capsys):
    cfg, _, data = _setup(tmp_path, tok_dir, write_jsonl)
    before = _tree(tmp_path)
    assert f"output folder {tmp_path} is or holds the input {data}" in _run(capsys, cfg, tmp_path)
    assert _tree(tmp_path) == before


def test_output_folder_with_user_files_is_refused(tmp_path, tok_dir, write_jsonl, capsys):
    cfg, _, _ = _setup(tmp_path, tok_dir, write_jsonl)
    out = tmp_path / "results"
    (out / "runs").mkdir(parents=True)
    (out / "precious.txt").write_text("keep me\n")
    (out / "meta.json").write_text("{}")  # a shard-like name beside them does not make it a preprocess output
    before = _tree(out)
    message = _run(capsys, cfg, out)
    assert f"refusing to replace {out.resolve()}" in message and "precious.txt, runs" in message
    assert "meta.json," not in message  # only the unexpected entries are named
    assert _tree(out) == before and _hidden(tmp_path) == []


def test_output_is_a_file(tmp_path, tok_dir, write_jsonl, capsys):
    cfg, _, _ = _setup(tmp_path, tok_dir, write_jsonl)
    (tmp_path / "notes.txt").write_text("keep me\n")
    assert "it exists and is a file" in _run(capsys, cfg, tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "keep me\n" and _hidden(tmp_path) == []


def test_overwrite_replaces_a_previous_output_and_may_sit_beside_the_inputs(tmp_path, tok_dir, write_jsonl, capsys):
    cfg, tok, data = _setup(tmp_path, tok_dir, write_jsonl)
    out = data.parent / "shards"  # inside the input folder, holding no input: allowed
    main(PreprocessConfig(config=cfg, output=out, progress=False))
    first = json.loads((out / "meta.json").read_text())
    write_jsonl(data, RECORDS * 3)
    main(PreprocessConfig(config=cfg, output=out, overwrite=True, progress=False))
    second = json.loads((out / "meta.json").read_text())
    assert second["counts"]["records"] == 3 * first["counts"]["records"] == 24  # really replaced
    assert sorted(p.name for p in data.parent.iterdir()) == ["in.jsonl", "shards"]
    assert _hidden(tmp_path) == [] and "wrote" in capsys.readouterr().out

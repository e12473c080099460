"""docs/data.md's preprocessing commands run as written on the example records in docs/examples/data/, every
record is kept, and each record-example block in the doc equals its file."""

import json
import re
import shlex
from pathlib import Path

import pytest

from astrai.cli.main import main as astrai_main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "data.md"
EXAMPLES = ROOT / "docs" / "examples" / "data"
KINDS = ("pretrain", "sft", "dpo", "grpo")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", DOC.read_text(encoding="utf-8"), flags=re.M | re.S)


def _example_commands() -> list[str]:
    """The lines of the doc's bash blocks that use the example records (and the tokenizer line before them)."""
    for block in _blocks("bash"):
        if "docs/examples/data/" in block:
            return [line for line in block.splitlines() if line.strip()]
    raise AssertionError("docs/data.md has no bash block using docs/examples/data/")


@pytest.mark.parametrize("kind", KINDS)
def test_doc_shows_each_example_file(kind):
    text = (EXAMPLES / f"{kind}.jsonl").read_text(encoding="utf-8")
    assert f"`docs/examples/data/{kind}.jsonl`" in DOC.read_text(encoding="utf-8")
    assert text in _blocks("json"), f"docs/data.md's block for {kind}.jsonl differs from the file"
    assert all(isinstance(json.loads(line), dict) for line in text.splitlines())


def test_documented_commands_preprocess_every_example(tmp_path, monkeypatch, capsys):
    for name in ("configs", "docs"):  # the commands use repo-relative paths; outputs land in tmp_path/runs
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    commands = _example_commands()
    outputs = {}
    for line in commands:
        argv = shlex.split(line)
        if argv[:2] == ["python", "-c"]:
            exec(argv[2], {})
        else:
            assert argv[:2] == ["astrai", "preprocess"], line
            astrai_main(argv[1:])
            outputs[Path(argv[argv.index("--inputs") + 1]).stem] = tmp_path / argv[argv.index("--output") + 1]
    capsys.readouterr()
    assert sorted(outputs) == sorted(KINDS)
    for kind, out in outputs.items():
        meta = json.loads((out / "meta.json").read_text())
        records = len((EXAMPLES / f"{kind}.jsonl").read_text().splitlines())
        assert meta["kind"] == kind
        assert (meta["counts"]["records"], meta["counts"]["kept"]) == (records, records), meta["counts"]
        assert not meta["counts"]["skipped"], meta["counts"]

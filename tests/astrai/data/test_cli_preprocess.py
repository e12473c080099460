"""`astrai preprocess CONFIG.json` end to end on a tiny file, and one-line errors instead of tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tyro

from astrai.cli.preprocess import PreprocessConfig, main
from astrai.data.datasets import SFTDataset, collate


def _config_file(tmp_path, tok_dir, write_jsonl):
    records = [
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]},
        "{oops",
        {"messages": [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "the dog"}]},
    ]
    write_jsonl(tmp_path / "chat.jsonl", records)
    config = {
        "kind": "sft",
        "inputs": [str(tmp_path / "chat.jsonl")],
        "tokenizer": str(tok_dir),
        "output": str(tmp_path / "ignored"),
        "sections": [{"field": "messages", "action": "$role", "template": True}],
        "preprocessing": {"max_packed_len": 128},
    }
    (tmp_path / "sft.json").write_text(json.dumps(config))
    return tmp_path / "sft.json"


def test_cli_writes_shards_and_reports_skips(tmp_path, tok_dir, write_jsonl, capsys):
    path = _config_file(tmp_path, tok_dir, write_jsonl)
    out = tmp_path / "shards"
    main(tyro.cli(PreprocessConfig, args=[str(path), "--output", str(out), "--no-progress"]))
    printed = capsys.readouterr().out
    assert "kept" in printed and "skipped: bad_json" in printed and "chat.jsonl:2" in printed
    assert not (tmp_path / "ignored").exists()
    batch = collate([SFTDataset(out, 128)[0]])
    assert batch.tokens.shape == (1, 128) and batch.num_loss_tokens > 0
    with pytest.raises(SystemExit) as err:  # the output exists now
        main(PreprocessConfig(config=path, output=out, progress=False))
    assert err.value.code == 2 and "--overwrite" in capsys.readouterr().err
    main(PreprocessConfig(config=path, output=out, progress=False, overwrite=True))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["sections"][0].update(action="learn"), "config.sections[0].action: 'learn' is not one of"),
        (lambda c: c.update(inputs=["/nonexistent/x.jsonl"]), "input /nonexistent/x.jsonl does not exist"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(tmp_path, tok_dir, write_jsonl, edit, message):
    path = _config_file(tmp_path, tok_dir, write_jsonl)
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.cli.preprocess", str(path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "error:" in proc.stderr and message in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr

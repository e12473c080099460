"""Metrics JSONL log: plain values, flushed per line, non-finite values, truncated-line tolerance, resume."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from astrai.train.metrics import MetricsLog, atomic_write_bytes, read_metrics


def _strict_lines(path: Path) -> list[dict]:
    """Parse every line as strict JSON (no NaN/Infinity literals), independently of read_metrics."""

    def bad(token: str) -> None:
        raise AssertionError(f"non-standard JSON constant {token}")

    return [json.loads(line, parse_constant=bad) for line in path.read_text().splitlines()]


def test_round_trip_plain_values(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        log.train(1, loss=torch.tensor(2.5), lr=np.float32(0.5), tokens=np.int64(7), grad_norm=1.25)
        log.eval(1, loss=torch.tensor(3.0, dtype=torch.bfloat16), note="val", extra=None)
        log.train(torch.tensor(2), loss=2.0)
    lines = _strict_lines(path)
    assert [(e["type"], e["step"]) for e in lines] == [("train", 1), ("eval", 1), ("train", 2)]
    first = lines[0]
    assert first["loss"] == 2.5 and first["lr"] == 0.5 and first["tokens"] == 7 and first["grad_norm"] == 1.25
    assert type(first["tokens"]) is int and type(first["loss"]) is float and isinstance(first["time"], float)
    assert lines[1] == {**lines[1], "loss": 3.0, "note": "val", "extra": None}
    assert read_metrics(path) == lines
    assert [e["step"] for e in read_metrics(path, "train")] == [1, 2]
    assert [e["step"] for e in read_metrics(path, "eval")] == [1]


def test_each_entry_is_on_disk_before_close(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path)
    log.train(3, loss=1.0)
    assert [e["step"] for e in read_metrics(path)] == [3]
    log.close()
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.train(4, loss=1.0)


def test_killed_process_keeps_its_history(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    script = (
        "import os, signal, sys\n"
        "from astrai.train.metrics import MetricsLog\n"
        "log = MetricsLog(sys.argv[1])\n"
        "for s in range(5): log.train(s, loss=1.0 / (s + 1))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(path)], cwd=Path(__file__).parents[3], check=False)
    assert proc.returncode != 0
    assert [e["step"] for e in read_metrics(path)] == [0, 1, 2, 3, 4]


def test_nonfinite_values_are_strict_json_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        written = log.train(1, loss=float("nan"), a=torch.tensor(float("inf")), b=-math.inf)
    assert written["loss"] == "NaN" and written["a"] == "Infinity" and written["b"] == "-Infinity"
    raw = _strict_lines(path)[0]
    assert (raw["loss"], raw["a"], raw["b"]) == ("NaN", "Infinity", "-Infinity")
    entry = read_metrics(path)[0]
    assert math.isnan(entry["loss"]) and entry["a"] == math.inf and entry["b"] == -math.inf
    assert entry["type"] == "train"


def test_rejects_non_scalars_and_reserved_names(tmp_path: Path) -> None:
    with MetricsLog(tmp_path / "m.jsonl") as log:
        with pytest.raises(TypeError, match="scalar"):
            log.train(1, loss=torch.ones(3))
        with pytest.raises(TypeError, match="number"):
            log.train(1, loss=[1.0])
        with pytest.raises(ValueError, match="reserved"):
            log.train(1, time=3.0)
        with pytest.raises(ValueError, match="kind"):
            log.log("test", 1, {"loss": 1.0})  # type: ignore[arg-type]
    assert read_metrics(tmp_path / "m.jsonl") == []


def test_truncated_last_line_is_skipped_but_corruption_elsewhere_raises(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        log.train(1, loss=1.0)
        log.train(2, loss=0.5)
    with open(path, "a") as f:
        f.write('{"type": "train", "step": 3, "lo')
    assert [e["step"] for e in read_metrics(path)] == [1, 2]
    lines = path.read_text().split("\n")
    path.write_text("\n".join([lines[0], '{"type": "tr', lines[1]]) + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:2"):
        read_metrics(path)


def test_resume_drops_entries_after_the_checkpoint_step(tmp_path: Path) -> None:
    path = tmp_path / "run" / "m.jsonl"
    with MetricsLog(path) as log:
        for s in range(1, 11):
            log.train(s, loss=1.0 / s)
            if s % 4 == 0:
                log.eval(s, loss=2.0 / s)
    with open(path, "a") as f:
        f.write('{"type": "train", "st')  # the crash left half a line
    with MetricsLog(path, resume_step=5) as log:
        assert [(e["type"], e["step"]) for e in _strict_lines(path)] == [
            *[("train", s) for s in range(1, 5)],
            ("eval", 4),
            ("train", 5),
        ]
        log.train(6, loss=0.1)
    steps = [e["step"] for e in _strict_lines(path)]
    assert steps == [1, 2, 3, 4, 4, 5, 6]
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.jsonl"]  # no temp files left behind


def test_resume_without_a_file_and_fresh_run_truncates(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    MetricsLog(path, resume_step=100).close()
    assert read_metrics(path) == []
    with MetricsLog(path) as log:
        log.train(1, loss=1.0)
    MetricsLog(path).close()
    assert read_metrics(path) == []


def test_atomic_write_replaces_and_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "f.bin"
    atomic_write_bytes(path, b"one")
    atomic_write_bytes(path, b"two")
    assert path.read_bytes() == b"two"
    assert [p.name for p in path.parent.iterdir()] == ["f.bin"]

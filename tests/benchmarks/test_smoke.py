"""Each benchmark's `--smoke` mode runs on CPU and ends with its JSON report (what CI can run of them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["bench_attention.py", "bench_rotary.py", "bench_forward.py"])
def test_smoke_mode_reports_json(script, tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(tmp_path / "out.json")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "out.json").read_text())
    rows = report.get("rows") or report.get("results")
    assert rows, report
    if "rows" in report:  # kernel smokes compare against their references
        assert all(row["ok"] for row in rows)
    else:  # bench_forward: both sides produced positive rates
        assert all(row["hf_decode_tok_s"] > 0 and row["astrai_compiled_decode_tok_s"] > 0 for row in rows)

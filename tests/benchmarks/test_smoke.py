"""Each benchmark's `--smoke` mode runs on CPU and ends with its JSON report (what CI can run of them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["bench_attention.py", "bench_rotary.py", "bench_forward.py", "bench_engine.py"])
def test_smoke_mode_reports_json(script, tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(tmp_path / "out.json")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "out.json").read_text())
    if "rows" in report:  # kernel smokes compare against their references
        assert report["rows"] and all(row["ok"] for row in report["rows"])
    elif "results" in report:  # bench_forward: both sides produced positive rates
        assert all(r["hf_decode_tok_s"] > 0 and r["astrai_compiled_decode_tok_s"] > 0 for r in report["results"])
    else:  # bench_engine: every section measured, and the radix saved prefill work
        assert report["single"]["engine_tok_s"] > 0 and report["batch"][0]["engine_tok_s"] > 0
        assert report["prefix"]["on"]["prefill_tokens"] < report["prefix"]["off"]["prefill_tokens"]

"""bench_distributed's `--smoke` mode: 2 gloo ranks, the per-block and whole-model losses agree, and per block the
peak gathered parameter memory is the largest unit (two with prefetch) while the whole-model gather holds the full
model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~15 s (two gloo ranks); tests/astrai/train/test_fsdp_block.py checks the same peaks in CI
def test_smoke_reports_per_block_memory_below_the_whole_model(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_distributed.py"), "--smoke", "--out", str(out)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    units = report["units_mib"]
    assert rows["model"]["peak_gathered_mib"] == pytest.approx(units["model"])
    one_unit = max(units["largest_block"], units["head"])
    assert rows["block_no_prefetch"]["peak_gathered_mib"] <= one_unit + 1e-9
    assert one_unit < rows["block"]["peak_gathered_mib"] <= 2 * one_unit + 1e-9  # prefetch: two units at most
    assert rows["block_bf16"]["peak_gathered_mib"] == pytest.approx(rows["block"]["peak_gathered_mib"] / 2, rel=0.05)
    assert report["max_loss_diff_block_vs_model"] <= 1e-5 and all(r["step_ms"] > 0 for r in rows.values())
    # tensor parallel: about half the weights per rank, nothing gathered, the same losses
    assert rows["tp"]["peak_gathered_mib"] == 0 and rows["tp"]["shard_mib"] < 0.6 * units["model"]
    assert report["max_loss_diff_tp_vs_model"] <= 1e-4

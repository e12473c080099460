"""The GPU scripts (`benchmarks/run_gpu*.sh`) dry-run on CPU: every stage's pytest selection collects at least one
test and every benchmark stage's flags parse (`ASTRAI_GPU_DRY_RUN=1`, benchmarks/_gpu_stage.sh). A session is lent
a GPU for a few minutes at most; a renamed test or a stale flag found here costs seconds instead of a stage."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# run_gpu_perf.sh (issue 16's prepared script) in CI, ~17 s; the others, 7-9 s each, only in `make test-all`
SCRIPTS = [
    script if script == "run_gpu_perf.sh" else pytest.param(script, marks=pytest.mark.slow)
    for script in sorted(p.name for p in (ROOT / "benchmarks").glob("run_gpu*.sh"))
]


def _dry_run(script: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ASTRAI_GPU_DRY_RUN": "1", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_stage_of_the_gpu_scripts_checks_out(script, tmp_path):
    proc = _dry_run(ROOT / "benchmarks" / script, tmp_path)
    assert proc.returncode == 0 and "failed stages: 0" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
    checked = proc.stdout.count(" rc=0")
    assert checked >= 1, proc.stdout  # something was checked, not only reported unchecked
    assert "nvidia-smi" not in proc.stderr  # the banner stays quiet in a dry run


def test_a_stale_flag_or_an_empty_selection_fails_the_dry_run(tmp_path):
    # the negative control: the same stage function, given a flag no script has, a script that is gone and a -k
    # that selects nothing
    script = tmp_path / "run_gpu_broken.sh"
    script.write_text(
        'source "benchmarks/_gpu_stage.sh"\n'
        "stage good 60 $py benchmarks/bench_rotary.py --smoke\n"
        "stage stale_flag 60 $py benchmarks/bench_rotary.py --no-such-flag\n"
        "stage gone 60 $py benchmarks/bench_renamed_away.py --smoke\n"
        "stage empty_selection 60 $py -m pytest -q -p no:cacheprovider tests/triton_kernels/test_rotary.py "
        '-k "no_test_has_this_name"\n'
        "stage other 10 bash -c true\n"
        'echo "failed stages: $failed"\n'
    )
    proc = _dry_run(script, tmp_path)
    out = proc.stdout
    assert "failed stages: 3" in out, out
    assert "=== good rc=0" in out and "=== stale_flag rc=2" in out and "=== empty_selection rc=5" in out, out
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "out" / "stale_flag.log").read_text()
    assert "=== gone rc=2" in out and "no such script" in (tmp_path / "out" / "gone.log").read_text()
    assert "other: not checked in a dry run" in out

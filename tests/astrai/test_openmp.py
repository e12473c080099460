"""astrai's OpenMP wait setting: `import astrai` shortens libgomp's spin before torch loads it; a user's setting wins.

`OMP_DISPLAY_ENV=VERBOSE` makes libgomp print the settings it read when it was loaded, so the subprocess tests see
what the runtime itself uses, not only what astrai wrote into `os.environ`.
"""

import os
import subprocess
import sys

import pytest

from astrai import openmp


def _libgomp_spin_count(code: str, **env: str) -> str:
    """GOMP_SPINCOUNT as libgomp read it in a fresh interpreter running `code`."""
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stderr.splitlines() if ln.strip().startswith("GOMP_SPINCOUNT"))
    return line.split("=", 1)[1].strip().strip("'")


def test_import_astrai_sets_libgomps_spin_count_before_torch_loads_it():
    assert _libgomp_spin_count("import astrai, torch") == openmp.SPIN_COUNT
    # negative control: torch (and libgomp) loaded first keeps libgomp's own default; astrai leaves the variable
    code = "import torch, os, astrai; assert 'GOMP_SPINCOUNT' not in os.environ"
    assert _libgomp_spin_count(code) == "300000" != openmp.SPIN_COUNT


@pytest.mark.parametrize("given", [{"GOMP_SPINCOUNT": "1234"}, {"OMP_WAIT_POLICY": "ACTIVE"}, {}])
def test_a_users_setting_wins_and_a_loaded_torch_is_left_alone(given, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")  # as before `import torch`; restored after the test
    env = dict(given)
    assert openmp.set_default_spin_count(env) == (not given)
    assert env == (given or {"GOMP_SPINCOUNT": openmp.SPIN_COUNT})
    monkeypatch.undo()
    assert "torch" in sys.modules and not openmp.set_default_spin_count({})  # too late: nothing written


_POOL = """
import os, sys, time, torch
from astrai import openmp
torch.set_num_threads(2)
threads = lambda: len(os.listdir("/proc/self/task"))
torch.ones(1 << 22).sum()  # a parallel region: this thread's pool gets its worker thread
before = threads()
released = openmp.release_idle_threads() if sys.argv[1] == "release" else False
time.sleep(0.2)  # the released worker exits on its own
after = threads()
torch.ones(1 << 22).sum()  # the next parallel op builds the pool again
print(before, after, threads(), released)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_release_idle_threads_lets_the_callers_openmp_workers_exit():
    def run(arm: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", _POOL, arm], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()

    before, after, again, released = run("release")
    assert released == "True" and int(after) == int(before) - 1 and int(again) == int(before)
    # negative control: without the call the worker stays
    before, after, again, released = run("keep")
    assert released == "False" and int(after) == int(before) == int(again)

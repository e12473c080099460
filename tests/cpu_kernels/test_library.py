"""`cpu_kernels.library` parts the kernel tests do not reach: the compile-time constant marker, that importing
astrai does not import Dynamo for it, and the removal of stale libraries from the cache."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from astrai.cpu_kernels import library

ROOT = Path(__file__).resolve().parents[2]


def test_the_constant_marker_is_the_public_decorators():
    def public() -> int:
        return 1

    def ours() -> int:
        return 1

    torch.compiler.assume_constant_result(public)
    library.constant_when_compiled(ours)
    assert vars(ours) == vars(public) and vars(ours)  # a torch change to the marker fails here


def test_a_marked_function_runs_once_while_tracing():
    calls: list[int] = []

    def counted() -> int:
        calls.append(1)
        return 3

    def step(x: torch.Tensor, probe) -> torch.Tensor:
        return x * probe()

    # negative control: unmarked, Dynamo replays the function's side effect on every call of the compiled step
    unmarked = torch.compile(lambda x: step(x, counted), fullgraph=True, backend="eager")
    for _ in range(3):
        assert unmarked(torch.ones(2)).tolist() == [3.0, 3.0]
    assert len(calls) == 3

    calls.clear()
    marked_fn = library.constant_when_compiled(lambda: counted())
    marked = torch.compile(lambda x: step(x, marked_fn), fullgraph=True, backend="eager")
    for _ in range(3):
        assert marked(torch.ones(2)).tolist() == [3.0, 3.0]
    assert len(calls) == 1  # called once, while tracing; the graph keeps the result


def test_importing_astrai_leaves_dynamo_unimported():
    """The kernel modules load with `astrai`; Dynamo (~1.5 s) is imported only by what compiles."""
    code = "import sys, astrai; print('torch._dynamo' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]


def test_a_build_removes_libraries_of_other_sources_unused_for_a_week(tmp_path, monkeypatch):
    compiler = library._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = library.build_dir()
    folder.mkdir(parents=True)
    old, recent, other = folder / "kernels-0000000000000000.so", folder / "kernels-1111111111111111.so", folder / "x.so"
    for path in (old, recent, other):
        path.write_bytes(b"\x7fELF stale")
    week = library.STALE_AFTER_S + 60
    for path in (old, other):
        os.utime(path, (path.stat().st_atime - week, path.stat().st_mtime - week))
    built = library._build(compiler, fresh=True)
    assert built.is_file() and built.stat().st_size > 20000
    assert not old.exists() and recent.exists() and other.exists()  # only week-old libraries of this cache's pattern
    # loading marks a library in use: a week-old one that a process loads is young again
    os.utime(built, (built.stat().st_atime - week, built.stat().st_mtime - week))
    library._open(compiler, library.ENTRIES)
    assert built.stat().st_mtime > time.time() - 60

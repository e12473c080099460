"""Every cuda_ref source compiles with nvcc: the kernels for sm_80 (tensor cores) and the lowest older arch
(the ASTRAI_NO_MMA scalar fallback), the torch bindings with the host compiler. Compile only; no GPU needed.

All jobs run once per session, in parallel, from one fixture (about 20 s of CPU time in total); each test
then reports one source file. Skipped when nvcc is missing.
"""

from __future__ import annotations

import pytest

from astrai.cuda_ref import compile_check

needs_nvcc = pytest.mark.skipif(compile_check.find_nvcc() is None, reason="nvcc not found (PATH or CUDA_HOME)")


@pytest.fixture(scope="module")
def results() -> list[compile_check.Result]:
    out = compile_check.check()
    assert out is not None
    return out


@needs_nvcc
@pytest.mark.parametrize("source", [*compile_check.KERNELS, compile_check.BINDINGS])
def test_source_compiles(results: list[compile_check.Result], source: str) -> None:
    mine = [r for r in results if r.job.name.startswith(source + " ")]
    assert mine, f"no compile job for {source}"
    for r in mine:
        assert r.ok, f"{r.job.name} failed:\n$ {' '.join(r.job.cmd)}\n{r.output[-6000:]}"


@needs_nvcc
def test_kernels_cover_mma_and_scalar_archs(results: list[compile_check.Result]) -> None:
    archs = {r.job.name.split()[-1] for r in results} - {"host"}  # job names are "<file> sm_<arch>"
    assert "sm_80" in archs and any(int(a[3:]) < 80 for a in archs), f"compiled archs: {sorted(archs)}"


def test_own_warnings_are_detected() -> None:
    out = "decode_attention.cu(12): warning #177-D: variable x was declared but never referenced\n"
    assert compile_check.own_warnings(out) and not compile_check.own_warnings("cuda_fp16.hpp: warning: x")


def test_main_skips_without_nvcc(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(compile_check, "find_nvcc", lambda: None)
    assert compile_check.main([]) == 0
    assert "skipped: nvcc not found" in capsys.readouterr().out

"""Test configuration: interpreter mode for Triton on CPU, seeding, and the gpu/slow/cuda_ref markers."""

import os

import pytest
import torch

# Triton reads this when kernel modules are imported, so it must be set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton 3.9 warns on the first GPU compile when this is unset; filterwarnings=error would turn that into a failure.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# Engines keep every thread whatever else runs (`EngineConfig.share_cpu_cores` off), so that a test's bits do not
# depend on the load of the box that runs it; the tests of that option turn it on (tests/astrai/inference).
os.environ.setdefault("ASTRAI_SHARE_CPU_CORES", "0")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _eager_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    """`astrai.generate`'s cached engines run eagerly in tests: a compile per model costs seconds on CPU (the
    compiled path has its own test in tests/astrai/inference/test_engine_cache.py)."""
    from astrai.inference import engine_cache

    monkeypatch.setattr(engine_cache, "COMPILE", False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # markers, not keywords: keywords include folder names (tests/cuda_ref/ holds CPU tests too)
        if item.get_closest_marker("gpu") or item.get_closest_marker("cuda_ref"):
            item.add_marker(skip_gpu)


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str | None:
    """Readable ids for dtypes (`bfloat16` rather than `dtype2`), so `-k` can select them."""
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    return None

"""Test configuration: interpreter mode for Triton on CPU, seeding, and the gpu/slow/cuda_ref markers."""

import os

import pytest
import torch

# Triton reads this when kernel modules are imported, so it must be set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton 3.9 warns on the first GPU compile when this is unset; filterwarnings=error would turn that into a failure.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords or "cuda_ref" in item.keywords:
            item.add_marker(skip_gpu)

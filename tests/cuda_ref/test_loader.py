"""The cuda_ref loader and wrappers without a GPU: import builds nothing, load() explains why it cannot work,
and the wrappers reject CPU tensors with ValueError before reaching any compiled code."""

from __future__ import annotations

import re

import pytest
import torch

from astrai import cuda_ref


def test_reason_matches_availability() -> None:
    reason = cuda_ref.unavailable_reason()
    assert cuda_ref.available() == (reason is None)
    if not torch.cuda.is_available():
        assert reason is not None


@pytest.mark.skipif(cuda_ref.available(), reason="the kernels can be built here")
def test_load_raises_with_reason() -> None:
    with pytest.raises(RuntimeError, match=re.escape(f"cuda_ref kernels unavailable: {cuda_ref.unavailable_reason()}")):
        cuda_ref.load()


def test_wrappers_reject_cpu_tensors() -> None:
    q = torch.randn(2, 4, 64)
    cache = torch.randn(8, 2, 64)
    table, lens = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        cuda_ref.decode_attention(q, cache, cache, table, lens, page_size=4, scale=0.125)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        cuda_ref.extend_attention(q, cache, cache, cu, lens, table, page_size=4, scale=0.125)
    cos = torch.ones(2, 32)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        cuda_ref.rotary(q, q[:, :2], cos, cos)

"""Backend selection for attention and rotary: `ASTRAI_ATTN_BACKEND` = auto | torch | triton | cuda_ref.

auto: CUDA tensors use the Triton kernels, CPU tensors the torch path. `triton` forces the Triton kernels even
for CPU tensors (run with `TRITON_INTERPRET=1`, set before the kernels are imported); `cuda_ref` selects the
hand-written CUDA kernels; `torch` the plain-torch path everywhere. The variable is read at call time (Dynamo
guards on it), so tests can switch it with monkeypatch.
"""

from __future__ import annotations

import os
from typing import Literal

from torch import Tensor

Backend = Literal["torch", "triton", "cuda_ref"]
BACKENDS = ("auto", "torch", "triton", "cuda_ref")


def attn_backend(x: Tensor) -> Backend:
    """The implementation to use for an op whose main input is `x`."""
    choice = os.environ.get("ASTRAI_ATTN_BACKEND", "auto")
    if choice == "auto":
        return "triton" if x.is_cuda else "torch"
    if choice not in BACKENDS:
        raise ValueError(f"ASTRAI_ATTN_BACKEND must be one of {BACKENDS}, got {choice!r}")
    if choice == "cuda_ref" and not x.is_cuda:
        raise ValueError("ASTRAI_ATTN_BACKEND=cuda_ref needs CUDA tensors")
    return choice  # type: ignore[return-value]

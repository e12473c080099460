"""Rotary embedding on q and k: Triton kernel on CUDA, plain torch on CPU."""

from __future__ import annotations

from torch import Tensor

from astrai.ops.backend import attn_backend


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Rotate q and k by per-token angles.

    Args:
        q: [N, H, D] queries; k: [N, K, D] keys.
        cos, sin: [N, D/2] float32 per-token tables (see `astrai.nn.rope.rope_cos_sin`).
        interleaved: rotate adjacent pairs instead of halves.

    Returns:
        (q, k) rotated, new tensors in the input dtype.
    """
    backend = attn_backend(q)
    if backend == "triton":
        from astrai.triton_kernels.rotary import rotary as rotary_kernel

        return rotary_kernel(q, k, cos, sin, interleaved=interleaved)
    if backend == "cuda_ref":
        from astrai import cuda_ref

        return cuda_ref.rotary(q, k, cos, sin, interleaved=interleaved)
    # the reference is vectorised fp32 torch, so it is also the CPU path
    from astrai.triton_kernels.rotary import rotary_ref

    return rotary_ref(q, k, cos, sin, interleaved=interleaved)

"""Rotary embedding on q and k: Triton kernel on CUDA, plain torch on CPU."""

from __future__ import annotations

import torch
from torch import Tensor

from astrai.ops.backend import attn_backend


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    # x: [N, heads, D]; cos/sin: [N, D/2] fp32. Math in fp32, result in x's dtype.
    xf = x.float()
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(x.dtype)


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
        from triton_kernels.rotary import rotary as rotary_kernel

        return rotary_kernel(q, k, cos, sin, interleaved=interleaved)
    if backend == "cuda_ref":
        import cuda_ref

        return cuda_ref.rotary(q, k, cos, sin, interleaved=interleaved)
    return _rotate(q, cos, sin, interleaved), _rotate(k, cos, sin, interleaved)

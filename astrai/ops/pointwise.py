"""RMSNorm and SiLU(gate) * up: plain torch, except in the engine's eager CPU steps, where one hand-written pass each
runs instead (`astrai.cpu_kernels.pointwise`: what eager CPU prefill spends most of its non-GEMM time on).

The kernels round where the torch code rounds, but sum RMSNorm's squares in another order and compute exp within
~1 ulp of torch's (`cpu_kernels/pointwise.c`), so an output may differ from the torch code's in its last bit. Hence
they run only inside `inference_kernels()`, which the engine's runner enters around its eager forwards: a model
evaluated anywhere else (a notebook forward under `no_grad`, DPO's reference model beside its gradient-tracking
policy) computes exactly what the torch code computes, bit for bit as transformers does. Inside that context they
still step aside for traced code (`torch.compile`, where inductor fuses the torch code), gradients, autocast, torch.func
transforms, other devices, and where they do not run (no AVX-512, `ASTRAI_CPU_KERNELS=0`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.cpu_kernels import pointwise as cpu_pointwise

__all__ = ["cpu_kernel_applies", "inference_kernels", "rms_norm", "silu_mul"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STATE = threading.local()  # `on`: inside `inference_kernels()` on this thread


@contextlib.contextmanager
def inference_kernels() -> Iterator[None]:
    """Let `rms_norm` and `silu_mul` take the CPU kernels on this thread for the block (the engine's eager steps)."""
    previous = getattr(_STATE, "on", False)
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = previous


def _kernels_on() -> bool:
    """Inside `inference_kernels()` on this thread. Never read while tracing (the kernels are eager-only anyway):
    Dynamo would guard a compiled step on the thread-local, and a step compiled on a thread that had entered the
    block would recompile on the engine's stepping thread, which had not (seen with a compiled prefill)."""
    return not torch.compiler.is_compiling() and getattr(_STATE, "on", False)


def cpu_kernel_applies(*tensors: Tensor) -> bool:
    """Whether `tensors` may take the CPU pointwise kernels: eager (not traced, no torch.func transform), plain
    tensors on the CPU, one dtype the kernels run, no gradient needed, no autocast."""
    first = tensors[0]
    if torch.compiler.is_compiling() or first.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
        return False
    # torch.func transforms (grad, vmap) wrap tensors that have no storage to hand a kernel; so do other subclasses
    if torch._C._are_functorch_transforms_active() or any(type(t) not in _PLAIN for t in tensors):
        return False
    if any(t.device.type != "cpu" or t.dtype != first.dtype for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return cpu_pointwise.supports(first.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., E] normalised over the last dim in fp32, rounded to x's dtype, times the gain `weight` [E]."""
    fits = weight.shape == x.shape[-1:] and x.stride(-1) == 1
    if _kernels_on() and fits and cpu_kernel_applies(x, weight):
        return cpu_pointwise.rms_norm(x, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`F.silu(gate) * up` (SwiGLU's product), for gate and up of one shape."""
    if _kernels_on() and gate.dim() >= 2 and gate.shape == up.shape and cpu_kernel_applies(gate, up):
        width = gate.shape[-1]
        rows_g, rows_u = gate.reshape(-1, width), up.reshape(-1, width)  # views of a split projection stay views
        if rows_g.stride(-1) == 1 and rows_u.stride(-1) == 1:
            return cpu_pointwise.silu_mul(rows_g, rows_u).reshape(gate.shape)
    return F.silu(gate) * up

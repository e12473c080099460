"""Dense projection: `F.linear`, except for few-row products inside compiled CPU graphs.

Batch-1 decode on CPU is a chain of matrix-vector products. oneDNN/MKL run small-M GEMMs far below memory
bandwidth on a couple of cores (~16 GB/s measured here for fp32), while inductor turns a multiply + row-sum
into a vectorised loop that streams the weight once (~52 GB/s): 3x on the step that dominates decode. The
rewrite only applies while `torch.compile` traces (in eager mode it would materialise a [rows, out, in]
product) and only up to `MAX_REDUCE_ROWS` rows, past which the GEMM wins again.

int8 weight-only (`scale` given, `astrai.ops.quant`): the weight is int8 [out, in] and `scale` [out] its
per-row scale. In the same compiled few-row loop the int8 → fp32 widening happens in registers, so decode reads
a quarter of the fp32 bytes (measured 2.3-3.4x the fp32 loop on this box, docs/benchmarks.md). Elsewhere (eager,
many rows, GPU) the weight is widened to the input's dtype and multiplied as usual, the scale applied to the
product's columns; under `torch.compile` on GPU inductor fuses the widening into the matmul.

With 2-8 rows of fp32 or bf16 (batched decode, n > 1 sampling) on an AVX-512 CPU, the products instead
call `astrai.cpu_kernels.matvec`, a hand-written kernel that streams each weight once per two rows, where
inductor's loop re-reads it per row: a SmolLM2-135M decode step of 4 rows took 17-18 ms against 33-49 (bf16)
and 28-33 against 39-43 (fp32). One call takes the weights that share an input (q/k/v, gate/up). One row keeps
inductor's loop: the kernel streams a single row faster in isolation, but as an opaque op (~17 us a call, ~120
calls a step) that splits inductor's fused kernels it measured no faster over the whole step.
`ASTRAI_CPU_KERNELS=0` turns it off; without AVX-512 or a C compiler the loop runs.

Many-row CPU products (batched decode, prefill) go through `astrai.ops.packed_linear`: oneDNN with weights
pre-packed by the engine, 1.15-2x MKL's sgemm on the AMD development box. Weights nobody packed take `F.linear`
as before, and so does anything that needs a gradient or runs under autocast (the op has neither).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.cpu_kernels import matvec as cpu_matvec
from astrai.ops import packed_linear as packed

MAX_REDUCE_ROWS = 8  # measured crossover on a 2-core EPYC: the reduce form wins at 1-8 rows, loses at 16
# The CPU matvec kernel takes 2..MAX_REDUCE_ROWS rows: at one row inductor's loop, fused with its neighbours, was
# as fast or faster over whole compiled decode steps (docs/benchmarks.md, "CPU matvec kernel"). The upper bound is
# the loop's: a bound of its own would split the 2-8-row decode graph in two (a recompile on CPU when a batch
# crosses it), for fp32 at 5-8 rows, where the kernel measured within the noise of the loop.
MIN_KERNEL_ROWS = 2


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """x: [..., in] @ weight[out, in].T (+ bias[out]) -> [..., out]; accumulation in fp32 for 16-bit inputs.

    With `scale` [out], `weight` is int8 and stands for weight * scale[:, None] (`astrai.ops.quant`).
    """
    if _row_reduce(x):
        if scale is None and _matvec_kernel(x, (weight,)):
            return _kernel_linears(x, (weight,), (bias,))[0]
        return _reduce_linear(x, weight, bias, scale)
    if scale is not None:
        out = F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
        return out if bias is None else out + bias.to(x.dtype)
    if _packed_path(x, (weight,), (bias,)):
        if torch.compiler.is_compiling():  # the pack is looked up at run time, by the weight the graph passes
            return torch.ops.astrai.packed_linear(x, weight, bias)
        out = packed.run_packed(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


def linears(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> list[Tensor]:
    """[linear(x, w, b) for each pair]: products of one input (q/k/v, gate/up). On CPU, weights packed together
    (`packed_linear.pack_group`) run as one product and come back as views of its output; so do few-row
    products through the CPU matvec kernel (one call for the group)."""
    if _row_reduce(x) and _matvec_kernel(x, weights):
        return _kernel_linears(x, weights, biases)
    if not _row_reduce(x) and _packed_path(x, weights, biases):
        if torch.compiler.is_compiling():
            out = torch.ops.astrai.packed_linear_cat(x, list(weights), list(biases))
        else:
            out = packed.run_packed_group(x, weights, biases)
        if out is not None:
            return list(out.split([w.shape[0] for w in weights], dim=-1))
    return [linear(x, w, b) for w, b in zip(weights, biases, strict=True)]


def _row_reduce(x: Tensor) -> bool:
    """Few rows inside a compiled CPU graph: the multiply + row-sum loop (see the module docstring)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.compiler.is_compiling() and x.device.type == "cpu" and 0 < rows <= MAX_REDUCE_ROWS


def _reduce_linear(x: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor | None) -> Tensor:
    # [rows, 1, in] * [out, in] summed over in -> [rows, out]; fp32 accumulation like the GEMM's
    rows = x.numel() // x.shape[-1]
    out = (x.reshape(rows, 1, x.shape[-1]).float() * weight.float()).sum(-1)
    if scale is not None:
        out = out * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _matvec_kernel(x: Tensor, weights: Sequence[Tensor]) -> bool:
    """Whether a few-row product may call the hand-written CPU kernel: no gradient, one dtype it supports, and
    row-major weights (a transposed view would be copied on every call; the loop reads any strides)."""
    rows = x.numel() // x.shape[-1]
    if rows < MIN_KERNEL_ROWS:  # callers have checked rows <= MAX_REDUCE_ROWS
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights)):
        return False
    fits = all(w.dim() == 2 and w.dtype == x.dtype and w.is_contiguous() for w in weights)
    return fits and cpu_matvec.supports(x.dtype)


def _kernel_linears(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> list[Tensor]:
    # one opaque call for the group: [rows, sum out] in fp32, biases added in fp32 like the loop's
    rows = x.numel() // x.shape[-1]
    out = torch.ops.astrai.cpu_matvec(x.reshape(rows, x.shape[-1]), list(weights))
    parts = out.split([w.shape[0] for w in weights], dim=-1)
    parts = [p if b is None else p + b.float() for p, b in zip(parts, biases, strict=True)]
    return [p.to(x.dtype).reshape(*x.shape[:-1], p.shape[-1]) for p in parts]


def _packed_path(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> bool:
    """Whether CPU products may take oneDNN packs: no gradient, no autocast, one packable dtype throughout."""
    if x.device.type != "cpu" or not packed.AVAILABLE or torch.is_autocast_enabled("cpu"):
        return False
    tensors = [x, *weights, *(b for b in biases if b is not None)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return x.dtype in packed.PACKABLE_DTYPES and all(w.dim() == 2 and w.dtype == x.dtype for w in weights)

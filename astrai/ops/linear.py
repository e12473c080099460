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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_REDUCE_ROWS = 8  # measured crossover on a 2-core EPYC: the reduce form wins at 1-8 rows, loses at 16


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """x: [..., in] @ weight[out, in].T (+ bias[out]) -> [..., out]; accumulation in fp32 for 16-bit inputs.

    With `scale` [out], `weight` is int8 and stands for weight * scale[:, None] (`astrai.ops.quant`).
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (torch.compiler.is_compiling() and x.device.type == "cpu" and 0 < rows <= MAX_REDUCE_ROWS):
        if scale is None:
            return F.linear(x, weight, bias)
        out = F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
        return out if bias is None else out + bias.to(x.dtype)
    # [rows, 1, in] * [out, in] summed over in -> [rows, out]; fp32 accumulation like the GEMM's
    out = (x.reshape(rows, 1, x.shape[-1]).float() * weight.float()).sum(-1)
    if scale is not None:
        out = out * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

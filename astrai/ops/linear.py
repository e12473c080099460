"""Dense projection: `F.linear`, except for few-row products inside compiled CPU graphs.

Batch-1 decode on CPU is a chain of matrix-vector products. oneDNN/MKL run small-M GEMMs far below memory
bandwidth on a couple of cores (~16 GB/s measured here for fp32), while inductor turns a multiply + row-sum
into a vectorised loop that streams the weight once (~52 GB/s): 3x on the step that dominates decode. The
rewrite only applies while `torch.compile` traces (in eager mode it would materialise a [rows, out, in]
product) and only up to `MAX_REDUCE_ROWS` rows, past which the GEMM wins again.

int8 weight-only (`scale` given, `astrai.ops.quant`): the weight is int8 [out, in] and `scale` [out] its
per-row scale. CPU products call the same hand-written kernel as below, compiled or eager, which widens the int8
weights in registers (to fp32, or to bf16 pairs for a bf16 x), so decode reads a quarter of the fp32 bytes; the
scale and bias then apply to the fp32 product. It takes products from 1 row, compiled or eager. With a bf16 x it
takes up to 32 rows compiled and 24 eager (`INT8_KERNEL_MAX_ROWS`, `INT8_EAGER_MAX_ROWS`); with fp32 any number: past 21
rows the kernel runs a blocked GEMM that widens each panel of weight rows once in L2 (`cpu_kernels/gemm_i8.c`,
prefill). Without the kernel, few-row compiled products take the loop, which does the widening in registers too
(faster than the fp32 loop in ad hoc runs; the scripted figures are `bench_packed_linear.py --int8`'s, in
docs/benchmarks-history.md). Elsewhere (more bf16 rows, GPU) the weight is
widened to the input's dtype and multiplied as usual, the scale applied to the product's columns; under
`torch.compile` on GPU inductor fuses the widening into the matmul.

With 1-8 rows of bf16, or 1-3 of fp32 (decode, n > 1 sampling, verify rows), on an AVX-512 CPU the products
instead call `astrai.cpu_kernels.matvec`, a hand-written kernel that streams each weight once per two rows, where
inductor's loop re-reads it per row: a SmolLM2-135M decode step of 4 rows took 17-18 ms against 33-49 (bf16)
and 28-33 against 39-43 (fp32). One call takes the weights that share an input (q/k/v, gate/up). One row took
inductor's loop until 2026-12-07: on the AMD development box the kernel, as an opaque op that splits inductor's
fused kernels, measured no faster over the whole step; on an AMX Xeon the loop streamed at half the kernel's speed
and `astrai.generate` ran 1.22x faster in bf16 through the kernel (`MIN_KERNEL_ROWS`).
`ASTRAI_CPU_KERNELS=0` turns it off; without AVX-512 or a C compiler the loop runs.

On a CPU with AMX (Intel Sapphire Rapids and later), compiled bf16 products of 9 to `AMX_MAX_ROWS` (64) rows, batched
decode, call the same kernel, which runs them on AMX tiles (`cpu_kernels/amx.c`, from 2 rows): as fast as oneDNN's
GEMM per product but ~80 us cheaper per call, so a 16-row SmolLM2-135M decode step took 22 ms against 27 through
oneDNN on the 2-core Xeon (32 rows 31 vs 35; equal at 48 and 64). `ASTRAI_CPU_AMX=0` turns the tiles off.

Compiled fp32 products of 4 to `F32_KERNEL_MAX_ROWS` (32) rows, batched decode, call the same kernel too, which runs
them through its blocked form (`cpu_kernels/gemm_f32.c`: 4 weight rows kept in L1 against blocks of 6 x rows):
0.64-0.87x the time of oneDNN's packed GEMM per product on the 2-core Xeon, and a 16-request SmolLM2-135M
`generate_ids` call 1.13-1.18x faster (docs/kernels.md, "CPU fp32 batched products"). Not measured on the AMD box,
where the row kernel had lost to the packs at these rows.

Many-row CPU products (prefill, and batched decode past the kernels' bounds) go through `astrai.ops.packed_linear`:
oneDNN with weights pre-packed by the engine, 1.15-2x MKL's sgemm on the AMD development box. fp32 takes it from 4
rows (`REDUCE_ROWS`) where no kernel runs (eager steps; before the blocked kernel the packed GEMM beat the row kernel
by 1.3-1.5x over a whole step); weights nobody packed take the matvec kernel there (up to 8 rows) and `F.linear`
above, and so does anything that needs a gradient or runs under autocast (the op has neither). Small weights
(`SMALL_WEIGHT_BYTES`, a tiny model's) keep inductor's loop up to 8 rows in any dtype, without the kernel: an opaque
call costs them more than their product.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.cpu_kernels import matvec as cpu_matvec
from astrai.ops import packed_linear as packed

MAX_REDUCE_ROWS = 8  # measured crossover on a 2-core EPYC: the reduce form wins at 1-8 rows, loses at 16
# fp32 leaves the few-row regime after 3 rows where oneDNN packs exist: from 4 rows the packed GEMM (the engine packs
# CPU weights) beat the matvec kernel over a whole SmolLM2-135M decode step, 23.3 -> 18.4 ms at 4 rows, 29.4 -> 20.5
# at 6, 34.5 -> 22.8 at 8 (19.9 vs 19.6 at 3, 15.8 vs 18.8 at 2). Weights nobody packed still take the kernel there
# (`packed_linear._unpacked`): MKL's GEMM took 50.3 ms at 6 rows. bf16 keeps 8 (13.2 vs 13.8 ms at 8 rows).
REDUCE_ROWS = {torch.float32: 3} if packed.AVAILABLE else {}
# The CPU matvec kernel takes products from one row. Before 2026-12-07 one row kept inductor's loop, fused with its
# neighbours: on the 2-core AMD EPYC box it was as fast over whole compiled steps (bf16 6.8-8.7 ms kernel against
# 7.3-8.1 loop, fp32 11.2-11.3 against 10.9-11.1; docs/benchmarks-history.md "CPU matvec kernel"). On the 2-core
# AMX Xeon the loop streamed the projections at 11.2 GB/s against the kernel's 19.7 (bench_matvec --one-graph), and
# `astrai.generate` of SmolLM2-135M (128 in, 128 out, median of 5, two alternating process pairs) ran bf16 44.5 /
# 43.7 -> 53.9 / 53.5 tok/s, fp32 33.0 / 33.2 -> 34.1 / 33.6, fp32 + int8 55.8 / 48.1 -> 61.1 / 58.1. The one loss
# on record is fp32 + int8 on the AMD box (a step of 5.14 / 7.23 ms loop against 6.30 / 7.32 kernel, 2026-12-04),
# measured before the kernel's prefetches (which took int8 one-row products from 13.9 to 19.9 GB/s on the Xeon); the
# AMD box was not available to measure again. Small weights (`SMALL_WEIGHT_BYTES`) keep the loop.
MIN_KERNEL_ROWS = 1
# Products whose weights (a group's together) fit this many bytes keep inductor's multiply + row-sum loop for up to
# MAX_REDUCE_ROWS rows whatever the dtype, and skip the matvec kernel: such a weight stays in L2, so the loop's
# re-read per row is cheap, while an opaque call (a oneDNN pack: `astrai::packed_linear`, a Python custom op, or the
# kernel) costs more than the product and splits inductor's fused kernels. A tiny model's 5-8-row steps
# (speculative verify rows, small batches) were several times its 1-row step through the packs: a 0.87M-parameter
# model (128 wide; its largest group, gate/up, 384 KiB) verified k = 7 guesses at 1.5x the tokens per second through
# the loop (1107 vs 740 tok/s; docs/benchmarks.md, "CPU: speculative decoding on the edit workload, faster proposer
# and small-weight verify rows"). SmolLM2-135M's smallest group (o_proj, 1.3 MiB fp32) is far above it.
SMALL_WEIGHT_BYTES = 512 * 1024
# int8 products of up to this many rows (by x's dtype) take the kernel, compiled or eager. With a bf16 x the engine's
# decode graphs are then batch 1, 2-32 and above 32 (fp32 int8: 1 and above 1), and past 32 rows the weight is widened
# to bf16 for oneDNN's GEMM. A SmolLM2-135M engine decode step, kernel against widened (in-process A/B, an engine per
# arm, 5 alternating rounds, ms): 24 rows 34.3 vs 54.5, 32 rows 41.4 vs 50.8, 48 rows 69.1 vs 75.8 (59-79), 64 rows
# 88.8 vs 65.9. An fp32 x has no bound: past 21 rows the kernel runs a blocked GEMM that widens each panel of weight
# rows once in L2 (`cpu_kernels/gemm_i8.c`). Over SmolLM2-135M's projections it took 35.5 ms at 32 rows against 93.0
# for the widened MKL GEMM, 1685 against 2784 at 2048 (`bench_packed_linear.py --int8`, docs/benchmarks.md "CPU int8
# prefill").
INT8_KERNEL_MAX_ROWS = {torch.bfloat16: 32}
# Eager (prefill), the widened weight through oneDNN gains on the kernel sooner: a bf16 + int8 prefill of SmolLM2-135M
# (one `generate_ids` call, max_tokens=1, 7 alternating calls, ms) took 35.5 vs 38.5 widened at 20 tokens, 39.4 vs
# 38.9 at 24, 47.2 vs 43.4 at 32.
INT8_EAGER_MAX_ROWS = {torch.bfloat16: 24}
# bf16 products of more than MAX_REDUCE_ROWS and up to this many rows, compiled, take the kernel instead of oneDNN's
# packed GEMM where it runs on AMX (`cpu_matvec.amx()`, `cpu_kernels/amx.c`): batched decode. The tiles stream the
# weight as fast as oneDNN does, and the call costs ~2 us through the C++ op against ~80 us for the pack's (torch's
# oneDNN wrapper and the Python op).
AMX_MAX_ROWS = 64
# fp32 products of more than REDUCE_ROWS and up to this many rows, compiled, take the kernel too (its blocked form,
# `cpu_kernels/gemm_f32.c`) instead of oneDNN's packed GEMM. Over SmolLM2-135M's 121 projections on the 2-core Xeon
# (ad hoc ctypes pass, median of 7, ms, the kernel against the packs through their Python op): 4 rows 23.9 vs 37.5,
# 8 rows 30.0 vs 42.3, 16 rows 40.2 vs 52.0, 24 rows 48.9 vs 58.5, 32 rows 63.4 vs 72.8.
F32_KERNEL_MAX_ROWS = 32


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """x: [..., in] @ weight[out, in].T (+ bias[out]) -> [..., out]; accumulation in fp32 for 16-bit inputs.

    With `scale` [out], `weight` is int8 and stands for weight * scale[:, None] (`astrai.ops.quant`).
    """
    if scale is not None and _int8_kernel_rows(x) and _matvec_kernel(x, (weight,), int8=True):
        return _kernel_linears(x, (weight,), (bias,), (scale,))[0]
    if _row_reduce(x, (weight,), int8=scale is not None):
        if scale is None and not _small(weight) and _matvec_kernel(x, (weight,)):
            return _kernel_linears(x, (weight,), (bias,))[0]
        return _reduce_linear(x, weight, bias, scale)
    if scale is None and _blocked_rows(x) and not _small(weight) and _matvec_kernel(x, (weight,)):
        return _kernel_linears(x, (weight,), (bias,))[0]
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
    few = _row_reduce(x, weights)
    if (few or _blocked_rows(x)) and not _small(*weights) and _matvec_kernel(x, weights):
        return _kernel_linears(x, weights, biases)
    if not few and _packed_path(x, weights, biases):
        if torch.compiler.is_compiling():
            out = torch.ops.astrai.packed_linear_cat(x, list(weights), list(biases))
        else:
            out = packed.run_packed_group(x, weights, biases)
        if out is not None:
            return list(out.split([w.shape[0] for w in weights], dim=-1))
    return [linear(x, w, b) for w, b in zip(weights, biases, strict=True)]


def reduce_rows(dtype: torch.dtype) -> int:
    """The most rows a compiled CPU product of `dtype` keeps in the few-row regime (matvec kernel or loop)."""
    return REDUCE_ROWS.get(dtype, MAX_REDUCE_ROWS)


def _small(*weights: Tensor) -> bool:
    """Weights of at most `SMALL_WEIGHT_BYTES` together: few-row products keep inductor's loop (module docstring)."""
    return sum(w.numel() * w.element_size() for w in weights) <= SMALL_WEIGHT_BYTES


def _row_reduce(x: Tensor, weights: Sequence[Tensor] = (), *, int8: bool = False) -> bool:
    """Few rows inside a compiled CPU graph: the matvec kernel or the multiply + row-sum loop (see the module
    docstring). int8 products, and small weights (`_small`), keep `MAX_REDUCE_ROWS`: no pack takes int8 weights,
    and a pack's call costs small ones more than their product."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    bound = MAX_REDUCE_ROWS if int8 or (weights and _small(*weights)) else reduce_rows(x.dtype)
    return torch.compiler.is_compiling() and x.device.type == "cpu" and 0 < rows <= bound


def kernel_rows(dtype: torch.dtype) -> int:
    """The most rows a compiled CPU product of `dtype` sends to the matvec kernel (its tile kernel on AMX CPUs, its
    blocked fp32 kernel)."""
    if dtype == torch.bfloat16 and cpu_matvec.amx():
        return AMX_MAX_ROWS
    if dtype == torch.float32 and cpu_matvec.supports(torch.float32):
        return F32_KERNEL_MAX_ROWS
    return reduce_rows(dtype)


def _blocked_rows(x: Tensor) -> bool:
    """More rows than the few-row regime and at most `kernel_rows`, inside a compiled graph on the CPU: bf16 on an
    AMX CPU (`AMX_MAX_ROWS`), fp32 (`F32_KERNEL_MAX_ROWS`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and reduce_rows(x.dtype) < rows <= kernel_rows(x.dtype)
    )


def _int8_kernel_rows(x: Tensor) -> bool:
    """A CPU int8 product within the row bound for x's dtype: `INT8_KERNEL_MAX_ROWS` compiled, `INT8_EAGER_MAX_ROWS`
    eager (the kernel needs no trace)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    bounds = INT8_KERNEL_MAX_ROWS if torch.compiler.is_compiling() else INT8_EAGER_MAX_ROWS
    return x.device.type == "cpu" and 0 < rows <= bounds.get(x.dtype, rows)


def _reduce_linear(x: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor | None) -> Tensor:
    # [rows, 1, in] * [out, in] summed over in -> [rows, out]; fp32 accumulation like the GEMM's
    rows = x.numel() // x.shape[-1]
    out = (x.reshape(rows, 1, x.shape[-1]).float() * weight.float()).sum(-1)
    if scale is not None:
        out = out * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _matvec_kernel(x: Tensor, weights: Sequence[Tensor], *, int8: bool = False) -> bool:
    """Whether a few-row product may call the hand-written CPU kernel: no gradient, weights of x's dtype (or int8
    ones, `int8`) that it supports, and row-major weights (a transposed view would be copied on every call; the
    loop reads any strides)."""
    rows = x.numel() // x.shape[-1]
    if rows < MIN_KERNEL_ROWS:  # callers have checked the upper bound (MAX_REDUCE_ROWS, or INT8_KERNEL_MAX_ROWS)
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights)):
        return False
    kind = torch.int8 if int8 else x.dtype
    fits = all(w.dim() == 2 and w.dtype == kind and w.is_contiguous() for w in weights)
    return fits and cpu_matvec.supports(x.dtype)


def _kernel_linears(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None], scales: Sequence[Tensor] | None = None
) -> list[Tensor]:
    # one opaque call for the group; int8 scales and biases applied in fp32 like the loop's
    out = cpu_matvec.projection(x, weights, biases, scales)
    return list(out.split([w.shape[0] for w in weights], dim=-1))


def _packed_path(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> bool:
    """Whether CPU products may take oneDNN packs: no gradient, no autocast, one packable dtype throughout."""
    if x.device.type != "cpu" or not packed.AVAILABLE or torch.is_autocast_enabled("cpu"):
        return False
    tensors = [x, *weights, *(b for b in biases if b is not None)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return x.dtype in packed.PACKABLE_DTYPES and all(w.dim() == 2 and w.dtype == x.dtype for w in weights)

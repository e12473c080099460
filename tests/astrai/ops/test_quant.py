"""int8 weight-only quantization of one tensor (`astrai.ops.quant`) and the int8 paths of `ops.linear`.

Reference: F.linear on the dequantized weight (q * scale) plus a random bias, in fp32. Every path must equal it:
the CPU kernel (eager and compiled, its blocked GEMM past 21 fp32 rows), inductor's few-row loop (compiled), and
the widened weight (bf16 past the kernel's rows; everything eager with the kernels off, which is the branch CUDA
takes). The kernels-off half runs as under `ASTRAI_CPU_KERNELS=0` in the same test session (`cpu_kernels_off`).
"""

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from astrai.cpu_kernels import matvec
from astrai.ops.linear import INT8_EAGER_MAX_ROWS, INT8_KERNEL_MAX_ROWS, MAX_REDUCE_ROWS, MIN_KERNEL_ROWS, linear
from astrai.ops.quant import dequantize_int8, quantize_int8
from helpers import assert_close, cpu_kernels_off


def test_integer_rows_quantize_exactly():
    q = torch.randint(-127, 128, (6, 20), dtype=torch.int8)
    q[:, 0] = 127  # every row reaches the grid's end, so the scale is the row's own
    scale = torch.tensor([0.5, 0.25, 2.0, 1.0, 0.125, 4.0])
    got_q, got_scale = quantize_int8(q.float() * scale[:, None])
    assert torch.equal(got_q, q) and torch.equal(got_scale, scale)
    bf16_q, bf16_scale = quantize_int8((q.float() * scale[:, None]).bfloat16())  # exact in bf16 too
    assert torch.equal(bf16_q, q) and bf16_scale.dtype == torch.bfloat16


def test_random_rows_are_within_half_a_step():
    w = torch.randn(64, 33) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different magnitude
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (64,) and q.abs().max() == 127
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert err.max() > 0  # negative control: random values are not on the grid


def test_zero_rows_stacks_and_bad_input():
    w = torch.randn(3, 4, 8)
    w[1, 2] = 0
    q, scale = quantize_int8(w)  # a [E, out, in] stack gets [E, out] scales
    assert scale.shape == (3, 4) and scale[1, 2] == 1 and (q[1, 2] == 0).all()
    w[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_int8(w)
    with pytest.raises(TypeError, match="floating-point"):
        quantize_int8(torch.ones(2, 2, dtype=torch.int32))


@pytest.fixture(params=["kernels", "no_kernels"])
def kernels(request) -> Iterator[bool]:
    """Whether the CPU kernels may run: once as they are here, once as under `ASTRAI_CPU_KERNELS=0`."""
    if request.param == "kernels":
        yield True
    else:
        with cpu_kernels_off():
            yield False


def _kernel_runs(dtype: torch.dtype, rows: int, *, compiled: bool, kernels: bool) -> bool:
    """Whether `ops.linear` should send an int8 product of `rows` rows to the CPU kernel (its documented bounds)."""
    bound = (INT8_KERNEL_MAX_ROWS if compiled else INT8_EAGER_MAX_ROWS).get(dtype, rows)
    low = MIN_KERNEL_ROWS if compiled else 1
    return kernels and matvec.supports(dtype) and low <= rows <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_f_linear_on_the_dequantized_weight(dtype, kernels):
    q, scale = quantize_int8(torch.randn(48, 40))
    # bias ~ N(0, 1) against scales ~ 0.02: a bias multiplied by the scale, or dropped, is off by ~1 of outputs ~6
    scale, bias = scale.to(dtype), torch.randn(48).to(dtype)
    reference = dequantize_int8(q, scale).float()
    torch._dynamo.reset()
    compiled = torch.compile(linear, fullgraph=True, dynamic=False)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    # 1 row: the loop compiled (fp32); 8: the loop's last; 13: past it; 33: past the bf16 kernel's rows, and the
    # fp32 kernel's blocked GEMM
    shapes = [
        (1, 40),
        (2, 3, 40),
        (MAX_REDUCE_ROWS, 40),
        (MAX_REDUCE_ROWS + 5, 40),
        (INT8_KERNEL_MAX_ROWS[torch.bfloat16] + 1, 40),
    ]
    for shape in shapes:
        x = torch.randn(shape).to(dtype)
        rows = x.numel() // 40
        for b in (None, bias):
            expected = F.linear(x.float(), reference, None if b is None else b.float())
            tol = atol * max(1.0, expected.abs().max().item())
            with torch.profiler.profile() as prof:
                out = linear(x, q, b, scale)
            called = any(e.name == "astrai::cpu_matvec" for e in prof.events())
            assert called == _kernel_runs(dtype, rows, compiled=False, kernels=kernels), ("eager", shape)
            assert out.shape == (*shape[:-1], 48) and out.dtype == dtype
            assert_close(out.float(), expected, atol=tol, msg=f"eager {shape} bias={b is not None}")
        if len(shape) == 3:  # the same rows as another shape's graph: eager only (compiles cost seconds)
            continue
        out, code = run_and_get_code(compiled, x, q, bias, scale)
        called = any("cpu_matvec.default(" in c for c in code)
        assert called == _kernel_runs(dtype, rows, compiled=True, kernels=kernels), ("compiled", shape)
        assert_close(out.float(), expected, atol=tol, msg=f"compiled {shape} bias=True")
    # negative control: the int8 weight without its scale is far off
    x = torch.randn(2, 40).to(dtype)
    assert (linear(x, q.to(dtype)) - F.linear(x.float(), reference).to(dtype)).abs().max() > 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_on_cuda_equals_the_dequantized_weight(dtype):
    # CUDA widens the weight (the branch the kernels-off eager case above runs on the CPU); here on the device
    q, scale = quantize_int8(torch.randn(48, 40))
    bias, x = torch.randn(48), torch.randn(33, 40)
    expected = F.linear(x, dequantize_int8(q, scale), bias)
    out = linear(x.to("cuda", dtype), q.cuda(), bias.to("cuda", dtype), scale.to("cuda", dtype))
    atol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_close(out.float().cpu(), expected, atol=atol * max(1.0, expected.abs().max().item()))

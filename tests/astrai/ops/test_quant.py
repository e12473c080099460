"""int8 weight-only quantization of one tensor (`astrai.ops.quant`) and the int8 path of `ops.linear`.

Reference: F.linear on the dequantized weight (q * scale), in fp32; the compiled few-row CPU loop and the
eager widening path must both equal it.
"""

import pytest
import torch
import torch.nn.functional as F

from astrai.ops.linear import MAX_REDUCE_ROWS, linear
from astrai.ops.quant import dequantize_int8, quantize_int8
from helpers import assert_close


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_f_linear_on_the_dequantized_weight(dtype):
    q, scale = quantize_int8(torch.randn(48, 40))
    scale, bias = scale.to(dtype), torch.randn(48).to(dtype)
    reference = dequantize_int8(q, scale).float()
    torch._dynamo.reset()
    compiled = torch.compile(linear, fullgraph=True, dynamic=False)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    for shape in [(1, 40), (2, 3, 40), (MAX_REDUCE_ROWS, 40), (MAX_REDUCE_ROWS + 5, 40)]:
        x = torch.randn(shape).to(dtype)
        for b in (None, bias):
            expected = F.linear(x.float(), reference, None if b is None else b.float())
            for name, fn in (("eager", linear), ("compiled", compiled)):
                out = fn(x, q, b, scale)
                assert out.shape == (*shape[:-1], 48) and out.dtype == dtype
                assert_close(out.float(), expected, atol=atol * max(1.0, expected.abs().max().item()),
                             msg=f"{name} {shape} bias={b is not None}")  # fmt: skip
    # negative control: the int8 weight without its scale is far off
    x = torch.randn(2, 40).to(dtype)
    assert (linear(x, q.to(dtype)) - F.linear(x.float(), reference).to(dtype)).abs().max() > 1.0

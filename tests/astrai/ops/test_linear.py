"""ops.linear: the compiled few-row CPU rewrite equals F.linear."""

import pytest
import torch
import torch.nn.functional as F

from astrai.ops.linear import MAX_REDUCE_ROWS, linear
from helpers import TOLERANCES, assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_matches_f_linear(dtype):
    weight, bias = torch.randn(48, 40).to(dtype), torch.randn(48).to(dtype)
    torch._dynamo.reset()  # each (shape, bias) is its own graph; stay under the recompile limit per dtype
    compiled = torch.compile(linear, fullgraph=True, dynamic=False)
    atol, rtol = TOLERANCES[dtype]
    for shape in [(2, 3, 40), (MAX_REDUCE_ROWS, 40), (MAX_REDUCE_ROWS + 5, 40)]:
        x = torch.randn(shape).to(dtype)
        for b in (None, bias):
            expected = F.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
            out = compiled(x, weight, b)
            assert out.shape == (*shape[:-1], 48) and out.dtype == dtype
            assert_close(out, expected, atol=atol * 10, rtol=rtol, msg=f"{shape} bias={b is not None}")
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))  # eager is F.linear itself

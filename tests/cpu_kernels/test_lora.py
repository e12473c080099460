"""cpu_kernels.lora: the AVX-512 multi-LoRA kernel equals its row-by-row torch reference, in fp32 and bf16, for
ranks and widths that are not multiples of its 16-lane blocks, and is what `ops.lora.lora_delta` runs on CPU.

Skips on CPUs without AVX-512 (bf16: AVX512-BF16); on a CPU whose flags list them the kernel must be bound, so a
machine with the instructions cannot pass these by running the reference.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from astrai.cpu_kernels import lora as cpu_lora
from astrai.ops import lora as ops_lora
from tests.cpu_kernels.test_matvec import FLAGS, _cpu_flags


def _needs(dtype: torch.dtype) -> None:
    if FLAGS[dtype] not in _cpu_flags():
        pytest.skip(f"this CPU lacks {FLAGS[dtype]}")
    assert cpu_lora.supports(dtype), "the CPU has the instructions, so the kernel must build and bind"


def _case(rows: int, width: int, slots: int, rank: int, out: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g).to(dtype)
    a = torch.randn(slots, rank, width, generator=g).to(dtype)
    b = torch.randn(out, slots, rank, generator=g).to(dtype)
    scaling = torch.rand(slots, generator=g) + 0.25
    slot_ids = torch.randint(-1, slots, (rows,), generator=g)
    slot_ids[0] = slots - 1
    return x, a, b, scaling, slot_ids


def _loop(x, a, b, scaling, slot_ids):
    """Float64, one row at a time over the merged weight scaling[s] * b[:, s] @ a[s]: independent of both forms."""
    out = torch.zeros(x.shape[0], b.shape[0], dtype=torch.float64)
    for t, s in enumerate(slot_ids.tolist()):
        if s >= 0:
            out[t] = x[t].double() @ (scaling[s].double() * (b[:, s].double() @ a[s].double())).T
    return out


SHAPES = [(16, 576, 8, 16, 1536), (3, 100, 3, 5, 7), (2, 17, 2, 1, 33), (40, 64, 4, 32, 64), (5, 64, 3, 40, 47)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_the_merged_loop(dtype, shape):
    _needs(dtype)
    x, a, b, scaling, slot_ids = _case(*shape, dtype)
    out = cpu_lora.lora_delta(x, a, b, scaling, slot_ids)
    expected = _loop(x, a, b, scaling, slot_ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)
    assert (out[slot_ids < 0] == 0).all()  # rows without an adapter get nothing (not stale memory)
    moved = slot_ids.clone()
    moved[0] = 0  # negative control: row 0 routed to another slot changes row 0 only
    changed = cpu_lora.lora_delta(x, a, b, scaling, moved)
    assert not torch.allclose(changed[0], out[0]) and torch.equal(changed[1:], out[1:])


def test_an_empty_slot_and_rank_above_the_buffer_fall_back_correctly():
    _needs(torch.float32)
    x, a, b, scaling, slot_ids = _case(6, 32, 3, 4, 20, torch.float32, seed=1)
    scaling[2] = 0.0  # an emptied slot (scaling 0) adds nothing even with stale factors in it
    slot_ids[:] = 2
    assert (cpu_lora.lora_delta(x, a, b, scaling, slot_ids) == 0).all()
    x, a, b, scaling, slot_ids = _case(4, 32, 2, cpu_lora.MAX_RANK + 1, 24, torch.float32, seed=2)
    torch.testing.assert_close(cpu_lora.lora_delta(x, a, b, scaling, slot_ids).double(),
                               _loop(x, a, b, scaling, slot_ids), atol=1e-3, rtol=1e-4)  # fmt: skip


def test_ops_lora_runs_the_kernel_on_cpu_compiled_and_eager(monkeypatch):
    _needs(torch.float32)
    x, a, b, scaling, slot_ids = _case(8, 48, 4, 16, 40, torch.float32, seed=3)
    expected = _loop(x, a, b, scaling, slot_ids).float()
    with mock.patch.object(ops_lora, "lora_delta_masked", side_effect=AssertionError("the masked form ran")):
        torch.testing.assert_close(ops_lora.lora_delta(x, a, b, scaling, slot_ids), expected, atol=1e-4, rtol=1e-4)
        compiled = torch.compile(ops_lora.lora_delta, fullgraph=True)
        torch.testing.assert_close(compiled(x, a, b, scaling, slot_ids), expected, atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "torch")  # the plain-torch form on request
    with mock.patch.object(ops_lora, "lora_delta_masked", wraps=ops_lora.lora_delta_masked) as masked:
        torch.testing.assert_close(ops_lora.lora_delta(x, a, b, scaling, slot_ids), expected, atol=1e-4, rtol=1e-4)
    assert masked.call_count == 1

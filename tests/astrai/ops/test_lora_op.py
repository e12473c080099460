"""`astrai.ops.lora.lora_delta`: the AVX-512 CPU kernel (backend "auto" on CPU), the plain-torch slot-masked form
("torch") and the Triton kernels ("triton", interpreted here) it dispatches to, against a per-row loop over the
merged weights scaling[s] * B_s @ A_s, inside and outside torch.compile.

The masked form multiplies every row by every slot's factors and masks the other slots' columns out, so the
tests put values in slots no row reads (a row must never see another slot) and rows without an adapter.
"""

from __future__ import annotations

import pytest
import torch

from astrai.ops.lora import lora_delta, slot_mask

S, R, IN, OUT = 3, 8, 24, 20


def _inputs(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=g)
    a, b = torch.randn(S, R, IN, generator=g), torch.randn(OUT, S, R, generator=g)
    a[1, 5:] = 0  # slot 1 holds a rank-5 adapter, zero-padded
    b[:, 1, 5:] = 0
    scaling = torch.tensor([0.5, 2.0, 1.0])
    return x, a, b, scaling


def _loop(x, a, b, scaling, slot_ids):
    out = torch.zeros(x.shape[0], OUT, dtype=torch.float64)
    for t, s in enumerate(slot_ids.tolist()):
        if s >= 0:
            merged = scaling[s].double() * (b[:, s, :].double() @ a[s].double())  # [out, in]
            out[t] = x[t].double() @ merged.T
    return out.float()


SLOT_IDS = [2, -1, 0, 1, 1, -1, 2, 0]


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_each_row_gets_its_own_slot(monkeypatch, backend):
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", backend)
    x, a, b, scaling = _inputs(len(SLOT_IDS))
    slot_ids = torch.tensor(SLOT_IDS)
    expected = _loop(x, a, b, scaling, slot_ids)
    torch.testing.assert_close(lora_delta(x, a, b, scaling, slot_ids), expected, atol=1e-4, rtol=1e-4)
    wrong = torch.tensor([0, -1, 0, 1, 1, -1, 2, 0])  # negative control: one row routed to another slot
    assert not torch.allclose(lora_delta(x, a, b, scaling, wrong)[0], expected[0], atol=1e-2)
    torch.testing.assert_close(lora_delta(x, a, b, scaling, wrong)[1:], expected[1:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_prefill_segments(monkeypatch, backend):
    """A prefill step: requests of 3, 1 and 4 tokens in slots 1, -1 and 2 (the GPU kernel reads the segments)."""
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", backend)
    x, a, b, scaling = _inputs(8, seed=1)
    seg_slots, seg_starts = torch.tensor([1, -1, 2]), torch.tensor([0, 3, 4, 8])
    slot_ids = torch.repeat_interleave(seg_slots, seg_starts.diff())
    out = lora_delta(x, a, b, scaling, slot_ids, seg_starts, seg_slots)
    torch.testing.assert_close(out, _loop(x, a, b, scaling, slot_ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_compiled_cpu_forms_and_leading_dims(monkeypatch, backend):
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", backend)
    x, a, b, scaling = _inputs(len(SLOT_IDS), seed=2)
    slot_ids = torch.tensor(SLOT_IDS)
    compiled = torch.compile(lora_delta, fullgraph=True)
    expected = _loop(x, a, b, scaling, slot_ids)
    torch.testing.assert_close(compiled(x, a, b, scaling, slot_ids), expected, atol=1e-4, rtol=1e-4)
    out = lora_delta(x.reshape(2, 4, IN), a, b, scaling, slot_ids)  # [..., in] inputs keep their leading dims
    torch.testing.assert_close(out.reshape(8, OUT), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_slot_mask_and_bf16(monkeypatch, backend):
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", backend)
    mask = slot_mask(torch.tensor([1, -1]), torch.tensor([0.5, 2.0]), rank=2)
    assert mask.tolist() == [[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]]
    x, a, b, scaling = _inputs(len(SLOT_IDS), seed=3)
    slot_ids = torch.tensor(SLOT_IDS)
    out = lora_delta(x.bfloat16(), a.bfloat16(), b.bfloat16(), scaling, slot_ids)
    assert out.dtype == torch.bfloat16
    expected = _loop(x.bfloat16().float(), a.bfloat16().float(), b.bfloat16().float(), scaling, slot_ids)
    torch.testing.assert_close(out.float(), expected, atol=0.15, rtol=0.03)

"""Batched multi-LoRA kernels (Triton; interpreted on CPU) against their references, and the references against a
per-row loop over merged weights W_s = scaling[s] * B_s @ A_s."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from astrai.triton_kernels.lora import (
    lora_delta,
    lora_delta_ref,
    lora_delta_segments,
    lora_delta_segments_ref,
    segment_slot_ids,
)
from helpers import AOT_PRELUDE, DEVICE, TOLERANCES, assert_close, assert_compiles_for_gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_SLOTS, IN, OUT = 4, 40, 72  # OUT spans two 64-wide column blocks; IN is no power of two


def _slots(rank: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """a [S, R, in], b [out, S, R], scaling [S]: slot 1 holds a rank R/2 adapter zero-padded to R, slot 3 is empty
    (zeros, scaling 0), as the engine fills them."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(NUM_SLOTS, rank, IN, generator=gen) / IN**0.5
    b = torch.randn(OUT, NUM_SLOTS, rank, generator=gen)
    a[1, rank // 2 :] = 0
    b[:, 1, rank // 2 :] = 0
    a[3], b[:, 3] = 0, 0
    scaling = torch.tensor([2.0, 0.5, 1.25, 0.0])
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), scaling.to(DEVICE)


def _x(num_tokens: int, dtype: torch.dtype, seed: int = 1) -> Tensor:
    """[T, IN] rows as a strided view (row stride IN + 3), as a slice of a wider activation."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, IN + 3, generator=gen).to(DEVICE, dtype)[:, 2 : IN + 2]


def _ids(values: list[int]) -> Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def _merged_loop(x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, slot_ids: Tensor) -> Tensor:
    """The contract read literally, in float64: row t times its slot's merged weight, zero without a slot."""
    out = torch.zeros(x.shape[0], b.shape[0], dtype=torch.float64)
    for t, s in enumerate(slot_ids.tolist()):
        if s >= 0:
            w = float(scaling[s]) * b[:, s, :].double().cpu() @ a[s].double().cpu()  # [out, in]
            out[t] = w @ x[t].double().cpu()
    return out


def _tol(dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCES[dtype]
    return dict(atol=atol * 4, rtol=rtol * 2)  # a rank-R and an in-wide sum, each row rounded once at the end


SLOT_IDS = [0, -1, 2, 1, 1, -1, 3, 0, 2]  # every slot, padding rows, the empty slot


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 16])
def test_gather_matches_ref(dtype: torch.dtype, rank: int) -> None:
    a, b, scaling = _slots(rank, dtype)
    x, slot_ids = _x(len(SLOT_IDS), dtype), _ids(SLOT_IDS)
    out = lora_delta(x, a, b, scaling, slot_ids)
    assert out.dtype == dtype and out.shape == (len(SLOT_IDS), OUT)
    assert_close(out, lora_delta_ref(x, a, b, scaling, slot_ids), **_tol(dtype))
    assert not out[slot_ids < 0].any() and not out[slot_ids == 3].any()


# Segments of lengths 3, 0 (empty), 18 (two 16-row tiles), 1, 0, 5 with slots mixed and -1; one uncovered row.
SEG_STARTS, SEG_SLOTS = [0, 3, 3, 21, 22, 22, 27], [2, 0, 1, -1, 3, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 16])
def test_segments_match_ref(dtype: torch.dtype, rank: int) -> None:
    a, b, scaling = _slots(rank, dtype)
    x, seg_starts, seg_slots = _x(SEG_STARTS[-1] + 1, dtype), _ids(SEG_STARTS), _ids(SEG_SLOTS)
    out = lora_delta_segments(x, a, b, scaling, seg_starts, seg_slots)
    expected = lora_delta_segments_ref(x, a, b, scaling, seg_starts, seg_slots)
    assert out.dtype == dtype
    assert_close(out, expected, **_tol(dtype))
    # the segment form is the gather form over each token's segment slot
    assert_close(out, lora_delta(x, a, b, scaling, segment_slot_ids(seg_starts, seg_slots, x.shape[0])), **_tol(dtype))
    assert not out[21:22].any() and not out[-1].any()


def test_segment_slot_ids() -> None:
    ids = segment_slot_ids(_ids(SEG_STARTS), _ids(SEG_SLOTS), SEG_STARTS[-1] + 2)
    expected = [2] * 3 + [1] * 18 + [-1] + [0] * 5 + [-1, -1]
    assert ids.tolist() == expected
    assert segment_slot_ids(_ids([0]), _ids([]), 3).tolist() == [-1, -1, -1]
    assert segment_slot_ids(_ids([1, 2]), _ids([4]), 3).tolist() == [-1, 4, -1]  # before the first segment too


@pytest.mark.parametrize("rank", [8, 16])
def test_ref_matches_merged_loop(rank: int) -> None:
    a, b, scaling = _slots(rank, torch.float32)
    x, slot_ids = _x(len(SLOT_IDS), torch.float32), _ids(SLOT_IDS)
    expected = _merged_loop(x, a, b, scaling, slot_ids)
    assert_close(lora_delta_ref(x, a, b, scaling, slot_ids), expected, atol=1e-5, rtol=1e-5)
    seg_starts, seg_slots = _ids(SEG_STARTS), _ids(SEG_SLOTS)
    xs = _x(SEG_STARTS[-1] + 1, torch.float32)
    expected = _merged_loop(xs, a, b, scaling, segment_slot_ids(seg_starts, seg_slots, xs.shape[0]))
    assert_close(lora_delta_segments_ref(xs, a, b, scaling, seg_starts, seg_slots), expected, atol=1e-5, rtol=1e-5)


def test_single_row_and_empty() -> None:
    a, b, scaling = _slots(16, torch.float32)
    x = _x(1, torch.float32)
    expected = _merged_loop(x, a, b, scaling, _ids([2]))
    assert_close(lora_delta(x, a, b, scaling, _ids([2])), expected, atol=1e-5, rtol=1e-5)
    assert_close(lora_delta_segments(x, a, b, scaling, _ids([0, 1]), _ids([2])), expected, atol=1e-5, rtol=1e-5)
    assert not lora_delta(x, a, b, scaling, _ids([-1])).any()
    empty = _x(0, torch.float32)
    assert lora_delta(empty, a, b, scaling, _ids([])).shape == (0, OUT)
    assert lora_delta_segments(empty, a, b, scaling, _ids([0]), _ids([])).shape == (0, OUT)
    assert not lora_delta_segments(_x(3, torch.float32), a, b, scaling, _ids([0]), _ids([])).any()  # G = 0


def test_wrong_slot_changes_result() -> None:
    # negative control: the kernels read each row's own slot (a wrong id, or slots swapped, shows)
    a, b, scaling = _slots(16, torch.float32)
    x, slot_ids = _x(len(SLOT_IDS), torch.float32), _ids(SLOT_IDS)
    out = lora_delta(x, a, b, scaling, slot_ids)
    wrong = slot_ids.clone()
    wrong[2] = 0
    changed = lora_delta(x, a, b, scaling, wrong)
    assert (changed[2] - out[2]).abs().max() > 0.1
    assert torch.equal(torch.cat([changed[:2], changed[3:]]), torch.cat([out[:2], out[3:]]))
    seg_starts = _ids(SEG_STARTS)
    xs = _x(SEG_STARTS[-1] + 1, torch.float32)
    seg = lora_delta_segments(xs, a, b, scaling, seg_starts, _ids(SEG_SLOTS))
    swapped = lora_delta_segments(xs, a, b, scaling, seg_starts, _ids([0, 0, 1, -1, 3, 2]))
    assert (swapped[:3] - seg[:3]).abs().max() > 0.1 and (swapped[22:27] - seg[22:27]).abs().max() > 0.1
    assert torch.equal(swapped[3:22], seg[3:22])


def test_unused_slots_are_not_read() -> None:
    # NaN in a slot no row uses (and in slot 0, which padding rows would gather in a sloppy kernel) never leaks
    a, b, scaling = _slots(16, torch.float32)
    a[0], b[:, 0] = float("nan"), float("nan")
    ids = [2, -1, 1, -1]
    x = _x(len(ids), torch.float32)
    out = lora_delta(x, a, b, scaling, _ids(ids))
    assert_close(out, _merged_loop(x, a, b, scaling, _ids(ids)), atol=1e-5, rtol=1e-5)
    seg = lora_delta_segments(x, a, b, scaling, _ids([0, 1, 2, 3, 4]), _ids(ids))
    assert_close(seg, out, atol=1e-5, rtol=1e-5)


def test_inputs_unchanged_and_opcheck() -> None:
    a, b, scaling = _slots(8, torch.float32)
    x, slot_ids = _x(5, torch.float32).contiguous(), _ids([1, -1, 0, 2, 2])
    seg_starts, seg_slots = _ids([0, 2, 5]), _ids([1, -1])
    before = [t.clone() for t in (x, a, b, scaling, slot_ids, seg_starts, seg_slots)]
    torch.library.opcheck(lora_delta, (x, a, b, scaling, slot_ids))
    torch.library.opcheck(lora_delta_segments, (x, a, b, scaling, seg_starts, seg_slots))
    for t, old in zip((x, a, b, scaling, slot_ids, seg_starts, seg_slots), before, strict=True):
        assert torch.equal(t, old)


@pytest.mark.parametrize("form", ["gather", "segments"])
def test_compiles_fullgraph(form: str) -> None:
    a, b, scaling = _slots(8, torch.float32)
    x = _x(5, torch.float32)
    args = (_ids([1, -1, 0, 2, 2]),) if form == "gather" else (_ids([0, 2, 5]), _ids([1, 2]))
    op, ref = (lora_delta, lora_delta_ref) if form == "gather" else (lora_delta_segments, lora_delta_segments_ref)
    for fn in (op, ref):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")  # fails on a graph break or a sync
        assert_close(compiled(x, a, b, scaling, *args), ref(x, a, b, scaling, *args), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_larger_shapes(dtype: torch.dtype) -> None:
    # real tile sizes: 64-row segment tiles, column splits, R = 64; and no host sync
    gen = torch.Generator().manual_seed(0)
    num_slots, rank, width, out_width = 8, 64, 1024, 1536
    a = (torch.randn(num_slots, rank, width, generator=gen) / width**0.5).to("cuda", dtype)
    b = (torch.randn(out_width, num_slots, rank, generator=gen) / rank**0.5).to("cuda", dtype)
    scaling = torch.rand(num_slots, generator=gen).cuda()
    x = torch.randn(700, width, generator=gen).to("cuda", dtype)
    seg_starts, seg_slots = _ids([0, 100, 100, 400, 650, 700]).cuda(), _ids([3, 0, 7, -1, 1]).cuda()
    slot_ids = torch.randint(-1, num_slots, (700,), generator=gen).cuda()
    atol, rtol = TOLERANCES[dtype]
    assert_close(lora_delta(x, a, b, scaling, slot_ids), lora_delta_ref(x, a, b, scaling, slot_ids), atol=atol * 4,
                 rtol=rtol * 2)  # fmt: skip
    expected = lora_delta_segments_ref(x, a, b, scaling, seg_starts, seg_slots)
    out = lora_delta_segments(x, a, b, scaling, seg_starts, seg_slots)
    assert_close(out, expected, atol=atol * 4, rtol=rtol * 2)
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora_delta(x, a, b, scaling, slot_ids)
        lora_delta_segments(x, a, b, scaling, seg_starts, seg_slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# Both kernels' GPU variants (16-bit and fp32, R padded to 16, R = 64, decode and prefill tiles) built to PTX and
# cubin for sm_80 and sm_90 without a device: the interpreter accepts programs the compiler rejects.
_AOT_SCRIPT = (
    AOT_PRELUDE
    + """
from astrai.triton_kernels.lora import _lora_gather_kernel, _lora_segment_kernel

ptrs = ("x_ptr", "a_ptr", "b_ptr", "out_ptr")
for dt, rank, block_r, bk, bn in [("bf16", 16, 16, 256, 256), ("fp16", 8, 16, 256, 256), ("fp32", 64, 64, 64, 64)]:
    types = {n: "*" + dt for n in ptrs}
    types.update(scaling_ptr="*fp32", slot_ids_ptr="*i64")
    build(_lora_gather_kernel, types, dict(RANK=rank, BLOCK_R=block_r, BLOCK_K=bk, BLOCK_N=bn), num_warps=4)
for dt, rank, block_r, block_m in [("bf16", 16, 16, 64), ("fp16", 8, 16, 16), ("fp32", 64, 64, 64)]:
    types = {n: "*" + dt for n in ptrs}
    types.update(scaling_ptr="*fp32", seg_starts_ptr="*i64", seg_slots_ptr="*i64", tile_seg_ptr="*i64",
                 tile_row_ptr="*i64")
    consts = dict(RANK=rank, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64, BLOCK_N=128, UPCAST=False)
    build(_lora_segment_kernel, types, consts, num_warps=4)
"""
)


def test_compiles_for_gpu_targets() -> None:
    assert_compiles_for_gpu(_AOT_SCRIPT)

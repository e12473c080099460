"""Batched multi-LoRA update: each row of a step adds the low-rank update of its own adapter (Punica's BGMV/SGMV).

The engine keeps up to S adapters in *slots* (`astrai.nn.lora_slots`): per adapted projection W [out, in] the
tensors a [S, R, in] and b [out, S, R] (adapters of rank r < R are zero-padded) and one scaling [S] (alpha / r;
0 for an empty slot). A step passes `slot_ids` [rows], the slot of each row (-1: no adapter), so the compiled
steps never change shape or recompile for a new mix of adapters, and

    delta[t] = scaling[s] * (x[t] @ a[s].T) @ b[:, s, :].T    with s = slot_ids[t] (0 when s < 0)

Three implementations:
- CPU with AVX-512 (fp32, or bf16 with AVX512-BF16; `astrai.cpu_kernels.lora`, the `astrai::cpu_lora_delta` op):
  a hand-written kernel where each row reads only its own slot's factors (the gather form without the gather
  copy), so the cost does not grow with the number of slots.
- Elsewhere on CPU (and `ASTRAI_ATTN_BACKEND=torch`, or `ASTRAI_CPU_KERNELS=0`): the *slot-masked* form. One
  product with every slot's A at once (x @ a.view(S*R, in).T, [rows, S*R]), a mask that keeps each row's own
  slot's R columns times its scaling, and one product with every slot's B (b.view(out, S*R)): plain torch that
  traces anywhere, but with S times the kernel's arithmetic (with 8 slots at rank 16, +37% on a SmolLM2-135M
  step's products; docs/benchmarks.md).
- CUDA (or `ASTRAI_ATTN_BACKEND=triton`): the Triton kernels (`astrai.triton_kernels.lora`): the gather form for
  decode rows (one program per row reads its slot's factors) and the segment form for prefill (`seg_starts`,
  `seg_slots`: a prompt's tokens share their adapter's factors in one tile).

No backward: serving only (training uses `astrai.nn.lora`'s own tree).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from astrai.cpu_kernels import lora as cpu_lora
from astrai.ops.backend import attn_backend
from astrai.ops.linear import linear


def slot_mask(slot_ids: Tensor, scaling: Tensor, rank: int) -> Tensor:
    """[rows, S*R] float32: scaling[s] on the R columns of row t's slot s = slot_ids[t], 0 elsewhere (and on
    rows without an adapter)."""
    num_slots = scaling.shape[0]
    column_slot = torch.arange(num_slots * rank, device=slot_ids.device) // rank
    mine = slot_ids.reshape(-1, 1) == column_slot.reshape(1, -1)
    return torch.where(mine, scaling.float()[column_slot].reshape(1, -1), 0.0)


def lora_delta_masked(x: Tensor, a: Tensor, b: Tensor, scaling: Tensor, slot_ids: Tensor) -> Tensor:
    """The slot-masked form (see the module docstring); x [rows, in] -> [rows, out] in x's dtype."""
    num_slots, rank, width = a.shape
    shrunk = linear(x, a.reshape(num_slots * rank, width).to(x.dtype))  # [rows, S*R]
    weighted = (shrunk.float() * slot_mask(slot_ids, scaling, rank)).to(x.dtype)
    return linear(weighted, b.reshape(b.shape[0], num_slots * rank).to(x.dtype))


def _cpu_kernel(x: Tensor, a: Tensor, b: Tensor) -> bool:
    """Whether the AVX-512 kernel takes this product: CPU tensors of one dtype it runs, a rank it holds, and no
    `ASTRAI_ATTN_BACKEND=torch` asking for the plain-torch form."""
    return (x.device.type == "cpu" and a.dtype == b.dtype == x.dtype and a.shape[1] <= cpu_lora.MAX_RANK
            and os.environ.get("ASTRAI_ATTN_BACKEND", "auto") == "auto" and cpu_lora.supports(x.dtype))  # fmt: skip


def lora_delta(
    x: Tensor,
    a: Tensor,
    b: Tensor,
    scaling: Tensor,
    slot_ids: Tensor,
    seg_starts: Tensor | None = None,
    seg_slots: Tensor | None = None,
) -> Tensor:
    """Each row's adapter update: x [..., in] -> [..., out] in x's dtype (fp32 accumulation).

    Args:
        a: [S, R, in]; b: [out, S, R]; scaling: [S] (alpha / r per slot, 0 when empty).
        slot_ids: [rows] int64, rows = x.numel() // in; -1 for rows without an adapter.
        seg_starts, seg_slots: optional prefill segments (token offsets [G + 1], a slot per segment) for the GPU
            segment kernel; the other paths read `slot_ids` only.
    """
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)
    if attn_backend(x) == "triton":
        from astrai.triton_kernels import lora as kernels

        if seg_starts is not None and seg_slots is not None:
            out = kernels.lora_delta_segments(rows, a, b, scaling, seg_starts, seg_slots)
        else:
            out = kernels.lora_delta(rows, a, b, scaling, slot_ids)
    elif _cpu_kernel(rows, a, b):
        out = torch.ops.astrai.cpu_lora_delta(rows, a, b, scaling.float(), slot_ids.long()).to(x.dtype)
    else:
        out = lora_delta_masked(rows, a, b, scaling, slot_ids)
    return out.reshape(*lead, b.shape[0])

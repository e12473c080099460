"""Adapter slots: the served tree's room for `max_loras` LoRA adapters at once (multi-LoRA serving, issue 44).

`with_lora_slots(params, max_loras, max_rank)` turns every attention and MLP projection into a
`SlotLoRALinearParams`: the base weight (the same tensor, not a copy) plus zeroed slot tensors a [S, R, in] and
b [out, S, R], and one scaling [S] shared by every projection. Adapters move in and out of slots in place
(`write_slot`, `clear_slot`), so compiled steps and CUDA graphs that hold the tensors see the new values and
never recompile. A step binds its rows' slots (`bind_slots(params, slot_ids)`, inside the compiled step: the
tree is rebuilt without the attrs `__init__`, DESIGN F2), and `nn.linear.linear` adds each row's update through
`astrai.ops.lora.lora_delta`. With no `slot_ids` bound the tree computes the base model.

An adapter of rank r < R fills the first r rows of its slot's a and columns of its b; the rest stays zero, so it
adds nothing. A projection an adapter does not target keeps a zero slot.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import Tensor

from astrai.nn.linear import LinearParams, SlotLoRALinearParams
from astrai.nn.lora import TARGETABLE, LoRAParams, _linears, _map_linears

T = TypeVar("T")

__all__ = ["bind_slots", "clear_slot", "slot_linears", "with_lora_slots", "write_slot"]


def with_lora_slots(params: T, *, max_loras: int, max_rank: int, dtype: torch.dtype | None = None) -> T:
    """`params` with every targetable projection (q/k/v/o, gate/up/down) given `max_loras` empty slots of rank
    `max_rank`; base tensors are shared. Slot factors take each weight's dtype (or `dtype`), on its device.

    Raises:
        ValueError: bad sizes, an int8 projection (no LoRA over quantized weights), or a tree already carrying
            adapters.
    """
    if max_loras < 1 or max_rank < 1:
        raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
    scaling: dict[str, Tensor] = {}  # one tensor for the whole tree (made on the first projection's device)

    def slots(path: str, lin: LinearParams) -> LinearParams:
        if path.rpartition(".")[2] not in TARGETABLE:
            return lin
        if type(lin) is not LinearParams:
            raise ValueError(f"{path} already carries adapters: pass the base tree")
        if lin.scale is not None:
            raise ValueError(f"{path} is int8-quantized: multi-LoRA serving needs float weights (load without "
                             "quantize)")  # fmt: skip
        out_f, in_f = lin.weight.shape
        kw = dict(device=lin.weight.device, dtype=dtype or lin.weight.dtype)
        if "all" not in scaling:
            scaling["all"] = torch.zeros(max_loras, dtype=torch.float32, device=lin.weight.device)
        return SlotLoRALinearParams(weight=lin.weight, bias=lin.bias, scale=None,
                                    lora_a=torch.zeros(max_loras, max_rank, in_f, **kw),
                                    lora_b=torch.zeros(out_f, max_loras, max_rank, **kw),
                                    scaling=scaling["all"])  # fmt: skip

    return _map_linears(params, slots)


def slot_linears(params: Any) -> dict[str, SlotLoRALinearParams]:
    """Key path -> slotted projection, in tree order."""
    return {path: lin for path, lin in _linears(params) if isinstance(lin, SlotLoRALinearParams)}


@torch.no_grad()
def write_slot(params: Any, slot: int, lora: LoRAParams, scaling: float) -> None:
    """Copy adapter `lora` into slot `slot` of every slotted projection (zeros where it has no adapter), in place.

    Raises:
        ValueError: the adapter's rank exceeds the slots', it names a projection without slots, or a factor's
            shape does not fit its projection.
    """
    slotted = slot_linears(params)
    unknown = sorted(set(lora) - set(slotted))
    if unknown:
        raise ValueError(f"the adapter targets {unknown[:3]}, which have no LoRA slots in the served model")
    for path, lin in slotted.items():
        max_rank = lin.lora_a.shape[1]
        lin.lora_a[slot].zero_()
        lin.lora_b[:, slot].zero_()
        ad = lora.get(path)
        if ad is None:
            continue
        rank = ad.lora_a.shape[0]
        if rank > max_rank:
            raise ValueError(f"the adapter's rank {rank} is above max_lora_rank {max_rank}")
        if tuple(ad.lora_a.shape[1:]) != tuple(lin.lora_a.shape[2:]) or ad.lora_b.shape[0] != lin.lora_b.shape[0]:
            raise ValueError(f"{path}: lora_a {tuple(ad.lora_a.shape)} / lora_b {tuple(ad.lora_b.shape)} do not fit "
                             f"weight {tuple(lin.weight.shape)}")  # fmt: skip
        lin.lora_a[slot, :rank].copy_(ad.lora_a)
        lin.lora_b[:, slot, :rank].copy_(ad.lora_b)
    next(iter(slotted.values())).scaling[slot] = scaling


@torch.no_grad()
def clear_slot(params: Any, slot: int) -> None:
    """Empty slot `slot` (zero factors and scaling): rows naming it compute the base model."""
    slotted = slot_linears(params)
    for lin in slotted.values():
        lin.lora_a[slot].zero_()
        lin.lora_b[:, slot].zero_()
    if slotted:
        next(iter(slotted.values())).scaling[slot] = 0.0


_FIELDS = ("weight", "bias", "scale", "lora_a", "lora_b", "scaling")


def bind_slots(params: T, slot_ids: Tensor, seg_starts: Tensor | None = None, seg_slots: Tensor | None = None) -> T:
    """`params` with every slotted projection reading `slot_ids` (and the prefill segments) for its rows; runs
    inside `torch.compile(fullgraph=True)` (object.__new__ rather than the attrs `__init__`, DESIGN F2)."""

    def bind(path: str, lin: LinearParams) -> LinearParams:
        if not isinstance(lin, SlotLoRALinearParams):
            return lin
        out = object.__new__(SlotLoRALinearParams)
        for name in _FIELDS:
            object.__setattr__(out, name, getattr(lin, name))
        object.__setattr__(out, "slot_ids", slot_ids)
        object.__setattr__(out, "seg_starts", seg_starts)
        object.__setattr__(out, "seg_slots", seg_slots)
        return out

    return _map_linears(params, bind)

"""The per-step input of multi-LoRA serving: which adapter slot each row of a step reads (`step.LoRARows`).

Built on the host beside the step's attention metadata (`ModelRunner.plan_step`). A decode step has one slot per
row (a speculating sequence's k + 1 rows share its slot); a prefill step one per token, plus its segments (each
request's tokens, which share a slot: the GPU's segment kernel reads them). Rows of sequences without an adapter
and padding rows read slot -1 (no update). A step where no row has an adapter gets None and runs the base
model's graph, which does no LoRA work at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from astrai.inference.plan import ScheduledSeq
from astrai.inference.step import LoRARows
from astrai.ops.attention import AttnMeta


def lora_rows(plan: Sequence[ScheduledSeq], meta: AttnMeta) -> LoRARows | None:
    """Each row's adapter slot for the step `plan` whose (padded) host metadata is `meta`; None when no sequence
    of the step has an adapter."""
    if all(item.seq.lora_slot < 0 for item in plan):
        return None
    if meta.decode:
        ids = [item.seq.lora_slot for item in plan for _ in range(item.num_new)]
        ids += [-1] * (meta.positions.shape[0] - len(ids))  # padding rows
        return LoRARows(torch.tensor(ids, dtype=torch.int64))
    slots = [item.seq.lora_slot for item in plan]
    slots += [-1] * (meta.seq_lens.shape[0] - len(slots))  # padding requests
    return _segments(torch.tensor(slots, dtype=torch.int64), meta)


def padding_rows(meta: AttnMeta) -> LoRARows:
    """Slot -1 on every row of `meta`'s step: what warming up the LoRA variant of a compiled step runs."""
    if meta.decode:
        return LoRARows(torch.full((meta.positions.shape[0],), -1, dtype=torch.int64))
    return _segments(torch.full((meta.seq_lens.shape[0],), -1, dtype=torch.int64), meta)


def _segments(slots: torch.Tensor, meta: AttnMeta) -> LoRARows:
    starts = meta.cu_seqlens_q.to(torch.int64)
    return LoRARows(torch.repeat_interleave(slots, starts.diff()), starts, slots)

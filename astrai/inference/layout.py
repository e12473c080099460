"""The tree the engine serves: the model's own, or a copy with q/k/v and gate/up fused (`astrai.models.fuse`).

`EngineConfig.fuse_projections` decides: True fuses, False never does, None (the default) fuses on CUDA when the
copy takes at most a quarter of the free device memory, and never on CPU, where fused compiled decode steps
measured no consistent gain (docs/inference.md, "Fused projections"). A tensor-parallel engine does not fuse: its
ranks shard the checkpoint layout themselves (`astrai.models.tp`).
"""

from __future__ import annotations

import logging

import attrs
import torch

from astrai.io.model import Model
from astrai.models.decoder import DecoderParams
from astrai.models.fuse import fuse_projections, fused_bytes
from astrai.tree import leaves, same_structure

logger = logging.getLogger(__name__)

FREE_MEMORY_SHARE = 4  # the default fuses when the copy needs at most 1/4 of the free device memory


def should_fuse(model: Model, fuse: bool | None, *, tensor_parallel: bool) -> bool:
    """Whether the engine serves `model` with fused projections (see the module docstring)."""
    if tensor_parallel:
        if fuse:
            logger.warning("fuse_projections is ignored under tensor parallel: the ranks shard the unfused layout")
        return False
    if fuse is not None:
        return fuse
    if model.device.type != "cuda":
        return False
    need, (free, _) = fused_bytes(model.params), torch.cuda.mem_get_info(model.device)
    if need > free // FREE_MEMORY_SHARE:
        why = "EngineConfig.fuse_projections=False silences this"
        logger.warning("not fusing q/k/v and gate/up: the copy (%.2f GiB) would take over a quarter of the free "
                       "%.2f GiB (%s)", need / 2**30, free / 2**30, why)  # fmt: skip
        return False
    return True


def layout_difference(old: DecoderParams, new: DecoderParams) -> str | None:
    """What keeps the engine from serving `new` in place of `old` with the steps compiled for `old` (None: nothing):
    another tree structure, or a leaf of another shape, stride, dtype or device. The compiled steps do not guard
    on the parameters themselves (`step.without_param_guards`), so this check is what keeps them right."""
    if not same_structure(old, new):
        return "another tree structure (layer types, present fields or static values)"
    for i, (a, b) in enumerate(zip(leaves(old), leaves(new), strict=True)):
        if (a.shape, a.stride(), a.dtype, a.device) != (b.shape, b.stride(), b.dtype, b.device):
            return (f"leaf {i}: shape {tuple(b.shape)} stride {b.stride()} {b.dtype} on {b.device}, served "
                    f"{tuple(a.shape)} stride {a.stride()} {a.dtype} on {a.device}")  # fmt: skip
    return None


def served_model(model: Model, fuse: bool, *, into: Model | None = None) -> Model:
    """`model` itself, or a copy of it whose params are in the fused layout; with `into` (the model served so
    far), its fused tensors are overwritten with `model`'s values instead of allocating new ones (an in-place
    optimizer step on `model`, or new tensors from `Engine.update_params`)."""
    if not fuse:
        return model
    return attrs.evolve(model, params=fuse_projections(model.params, into=None if into is None else into.params))

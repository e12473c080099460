"""The notebook-facing functions of `astrai` (SPEC §1): forward over a loaded `Model`.

`astrai.load` / `astrai.save` live in `astrai.io.model`, `astrai.generate` in `astrai.inference.generate`;
`astrai/__init__.py` re-exports all of them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astrai.io.model import Model
from astrai.models.decoder import forward as decoder_forward


def forward(model: Model, input_ids: Tensor, *, positions: Tensor | None = None) -> Tensor:
    """Causal next-token logits of a batch, no cache.

    Args:
        model: a loaded model.
        input_ids: [B, T] token ids (moved to the model's device).
        positions: optional [B, T] position ids (default 0..T-1 per row).

    Returns:
        [B, T, V] float32 logits.
    """
    if input_ids.dim() == 1:
        raise ValueError(f"input_ids must be [B, T]; got a 1-D tensor of shape {tuple(input_ids.shape)} (add [None])")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    ids = input_ids.to(model.device)
    with torch.inference_mode():
        return decoder_forward(model.params, model.config, ids, positions=positions)

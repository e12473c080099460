"""The notebook-facing functions of `astrai` (SPEC §1): forward and embed over a loaded `Model`.

`astrai.load` / `astrai.save` live in `astrai.io.model`, `astrai.generate` in `astrai.inference.generate`,
`astrai.embed_ids` in `astrai.inference.embed` (the server's `/v1/embeddings` calls it too);
`astrai/__init__.py` re-exports all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from astrai.inference.embed import embed_ids as embed_ids
from astrai.io.model import Model
from astrai.models.decoder import forward as decoder_forward
from astrai.models.encoder import Pooling


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


def embed(model: Model, texts: str | Sequence[str], *, pooling: Pooling = "mean", normalize: bool = True,
          batch_size: int = 32) -> Tensor:  # fmt: skip
    """Embed texts: tokenize with the model's tokenizer (special tokens as it adds them), then `embed_ids`.

    Returns:
        [N, E] float32 on the model's device (a single string counts as N = 1).
    """
    if model.tokenizer is None:
        raise ValueError("the model has no tokenizer (no tokenizer.json in its folder): use astrai.embed_ids")
    items = [texts] if isinstance(texts, str) else list(texts)
    for i, text in enumerate(items):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
    return embed_ids(model, model.tokenizer.encode_batch(items), pooling=pooling, normalize=normalize,
                     batch_size=batch_size)  # fmt: skip

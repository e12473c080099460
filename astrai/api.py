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


def forward(model: Model, input_ids: Tensor | Sequence[Sequence[int]], *, positions: Tensor | None = None) -> Tensor:
    """Causal next-token logits of a batch, no cache.

    Args:
        model: a loaded model.
        input_ids: [B, T] token ids in [0, vocab_size), as an integer tensor (moved to the model's device) or
            nested lists of ints.
        positions: optional [B, T] integer position ids (default 0..T-1 per row).

    Returns:
        [B, T, V] float32 logits.

    Raises:
        ValueError: ids that are not a non-empty [B, T] integer batch, ids outside [0, vocab_size), or positions
            of another shape or dtype (checked here: inside the model they are an IndexError from torch).
    """
    ids = _ids_tensor(input_ids)
    vocab = model.config.vocab_size
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        bad = ids[(ids < 0) | (ids >= vocab)].unique()[:5].tolist()
        raise ValueError(f"input_ids outside [0, {vocab}) (the vocabulary): {bad}")
    if positions is not None:
        if not isinstance(positions, Tensor) or positions.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"positions must be an integer tensor, got {_describe(positions)}")
        if tuple(positions.shape) != tuple(ids.shape):
            raise ValueError(f"positions has shape {tuple(positions.shape)}, input_ids {tuple(ids.shape)}")
        positions = positions.to(model.device)
    with torch.inference_mode():
        return decoder_forward(model.params, model.config, ids.to(model.device), positions=positions)


def _describe(value: object) -> str:
    return f"a {value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__


def _ids_tensor(input_ids: object) -> Tensor:
    """`input_ids` as a [B, T] integer tensor with B, T >= 1, or a ValueError saying what it is instead."""
    if not isinstance(input_ids, Tensor):
        if isinstance(input_ids, str | bytes) or not isinstance(input_ids, Sequence):
            raise ValueError(f"input_ids must be a [B, T] integer tensor or a list of token-id lists, got "
                             f"{type(input_ids).__name__}")  # fmt: skip
        try:
            input_ids = torch.tensor(input_ids)
        except (TypeError, ValueError, RuntimeError, OverflowError) as err:
            raise ValueError(f"input_ids must be equal-length lists of ints ([B, T]): {err}") from None
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be integers, got {input_ids.dtype}")
    if input_ids.dim() == 1:
        raise ValueError(f"input_ids must be [B, T]; got a 1-D tensor of shape {tuple(input_ids.shape)} (add [None])")
    if input_ids.dim() != 2 or not input_ids.numel():
        raise ValueError(f"input_ids must be a non-empty [B, T] batch, got shape {tuple(input_ids.shape)}")
    return input_ids


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

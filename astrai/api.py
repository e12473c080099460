"""The notebook-facing functions of `astrai` (SPEC §1): forward and embed over a loaded `Model`.

`astrai.load` / `astrai.save` live in `astrai.io.model`, `astrai.generate` in `astrai.inference.generate`;
`astrai/__init__.py` re-exports all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from astrai.io.model import Model
from astrai.models.decoder import forward as decoder_forward
from astrai.models.encoder import EncoderConfig, Pooling, encode


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


def embed_ids(model: Model, ids: Sequence[Sequence[int]], *, pooling: Pooling = "mean", normalize: bool = True,
              batch_size: int = 32) -> Tensor:  # fmt: skip
    """Embed token-id sequences with the model's blocks run bidirectionally (see `astrai.models.encoder`).

    Args:
        model: a loaded model (any decoder checkpoint; its LM head is not used).
        ids: N non-empty token-id lists, each at most `max_position_embeddings` long.
        pooling: "mean" (masked mean), "cls" (first token) or "last" (last token).
        normalize: L2-normalise each vector.
        batch_size: rows per forward pass (rows of similar length are batched together to limit padding).

    Returns:
        [N, E] float32 on the model's device, in the order of `ids`.
    """
    enc = EncoderConfig(pooling=pooling, normalize=normalize)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rows = [list(r) for r in ids]
    cfg, limit = model.config, model.config.max_position_embeddings
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"input {i} is empty: every input needs at least one token")
        if len(row) > limit:
            raise ValueError(f"input {i} has {len(row)} tokens; the model's limit is {limit}")
        bad = [t for t in row if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"input {i} has token id {bad[0]!r} outside [0, {cfg.vocab_size})")
    out = torch.empty(len(rows), cfg.hidden_size, dtype=torch.float32, device=model.device)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # similar lengths share a batch
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            width = len(rows[chunk[0]])
            tokens = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.bool)
            for r, i in enumerate(chunk):  # right padding
                tokens[r, : len(rows[i])] = torch.tensor(rows[i])
                mask[r, : len(rows[i])] = True
            vectors = encode(model.params, cfg, tokens.to(model.device), mask.to(model.device), enc=enc)
            out[torch.tensor(chunk, device=model.device)] = vectors
    return out


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

"""Embeddings: token-id sequences -> one pooled vector each, the model's blocks run bidirectionally.

Shared by the notebook facade (`astrai.embed_ids` / `astrai.embed`) and the server (`POST /v1/embeddings`).
The encoder is the dense forward without a KV cache (`astrai.models.encoder.encode`), so it never touches an
engine's KV pool or scheduler. Rows are sorted by length and batched so that similar lengths share a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from astrai.io.model import Model
from astrai.models.config import ModelConfig
from astrai.models.encoder import EncoderConfig, Pooling, encode


def check_ids(cfg: ModelConfig, rows: Sequence[Sequence[int]]) -> None:
    """Raise ValueError naming the first input that is empty, too long, or holds an id outside the vocabulary."""
    limit = cfg.max_position_embeddings
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"input {i} is empty: every input needs at least one token")
        if len(row) > limit:
            raise ValueError(f"input {i} has {len(row)} tokens; the model's limit is {limit}")
        bad = [t for t in row if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"input {i} has token id {bad[0]!r} outside [0, {cfg.vocab_size})")


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
    rows, cfg = [list(r) for r in ids], model.config
    check_ids(cfg, rows)
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

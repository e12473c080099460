"""Embeddings: token-id sequences -> one pooled vector each, the model's blocks run bidirectionally.

Shared by the notebook facade (`astrai.embed_ids` / `astrai.embed`) and the server (`POST /v1/embeddings`).
The encoder is the dense forward without a KV cache (`astrai.models.encoder.encode`), so it never touches an
engine's KV pool or scheduler. Rows are sorted by length and batched so that similar lengths share a batch
(`plan_batches`); each batch is one encoder pass (`encode_rows`). The server runs those passes one at a time on
its own worker, taking turns between requests (`astrai.serve.embeddings_api`); `embed_ids` runs them in a row.
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


def plan_batches(lengths: Sequence[int], *, batch_size: int = 32, max_batch_tokens: int | None = None
                 ) -> list[list[int]]:  # fmt: skip
    """Row indices grouped into encoder passes, longest rows first so that similar lengths share a pass.

    A pass holds at most `batch_size` rows and, with `max_batch_tokens`, at most that many padded tokens (its
    rows times its longest row's length): the step budget that bounds how long one pass holds the encoder and
    how much activation memory it needs. A single row longer than the budget runs alone (an encoder row cannot
    be split: its attention is bidirectional).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_batch_tokens is not None and max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    batches: list[list[int]] = []
    chunk: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: equal lengths keep their order
        width = lengths[chunk[0]] if chunk else 0  # a pass is as wide as its first (longest) row
        over = max_batch_tokens is not None and (len(chunk) + 1) * width > max_batch_tokens
        if chunk and (len(chunk) >= batch_size or over):
            batches.append(chunk)
            chunk = []
        chunk.append(i)
    if chunk:
        batches.append(chunk)
    return batches


def encode_rows(model: Model, rows: Sequence[Sequence[int]], enc: EncoderConfig) -> Tensor:
    """One encoder pass over `rows` (right-padded to the longest) -> [len(rows), E] float32 on the model's device.

    The rows are not checked here (`check_ids` first).
    """
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):  # right padding
        tokens[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = True
    with torch.inference_mode():
        return encode(model.params, model.config, tokens.to(model.device), mask.to(model.device), enc=enc)


def embed_ids(model: Model, ids: Sequence[Sequence[int]], *, pooling: Pooling = "mean", normalize: bool = True,
              batch_size: int = 32, max_batch_tokens: int | None = None) -> Tensor:  # fmt: skip
    """Embed token-id sequences with the model's blocks run bidirectionally (see `astrai.models.encoder`).

    Args:
        model: a loaded model (any decoder checkpoint; its LM head is not used).
        ids: N non-empty token-id lists, each at most `max_position_embeddings` long.
        pooling: "mean" (masked mean), "cls" (first token) or "last" (last token).
        normalize: L2-normalise each vector.
        batch_size: rows per forward pass (rows of similar length are batched together to limit padding).
        max_batch_tokens: padded tokens per forward pass at most (`plan_batches`); None: only `batch_size` bounds.

    Returns:
        [N, E] float32 on the model's device, in the order of `ids`.
    """
    enc = EncoderConfig(pooling=pooling, normalize=normalize)
    rows, cfg = [list(r) for r in ids], model.config
    batches = plan_batches([len(r) for r in rows], batch_size=batch_size, max_batch_tokens=max_batch_tokens)
    check_ids(cfg, rows)
    out = torch.empty(len(rows), cfg.hidden_size, dtype=torch.float32, device=model.device)
    for chunk in batches:
        out[torch.tensor(chunk, device=model.device)] = encode_rows(model, [rows[i] for i in chunk], enc)
    return out

"""Per-kind shard builders: buffer rendered documents, then turn the buffer into one shard's arrays.

- pretrain: documents end with EOS and are concatenated into one token stream (`tokens`, `doc_offsets`).
- sft: documents are packed into rows (`tokens`, `positions` restarting at 0 per document or chunk,
  `loss_mask` = 1 on trained tokens, `row_offsets`).
- dpo: prompt+chosen and prompt+rejected, each with its mask; both sides must have trained tokens.
- grpo: prompt ids (ending with the generation prompt) and, if configured, the answer string per prompt.

`add` raises `RecordError` (counted by the caller) for a record the kind cannot use; `take` empties the buffer.
Masks here are token-aligned (1 = this token is trained); the datasets shift them onto targets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from astrai.data.config import DataConfig
from astrai.data.packing import pack
from astrai.data.render import Doc, RecordError, truncate
from astrai.data.shards import offsets, token_dtype


@attrs.define
class ShardArrays:
    """One shard's content and stats."""

    arrays: dict[str, np.ndarray]
    answers: list | None
    rows: int
    tokens: int
    trained_tokens: int


def _trained(doc: Doc) -> int:
    return int(doc.mask[1:].sum())  # a document's first token is never a target


@attrs.define
class Builder:
    """Buffers documents of one kind; see the module docstring for what each kind writes."""

    cfg: DataConfig
    vocab_size: int
    eos_id: int | None
    docs: list[list[Doc]] = attrs.Factory(list)
    answers: list[str | None] = attrs.Factory(list)
    buffered_tokens: int = 0

    def add(self, record: Mapping[str, Any], docs: list[Doc]) -> bool:
        """Buffer a rendered record; returns whether a side was truncated. Raises RecordError if unusable."""
        pre, kind = self.cfg.preprocessing, self.cfg.kind
        answer = self._answer(record) if kind == "grpo" else None
        if kind == "pretrain":
            cut = [self._with_eos(docs[0])]
        else:
            cut = [truncate(d, self._max_len, pre.truncation_mode) for d in docs]
        docs = [d for d, _ in cut]
        if kind in ("sft", "dpo"):
            for d, side in zip(docs, ("chosen", "rejected") if kind == "dpo" else ("document",), strict=True):
                if _trained(d) == 0:
                    raise RecordError("no_trained_tokens", f"the {side} has no trained token after truncation")
        self.docs.append(docs)
        if kind == "grpo":
            self.answers.append(answer)
        self.buffered_tokens += sum(len(d) for d in docs)
        return any(c for _, c in cut)

    @property
    def _max_len(self) -> int | None:
        # SFT rows hold whole documents unless bfd_split may cut them, so cut here where the mask check sees it
        pre = self.cfg.preprocessing
        if self.cfg.kind != "sft" or pre.packing_strategy == "bfd_split":
            return pre.max_seq_len
        return min(pre.max_seq_len or pre.max_packed_len, pre.max_packed_len)

    def _answer(self, record: Mapping[str, Any]) -> str | None:
        field = self.cfg.answer_field
        if field is None:
            return None
        value = record.get(field)
        if value is None:
            raise RecordError("missing_field", f"no field {field!r}")
        if not isinstance(value, str):
            raise RecordError("wrong_type", f"field {field!r} must be a string, got {type(value).__name__}")
        return value

    def _with_eos(self, doc: Doc) -> tuple[Doc, bool]:
        assert self.eos_id is not None
        ids = doc.ids
        if len(ids) and ids[-1] == self.eos_id:  # the post-processor already ends documents with EOS
            ids = ids[:-1]
        max_len, cut = self.cfg.preprocessing.max_seq_len, False
        if max_len is not None and len(ids) >= max_len:  # truncate the text, keep the EOS
            cut = True
            ids = truncate(Doc(ids, doc.mask[: len(ids)]), max_len - 1, self.cfg.preprocessing.truncation_mode)[0].ids
        return Doc(np.append(ids, self.eos_id), np.ones(len(ids) + 1, np.uint8)), cut

    def take(self) -> ShardArrays:
        """The buffered documents as one shard's arrays; clears the buffer."""
        docs, answers = self.docs, self.answers
        self.docs, self.answers, self.buffered_tokens = [], [], 0
        tok = token_dtype(self.vocab_size)
        if self.cfg.kind == "sft":
            return self._packed([d[0] for d in docs], tok)
        names = {"pretrain": ("tokens",), "dpo": ("chosen", "rejected"), "grpo": ("prompt",)}[self.cfg.kind]
        arrays: dict[str, np.ndarray] = {}
        for i, name in enumerate(names):
            side = [d[i] for d in docs]
            arrays[name] = _concat([d.ids for d in side], tok)
            arrays["doc_offsets" if name == "tokens" else f"{name}_offsets"] = offsets([len(d) for d in side])
            if self.cfg.kind == "dpo":
                arrays[f"{name}_mask"] = _concat([d.mask for d in side], np.dtype(np.uint8))
        tokens = sum(len(d) for row in docs for d in row)
        trained = {"pretrain": tokens, "dpo": sum(_trained(d) for row in docs for d in row), "grpo": 0}[self.cfg.kind]
        return ShardArrays(arrays, answers if self.cfg.kind == "grpo" else None, len(docs), tokens, trained)

    def _packed(self, docs: list[Doc], tok: np.dtype) -> ShardArrays:
        pre = self.cfg.preprocessing
        rows = pack(
            [len(d) for d in docs], pre.max_packed_len, pre.packing_strategy, truncation_mode=pre.truncation_mode
        )
        pos_dtype = token_dtype(pre.max_packed_len)
        ids, masks, positions, lengths = [], [], [], []
        for row in rows:
            for p in row:
                ids.append(docs[p.doc].ids[p.start : p.end])
                masks.append(docs[p.doc].mask[p.start : p.end])
                positions.append(np.arange(len(p), dtype=pos_dtype))  # each piece is its own document
            lengths.append(sum(len(p) for p in row))
        loss_mask = _concat(masks, np.dtype(np.uint8))
        arrays = {
            "tokens": _concat(ids, tok),
            "positions": _concat(positions, pos_dtype),
            "loss_mask": loss_mask,
            "row_offsets": offsets(lengths),
        }
        trained = int(loss_mask.sum()) - sum(int(m[0]) for m in masks)
        return ShardArrays(arrays, None, len(rows), int(sum(lengths)), trained)


def _concat(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

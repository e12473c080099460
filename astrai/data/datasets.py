"""Map-style datasets over `astrai preprocess` shard folders (memory-mapped; each item reads only its slice).

- `PretrainDataset(dir, seq_len)`: consecutive windows of seq_len + 1 tokens from each shard's token stream
  (documents separated by EOS; attention runs across them, as in GPT pretraining). Item k of a shard covers
  tokens [k * seq_len, (k + 1) * seq_len]; a shard's last partial window is dropped and windows never cross
  shards. Positions are 0..seq_len-1 and every target is trained.
- `SFTDataset(dir, seq_len)`: one packed row per item, right-padded to seq_len. `targets[t] = tokens[t + 1]`;
  `loss_mask[t]` is the stored mask of token t + 1, and 0 where t is the last token of a document (its target
  would be the next document's first token) or padding. Positions restart at 0 at each document; padding has
  position 0, so each pad token is a document of its own (see `LMBatch`).
- `DPODataset(dir)`, `GRPODataset(dir)`: one record per item (token-aligned masks; the GRPO answer string).

`collate` stacks pretrain/SFT items into an `LMBatch`; `collate_pairs` pads DPO items into a `PairBatch` of two
LMBatches (pad id from the shards' meta.json, masks False on padding, never inferring padding from id 0).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from torch import Tensor

from astrai.data.batch import LMBatch
from astrai.data.shards import ShardError, open_shards
from astrai.tree import pytree


def _long(a: np.ndarray) -> Tensor:
    return torch.from_numpy(a.astype(np.int64))  # astype copies: the memmap stays read-only and untouched


def _locate(cum: list[int], index: int, what: str) -> tuple[int, int]:
    """(shard, item within it) of global `index` (negative counts from the end), given cumulative item counts."""
    total = cum[-1]
    if not -total <= index < total:
        raise IndexError(f"index {index} out of range for {total} {what}")
    index %= total
    s = bisect.bisect_right(cum, index) - 1
    return s, index - cum[s]


class _Records:
    """Rows of one kind across shards: index -> (shard, row), by cumulative row counts."""

    def __init__(self, path: str | Path, kind: str, offsets_key: str) -> None:
        self.meta, self.shards = open_shards(path, kind)
        self.offsets_key = offsets_key
        self.cum = np.cumsum([0] + [s.rows(offsets_key) for s in self.shards]).tolist()

    def __len__(self) -> int:
        return self.cum[-1]

    def locate(self, index: int) -> tuple[Any, int]:
        s, row = _locate(self.cum, index, "items")
        return self.shards[s], row

    def row(self, shard: Any, r: int, key: str, offsets_key: str | None = None) -> np.ndarray:
        ends = shard.arrays[offsets_key or self.offsets_key]
        return shard.arrays[key][int(ends[r]) : int(ends[r + 1])]

    @property
    def pad_id(self) -> int:
        pad = self.meta.get("pad_id")
        return int(pad) if isinstance(pad, int) else 0


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")


class PretrainDataset:
    """Windows of seq_len + 1 tokens from pretraining shards; items are dicts of [seq_len] tensors."""

    def __init__(self, path: str | Path, seq_len: int) -> None:
        _check_seq_len(seq_len)
        self.meta, self.shards = open_shards(path, "pretrain")
        self.seq_len = seq_len
        per_shard = [max(0, (len(s.arrays["tokens"]) - 1) // seq_len) for s in self.shards]
        self.cum = np.cumsum([0, *per_shard]).tolist()

    def __len__(self) -> int:
        return self.cum[-1]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        s, k = _locate(self.cum, index, "windows")
        start = k * self.seq_len
        window = _long(self.shards[s].arrays["tokens"][start : start + self.seq_len + 1])
        return {
            "tokens": window[:-1],
            "targets": window[1:],
            "loss_mask": torch.ones(self.seq_len, dtype=torch.float32),
            "positions": torch.arange(self.seq_len),
        }


class SFTDataset:
    """Packed SFT rows right-padded to seq_len; items are dicts of [seq_len] tensors (see the module docstring)."""

    def __init__(self, path: str | Path, seq_len: int) -> None:
        _check_seq_len(seq_len)
        self.records = _Records(path, "sft", "row_offsets")
        self.seq_len = seq_len
        longest = max((int(np.diff(s.arrays["row_offsets"]).max(initial=0)) for s in self.records.shards), default=0)
        if longest > seq_len:
            raise ShardError(
                f"{path}: rows are up to {longest} tokens, longer than seq_len {seq_len}; "
                f"preprocess with max_packed_len <= {seq_len}"
            )
        self.pad_id = self.records.pad_id

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        shard, r = self.records.locate(index)
        tokens = _long(self.records.row(shard, r, "tokens"))
        positions = _long(self.records.row(shard, r, "positions"))
        trained = torch.from_numpy(self.records.row(shard, r, "loss_mask").astype(np.float32))
        n, pad = len(tokens), self.seq_len - len(tokens)
        loss_mask = torch.zeros(self.seq_len, dtype=torch.float32)
        # target t is token t + 1, trained if that token is and it belongs to the same document
        loss_mask[: n - 1] = trained[1:] * (positions[1:] != 0)
        tokens = torch.cat([tokens, torch.full((pad,), self.pad_id, dtype=torch.int64)])
        return {
            "tokens": tokens,
            "targets": torch.cat([tokens[1:], tokens.new_full((1,), self.pad_id)]),
            "loss_mask": loss_mask,
            "positions": torch.cat([positions, torch.zeros(pad, dtype=torch.int64)]),
        }


class DPODataset:
    """Preference pairs: items are {"chosen", "rejected"} int64 ids and {"chosen_mask", "rejected_mask"} bool."""

    def __init__(self, path: str | Path) -> None:
        self.records = _Records(path, "dpo", "chosen_offsets")
        self.pad_id = self.records.pad_id

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        shard, r = self.records.locate(index)
        item = {}
        for side in ("chosen", "rejected"):
            item[side] = _long(self.records.row(shard, r, side, f"{side}_offsets"))
            item[f"{side}_mask"] = torch.from_numpy(self.records.row(shard, r, f"{side}_mask", f"{side}_offsets") != 0)
        return item


class GRPODataset:
    """Prompts for rollouts: items are {"prompt": int64 ids, "answer": str | None}."""

    def __init__(self, path: str | Path) -> None:
        self.records = _Records(path, "grpo", "prompt_offsets")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        shard, r = self.records.locate(index)
        answer = shard.answers[r] if shard.answers is not None else None
        return {"prompt": _long(self.records.row(shard, r, "prompt")), "answer": answer}


def collate(items: Sequence[dict[str, Tensor]]) -> LMBatch:
    """Stack equal-length pretrain/SFT items into an LMBatch ([B, T])."""
    if not items:
        raise ValueError("collate needs at least one item")
    lengths = {len(item["tokens"]) for item in items}
    if len(lengths) != 1:
        raise ValueError(f"items have different lengths {sorted(lengths)}; pad them to one seq_len first")
    return LMBatch(
        **{k: torch.stack([item[k] for item in items]) for k in ("tokens", "targets", "loss_mask", "positions")}
    )


@pytree
@attrs.frozen(eq=False)
class PairBatch:
    """DPO micro-batch: row b of `chosen` and of `rejected` share a prompt; both are right-padded to one T.

    Attributes:
        chosen: LMBatch whose loss_mask marks the targets that are chosen-response tokens.
        rejected: the same for the rejected responses.
    """

    chosen: LMBatch
    rejected: LMBatch


def _lm_rows(seqs: list[Tensor], masks: list[Tensor], length: int, pad_id: int) -> LMBatch:
    b = len(seqs)
    tokens = torch.full((b, length), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(b, length, dtype=torch.float32)
    positions = torch.zeros(b, length, dtype=torch.int64)
    for i, (ids, mask) in enumerate(zip(seqs, masks, strict=True)):
        n = len(ids)
        tokens[i, :n] = ids
        loss_mask[i, : n - 1] = mask[1:].float()  # target t = token t + 1
        positions[i, :n] = torch.arange(n)
    targets = torch.cat([tokens[:, 1:], tokens.new_full((b, 1), pad_id)], dim=1)
    return LMBatch(tokens=tokens, targets=targets, loss_mask=loss_mask, positions=positions)


def collate_pairs(items: Sequence[dict[str, Tensor]], *, pad_id: int, length: int | None = None) -> PairBatch:
    """Right-pad DPO items with `pad_id` (mask False there) into a PairBatch; T is `length` (a fixed shape, e.g. the
    train step's seq_len, so a compiled step sees one shape) or, by default, the longest side of any pair."""
    if not items:
        raise ValueError("collate_pairs needs at least one item")
    longest = max(max(len(item["chosen"]), len(item["rejected"])) for item in items)
    if length is not None and longest > length:
        raise ValueError(f"a DPO side has {longest} tokens, more than length {length}")
    length = longest if length is None else length
    sides = {
        side: _lm_rows([it[side] for it in items], [it[f"{side}_mask"] for it in items], length, pad_id)
        for side in ("chosen", "rejected")
    }
    return PairBatch(**sides)

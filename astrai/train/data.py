"""Training data for the loop: open the shard folder of a run, split off eval items, and yield micro-batches.

The kind (pretraining windows, packed SFT rows, or DPO pairs for a run with `TrainConfig.dpo`) comes from the
folder's meta.json. DPO micro-batches are `DPOBatch`es: the pairs padded to seq_len (one shape for the compiled
step) and their dataset indices, which key the precomputed reference log-probs. Each optimiser step takes
one sampler batch of `batch_size * grad_accum` items on this rank and cuts it into `grad_accum` micro-batches,
so the data order depends only on (seed, global batch), not on how it is split across ranks or micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import numpy as np
import torch
from torch import Tensor

from astrai.data.batch import LMBatch
from astrai.data.datasets import DPODataset, PairBatch, PretrainDataset, SFTDataset, collate, collate_pairs
from astrai.data.sampler import ResumableSampler
from astrai.data.shards import ShardError
from astrai.io.checkpoint import read_json
from astrai.train.config import TrainConfig
from astrai.tree import pytree

_DATASETS = {"pretrain": PretrainDataset, "sft": SFTDataset}


@pytree
@attrs.frozen(eq=False)
class DPOBatch:
    """One DPO micro-batch.

    Attributes:
        pairs: chosen and rejected rows, [B, T] each (T = seq_len).
        ref: [2, B] fp32 reference log-probs of (chosen, rejected); the loop fills them in before the step.
        index: [B] int64 dataset index of each pair (the key of the precomputed reference log-probs).
    """

    pairs: PairBatch
    ref: Tensor
    index: Tensor


def dpo_batch(items: Sequence[dict[str, Tensor]], indices: Sequence[int], *, pad_id: int, seq_len: int) -> DPOBatch:
    """Pad DPO items to seq_len into a `DPOBatch` (reference log-probs zero until the loop sets them)."""
    pairs = collate_pairs(items, pad_id=pad_id, length=seq_len)
    return DPOBatch(pairs=pairs, ref=torch.zeros(2, len(items)), index=torch.tensor(list(indices), dtype=torch.int64))


def _open_dpo(path: str | Path, seq_len: int) -> DPODataset:
    data = DPODataset(path)
    for side in ("chosen", "rejected"):
        longest = max(
            (int(np.diff(s.arrays[f"{side}_offsets"]).max(initial=0)) for s in data.records.shards), default=0
        )
        if longest > seq_len:
            raise ShardError(
                f"{path}: {side} sides are up to {longest} tokens, longer than seq_len {seq_len}; raise --seq-len "
                f"or preprocess with max_seq_len <= {seq_len}"
            )
    return data


def open_dataset(path: str | Path, seq_len: int, *, dpo: bool = False) -> PretrainDataset | SFTDataset | DPODataset:
    """The dataset of a shard folder: pretrain or sft kind for the causal-LM loss, dpo kind when `dpo`."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path}: no meta.json; run `astrai preprocess` to build training shards")
    kind = read_json(meta_path).get("kind")
    if dpo:
        if kind != "dpo":
            raise ValueError(f"{path} holds {kind!r} data; a DPO run takes 'dpo' shards (`astrai preprocess`)")
        return _open_dpo(path, seq_len)
    if kind == "dpo":
        raise ValueError(f"{path} holds DPO pairs; train them with a DPO recipe (`astrai train dpo-tiny --data ...`)")
    if kind not in _DATASETS:
        raise ValueError(f"{path} holds {kind!r} data; `astrai train` takes 'pretrain', 'sft' or 'dpo' shards")
    return _DATASETS[kind](path, seq_len)


class _Subset:
    """A view of some items of a dataset."""

    def __init__(self, dataset: PretrainDataset | SFTDataset, indices: Sequence[int]) -> None:
        self.dataset, self.indices = dataset, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.dataset[self.indices[i]]


class TrainData:
    """The train/eval datasets of a run and its resumable sampler (host objects)."""

    def __init__(self, cfg: TrainConfig, *, rank: int, world_size: int) -> None:
        data = open_dataset(cfg.data, cfg.seq_len, dpo=cfg.dpo is not None)
        self.rank, self.world_size, self.seq_len = rank, world_size, cfg.seq_len
        self.dpo = cfg.dpo is not None
        if cfg.val_data is not None:
            self.train, self.val = data, open_dataset(cfg.val_data, cfg.seq_len)
        elif cfg.val_fraction > 0:
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
            n_val = max(1, int(len(data) * cfg.val_fraction))
            self.train, self.val = _Subset(data, order[n_val:]), _Subset(data, sorted(order[:n_val]))
        else:
            self.train, self.val = data, None
        self.sampler = ResumableSampler(
            len(self.train), batch_size=cfg.batch_size * cfg.grad_accum, seed=cfg.seed, rank=rank, world_size=world_size
        )

    def train_batches(self, batch_size: int, grad_accum: int) -> Iterator[list[LMBatch] | list[DPOBatch]]:
        """Endless: one list of `grad_accum` micro-batches per optimiser step, epoch after epoch."""
        while True:
            for indices in self.sampler:
                items = [self.train[i] for i in indices]
                parts = [slice(k * batch_size, (k + 1) * batch_size) for k in range(grad_accum)]
                if self.dpo:
                    pad = self.train.pad_id
                    yield [dpo_batch(items[p], indices[p], pad_id=pad, seq_len=self.seq_len) for p in parts]
                else:
                    yield [collate(items[p]) for p in parts]

    def eval_batches(self, num_batches: int, batch_size: int) -> list[LMBatch]:
        """The first `num_batches` eval micro-batches of this rank (the same ones every time; [] without eval)."""
        if self.val is None:
            return []
        per_rank = list(range(self.rank, len(self.val), self.world_size))[: num_batches * batch_size]
        return [
            collate([self.val[i] for i in per_rank[k : k + batch_size]]) for k in range(0, len(per_rank), batch_size)
        ]


def open_data(cfg: TrainConfig, *, rank: int, world_size: int) -> TrainData:
    """`TrainData` for a run on rank `rank` of `world_size`."""
    return TrainData(cfg, rank=rank, world_size=world_size)

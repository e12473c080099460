"""Training data for the loop: open the shard folder of a run, split off eval items, and yield micro-batches.

The kind (pretraining windows or packed SFT rows) comes from the folder's meta.json. Each optimiser step takes
one sampler batch of `batch_size * grad_accum` items on this rank and cuts it into `grad_accum` micro-batches,
so the data order depends only on (seed, global batch), not on how it is split across ranks or micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from astrai.data.batch import LMBatch
from astrai.data.datasets import PretrainDataset, SFTDataset, collate
from astrai.data.sampler import ResumableSampler
from astrai.io.checkpoint import read_json
from astrai.train.config import TrainConfig

_DATASETS = {"pretrain": PretrainDataset, "sft": SFTDataset}


def open_dataset(path: str | Path, seq_len: int) -> PretrainDataset | SFTDataset:
    """The causal-LM dataset of a shard folder (pretrain or sft kind)."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path}: no meta.json; run `astrai preprocess` to build training shards")
    kind = read_json(meta_path).get("kind")
    if kind not in _DATASETS:
        raise ValueError(f"{path} holds {kind!r} data; `astrai train` takes 'pretrain' or 'sft' shards")
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
        data = open_dataset(cfg.data, cfg.seq_len)
        self.rank, self.world_size = rank, world_size
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

    def train_batches(self, batch_size: int, grad_accum: int) -> Iterator[list[LMBatch]]:
        """Endless: one list of `grad_accum` micro-batches per optimiser step, epoch after epoch."""
        while True:
            for indices in self.sampler:
                items = [self.train[i] for i in indices]
                yield [collate(items[k * batch_size : (k + 1) * batch_size]) for k in range(grad_accum)]

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

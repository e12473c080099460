"""Training data for the loop: open the shard folder of a run, split off eval items, and yield micro-batches.

The kind (pretraining windows, packed SFT rows, DPO pairs for a run with `TrainConfig.dpo`, or GRPO prompts for
one with `TrainConfig.grpo`) comes from the folder's meta.json; a GRPO run also takes a JSONL file of {"prompt" or
"messages", "answer"} records, preprocessed once into RUN/prompts (`prompt_shards`). DPO micro-batches are
`DPOBatch`es: the pairs padded to seq_len (one shape for the compiled step) and their dataset indices, which key
the precomputed reference log-probs. Each optimiser step takes
one sampler batch of `batch_size * grad_accum` items on this rank and cuts it into `grad_accum` micro-batches,
so the data order depends only on (seed, global batch), not on how it is split across ranks or micro-batches.
GRPO micro-batches are `PromptBatch`es (host lists of prompts) that `astrai.train.rollout` turns into completions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import numpy as np
import torch
from torch import Tensor

from astrai.data.batch import LMBatch
from astrai.data.config import config_from_dict
from astrai.data.datasets import (
    DPODataset,
    GRPODataset,
    PairBatch,
    PretrainDataset,
    SFTDataset,
    collate,
    collate_pairs,
)
from astrai.data.preprocess import preprocess
from astrai.data.sampler import ResumableSampler
from astrai.data.shards import ShardError
from astrai.io.checkpoint import read_json
from astrai.io.tokenizer import Tokenizer
from astrai.train import distributed
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


@attrs.frozen(eq=False)
class PromptBatch:
    """One GRPO micro-batch before its rollout: dataset indices and items ({"prompt": ids, "answer": str | None})."""

    indices: list[int]
    items: list[dict]


def prompt_shards(jsonl: Path, out: Path, tokenizer: Tokenizer, *, max_prompt_len: int) -> Path:
    """Preprocess a JSONL of {"prompt" (a string: one user turn) or "messages" (a conversation), "answer"} records
    into GRPO shards at `out` (rank 0 writes them once, the others wait; an existing folder is reused). Prompts
    get the chat template's generation prompt and keep their last `max_prompt_len` tokens."""
    if distributed.env_rank() == 0 and not (out / "meta.json").is_file():
        with open(jsonl, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), None)
        if first is None:
            raise ValueError(f"{jsonl}: no records")
        record = json.loads(first)
        field = "messages" if "messages" in record else "prompt"
        section = {"field": field, "template": True, "action": "mask"}
        if field == "prompt":
            section["role"] = "user"
        cfg = config_from_dict({
            "kind": "grpo", "inputs": [str(jsonl)], "output": str(out), "prompt": [section],
            "answer_field": "answer" if "answer" in record else None,
            "preprocessing": {"max_seq_len": max_prompt_len, "truncation_mode": "keep_end"},
        })  # fmt: skip
        preprocess(cfg, tokenizer=tokenizer)
    distributed.barrier()
    return out


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


def _open_grpo(path: str | Path, max_prompt_len: int) -> GRPODataset:
    data = GRPODataset(path)
    longest = max((int(np.diff(s.arrays["prompt_offsets"]).max(initial=0)) for s in data.records.shards), default=0)
    if longest > max_prompt_len:
        raise ShardError(
            f"{path}: prompts are up to {longest} tokens, more than seq_len - grpo.max_completion_tokens = "
            f"{max_prompt_len}; raise --seq-len or preprocess with max_seq_len <= {max_prompt_len}"
        )
    return data


def open_dataset(
    path: str | Path, seq_len: int, *, dpo: bool = False, grpo_prompt_len: int | None = None
) -> PretrainDataset | SFTDataset | DPODataset | GRPODataset:
    """The dataset of a shard folder: pretrain or sft kind for the causal-LM loss, dpo kind when `dpo`, grpo kind
    (prompts of at most `grpo_prompt_len` tokens) when that is given."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path}: no meta.json; run `astrai preprocess` to build training shards")
    kind = read_json(meta_path).get("kind")
    if grpo_prompt_len is not None:
        if kind != "grpo":
            raise ValueError(f"{path} holds {kind!r} data; a GRPO run takes 'grpo' shards or a JSONL of prompts")
        return _open_grpo(path, grpo_prompt_len)
    if dpo:
        if kind != "dpo":
            raise ValueError(f"{path} holds {kind!r} data; a DPO run takes 'dpo' shards (`astrai preprocess`)")
        return _open_dpo(path, seq_len)
    if kind == "dpo":
        raise ValueError(f"{path} holds DPO pairs; train them with a DPO recipe (`astrai train dpo-tiny --data ...`)")
    if kind == "grpo":
        raise ValueError(f"{path} holds GRPO prompts; train them with a GRPO recipe (`astrai train grpo-tiny`)")
    if kind not in _DATASETS:
        raise ValueError(f"{path} holds {kind!r} data; `astrai train` takes 'pretrain', 'sft', 'dpo' or 'grpo' shards")
    return _DATASETS[kind](path, seq_len)


_TOKEN_KEYS = ("tokens", "targets", "chosen", "rejected", "prompt")  # the id tensors of every dataset's items


class _VocabChecked:
    """A dataset whose items are checked, as they are read, to hold only token ids below the model's vocabulary.

    An id >= vocab_size (shards preprocessed with another tokenizer, a corrupt or hand-edited `tokens.bin`) would
    index past the embedding table: an IndexError deep in torch on CPU, a device-side assert that kills the process
    on CUDA. Checking each item costs one min/max of a few hundred ids; scanning every shard up front would read the
    whole dataset at every start. Other attributes (pad_id, records, ...) are the wrapped dataset's.
    """

    def __init__(self, dataset: PretrainDataset | SFTDataset | DPODataset | GRPODataset, path: str | Path,
                 vocab_size: int) -> None:  # fmt: skip
        self.dataset, self.path, self.vocab_size = dataset, path, vocab_size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        item = self.dataset[i]
        for key in _TOKEN_KEYS:
            ids = item.get(key)
            if not isinstance(ids, Tensor) or ids.numel() == 0:
                continue
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                raise ShardError(
                    f"{self.path}: item {i} holds token id {high if high >= self.vocab_size else low} ({key!r}), "
                    f"outside the model's vocabulary of {self.vocab_size} ids; the shards were preprocessed with "
                    "another tokenizer or are corrupt (re-run `astrai preprocess` with this model's tokenizer)"
                )
        return item

    def __getattr__(self, name: str):
        if name == "dataset":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


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

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        rank: int,
        world_size: int,
        tokenizer: Tokenizer | None = None,
        vocab_size: int | None = None,
    ) -> None:
        path, prompt_len = cfg.data, None
        if cfg.grpo is not None:
            prompt_len = cfg.seq_len - cfg.grpo.max_completion_tokens
            if Path(cfg.data).is_file():
                if tokenizer is None:
                    raise ValueError(f"{cfg.data}: rendering JSONL prompts needs a tokenizer (--tokenizer)")
                path = prompt_shards(
                    Path(cfg.data), Path(cfg.out_dir) / "prompts", tokenizer, max_prompt_len=prompt_len
                )
        data = open_dataset(path, cfg.seq_len, dpo=cfg.dpo is not None, grpo_prompt_len=prompt_len)
        if vocab_size is not None:
            data = _VocabChecked(data, path, vocab_size)
        self.rank, self.world_size, self.seq_len = rank, world_size, cfg.seq_len
        self.dpo, self.grpo = cfg.dpo is not None, cfg.grpo is not None
        if cfg.val_data is not None:
            val = open_dataset(cfg.val_data, cfg.seq_len)
            self.train, self.val = data, val if vocab_size is None else _VocabChecked(val, cfg.val_data, vocab_size)
        elif cfg.val_fraction > 0:
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
            n_val = max(1, int(len(data) * cfg.val_fraction))
            self.train, self.val = _Subset(data, order[n_val:]), _Subset(data, sorted(order[:n_val]))
        else:
            self.train, self.val = data, None
        self.sampler = ResumableSampler(
            len(self.train), batch_size=cfg.batch_size * cfg.grad_accum, seed=cfg.seed, rank=rank, world_size=world_size
        )

    def train_batches(
        self, batch_size: int, grad_accum: int
    ) -> Iterator[list[LMBatch] | list[DPOBatch] | list[PromptBatch]]:
        """Endless: one list of `grad_accum` micro-batches per optimiser step, epoch after epoch."""
        while True:
            for indices in self.sampler:
                items = [self.train[i] for i in indices]
                parts = [slice(k * batch_size, (k + 1) * batch_size) for k in range(grad_accum)]
                if self.grpo:
                    yield [PromptBatch(indices[p], items[p]) for p in parts]
                elif self.dpo:
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


def open_data(
    cfg: TrainConfig,
    *,
    rank: int,
    world_size: int,
    tokenizer: Tokenizer | None = None,
    vocab_size: int | None = None,
) -> TrainData:
    """`TrainData` for a run on rank `rank` of `world_size` (`tokenizer` renders a GRPO run's JSONL prompts); with
    `vocab_size`, every item read is checked to hold only ids below it (a `ShardError` naming the item if not)."""
    return TrainData(cfg, rank=rank, world_size=world_size, tokenizer=tokenizer, vocab_size=vocab_size)

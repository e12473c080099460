"""Tiny SFT shards (the quickstart's character tokenizer and addition chats) and a fast TrainConfig for loop tests."""

from pathlib import Path

import pytest

from astrai.configs.models import tiny
from astrai.data.config import config_from_dict
from astrai.data.preprocess import preprocess
from astrai.quickstart.task import make_problems, write_jsonl
from astrai.quickstart.vocab import save_tokenizer
from astrai.train import loop
from astrai.train.checkpoint import checkpoint_dirs
from astrai.train.config import TrainConfig
from astrai.train.optim import AdamWConfig
from astrai.train.schedule import ScheduleConfig


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory) -> tuple[Path, Path]:
    """(tokenizer folder, SFT shard folder) with 240 addition chats packed into rows of <= 64 tokens."""
    root = tmp_path_factory.mktemp("sft_data")
    tokenizer = save_tokenizer(root / "tokenizer")
    jsonl = write_jsonl(make_problems("add2", 240, seed=0), root / "train.jsonl")
    cfg = config_from_dict({
        "kind": "sft", "inputs": [str(jsonl)], "tokenizer": str(tokenizer), "output": str(root / "shards"),
        "sections": [{"field": "messages", "action": "$role", "template": True}],
        "preprocessing": {"max_seq_len": 64, "max_packed_len": 64},
    })  # fmt: skip
    preprocess(cfg)
    return tokenizer, root / "shards"


@pytest.fixture
def train_cfg(sft_data, tmp_path) -> TrainConfig:
    """Six eager steps of the `tiny` model (about a second)."""
    tokenizer, shards = sft_data
    return TrainConfig(
        data=shards, tokenizer=tokenizer, out_dir=tmp_path / "run", model="tiny", seq_len=64, batch_size=4,
        steps=6, optim=AdamWConfig(lr=3e-3), schedule=ScheduleConfig(kind="cosine", warmup_steps=2),
        compile=False, save_every=3, keep_last=3, val_fraction=0.1, eval_every=3, eval_batches=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(sft_data, tmp_path_factory) -> TrainConfig:
    """The config of a finished 6-step run with checkpoints step_3 and step_6, one per test module (the fault
    tests damage copies of it; do not modify its folder)."""
    tokenizer, shards = sft_data
    cfg = TrainConfig(
        data=shards, tokenizer=tokenizer, out_dir=tmp_path_factory.mktemp("faults") / "run", model="tiny",
        seq_len=64, batch_size=4, steps=6, optim=AdamWConfig(lr=3e-3),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=2), compile=False, save_every=3, keep_last=3,
    )  # fmt: skip
    loop.train(cfg, tiny())
    assert [p.name for p in checkpoint_dirs(cfg.out_dir)] == ["step_00000003", "step_00000006"]
    return cfg

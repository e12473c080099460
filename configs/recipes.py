"""Named training recipes for `astrai train RECIPE [--overrides]`: typed Python, no YAML.

Each returns a complete `TrainConfig`; flags override any field (`astrai train sft-tiny --optim.lr 1e-3
--data my_shards`). Data folders come from `astrai preprocess` (see docs/data.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs

from astrai.nn.lora import LoRAConfig
from astrai.train.config import DPOConfig, GRPOConfig, TrainConfig
from astrai.train.distill import DistillConfig
from astrai.train.optim import AdamWConfig
from astrai.train.schedule import ScheduleConfig


def pretrain_tiny() -> TrainConfig:
    """Pretrain the ~1M-parameter `tiny` model on a preprocessed text corpus (a CPU smoke-scale run)."""
    return TrainConfig(
        data=Path("data/pretrain-tiny"), out_dir=Path("runs/pretrain-tiny"), model="tiny", seq_len=256,
        batch_size=8, steps=200, optim=AdamWConfig(lr=1e-3, weight_decay=0.1),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=20), eval_every=50, save_every=100,
    )  # fmt: skip


def sft_tiny() -> TrainConfig:
    """Supervised fine-tuning of the `tiny` model on packed chat rows (loss on assistant turns only)."""
    return TrainConfig(
        data=Path("data/sft-tiny"), out_dir=Path("runs/sft-tiny"), model="tiny", seq_len=256, batch_size=8,
        steps=200, optim=AdamWConfig(lr=5e-4, weight_decay=0.0), schedule=ScheduleConfig(kind="cosine",
        warmup_steps=10), val_fraction=0.05, eval_every=50, save_every=100,
    )  # fmt: skip


def sft_lora_tiny() -> TrainConfig:
    """`sft-tiny` with LoRA adapters (r=16 on q/v projections) over a frozen base."""
    return attrs.evolve(sft_tiny(), out_dir=Path("runs/sft-lora-tiny"), lora=LoRAConfig(),
                        optim=AdamWConfig(lr=2e-3, weight_decay=0.0))  # fmt: skip


def dpo_tiny() -> TrainConfig:
    """DPO (sigmoid, beta 0.1, reference log-probs precomputed) of the `tiny` model on preference pairs from
    `astrai preprocess` (kind dpo); start from an SFT model with `--model runs/sft-tiny/model`."""
    return TrainConfig(
        data=Path("data/dpo-tiny"), out_dir=Path("runs/dpo-tiny"), model="tiny", seq_len=256, batch_size=4,
        steps=100, optim=AdamWConfig(lr=1e-4, weight_decay=0.0), schedule=ScheduleConfig(kind="cosine",
        warmup_steps=5), save_every=50, dpo=DPOConfig(),
    )  # fmt: skip


def dpo_lora_tiny() -> TrainConfig:
    """`dpo-tiny` with LoRA adapters (r=16 on q/v projections): the reference is the base with the adapters off."""
    return attrs.evolve(dpo_tiny(), out_dir=Path("runs/dpo-lora-tiny"), lora=LoRAConfig(),
                        optim=AdamWConfig(lr=5e-4, weight_decay=0.0))  # fmt: skip


def grpo_tiny() -> TrainConfig:
    """Online GRPO of the `tiny` model: 8 completions of up to 32 tokens per prompt from astrai's engine, reward 1 for
    an exact-match answer (`astrai.train.rewards`), DAPO normalisation, no reference (beta 0). Data: `grpo` shards
    from `astrai preprocess` or a JSONL of {"prompt" or "messages", "answer"}; start from an SFT model with
    `--model runs/sft-tiny/model` (a random model never earns a reward)."""
    return TrainConfig(
        data=Path("data/grpo-tiny.jsonl"), out_dir=Path("runs/grpo-tiny"), model="tiny", seq_len=128, batch_size=4,
        steps=100, optim=AdamWConfig(lr=5e-5, weight_decay=0.0), schedule=ScheduleConfig(kind="constant"),
        max_grad_norm=1.0, save_every=50, grpo=GRPOConfig(num_generations=8, max_completion_tokens=32),
    )  # fmt: skip


def distill() -> TrainConfig:
    """Distil a teacher model folder into a random-init `tiny` student (its vocabulary and tokenizer are the
    teacher's): forward KL(teacher || student) at T = 1 on every trained token of pretraining/SFT shards, e.g. a
    draft model for speculative decoding. Give the teacher with `--distill.teacher FOLDER`, the student's shape with
    `--model NAME` and the data with `--data SHARDS` (the teacher's own SFT shards suit a draft)."""
    return TrainConfig(
        data=Path("data/sft-tiny"), out_dir=Path("runs/distill"), model="tiny", seq_len=256, batch_size=8, steps=200,
        optim=AdamWConfig(lr=1e-3, weight_decay=0.0), schedule=ScheduleConfig(kind="cosine", warmup_steps=10),
        save_every=100, distill=DistillConfig(teacher=Path("runs/sft-tiny/model")),
    )  # fmt: skip


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "pretrain-tiny": pretrain_tiny,
    "sft-tiny": sft_tiny,
    "sft-lora-tiny": sft_lora_tiny,
    "dpo-tiny": dpo_tiny,
    "dpo-lora-tiny": dpo_lora_tiny,
    "grpo-tiny": grpo_tiny,
    "distill": distill,
}

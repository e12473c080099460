"""Worker for the per-block FSDP tests: run as a script on each of 2 gloo ranks, imported by the test for the
1-process reference (the same builders, so both sides train the same tiny models on the same global batches).

`python fsdp_worker.py OUT_DIR VARIANT...` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) trains
each variant for `STEPS` steps and writes, from rank 0, `OUT_DIR/VARIANT.pt`: the per-step losses, the full
trained tree, each step's peak gathered bytes on rank 0 (`track_gathered`) and the unit-size bound.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import attrs
import torch

from astrai.data.batch import LMBatch
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams, init_params
from astrai.nn.lora import LoRAConfig, apply_lora, init_lora
from astrai.train.muon import MuonConfig
from astrai.train.optim import AdamWConfig, OptimConfig
from astrai.train.step import StepOptions, TrainStep, full_params, init_train_state
from astrai.tree import leaves

STEPS = 3
ROWS, SEQ = 4, 12  # global batch rows (split over ranks and micro-batches), tokens per row

# name -> (lora, optimizer, micro-batches, activation checkpointing, fsdp unit, param dtype)
VARIANTS: dict[str, dict[str, Any]] = {
    "block": {},
    "model": {"unit": "model"},
    "accum": {"accum": 2},
    "lora": {"lora": True},
    "muon": {"optim": "muon"},
    "muon_model": {"optim": "muon", "unit": "model"},
    "ckpt": {"ckpt": True, "accum": 2},
    "bf16": {"param_dtype": "bfloat16"},
    "noprefetch": {"prefetch": False},
}


def model_config() -> ModelConfig:
    """4 blocks, odd sizes (uneven `Shard(0)` splits: 63 vocab rows, 40 MLP rows over 2 ranks), tied embeddings,
    qk-norm and a packed row (document mask)."""
    return ModelConfig(
        model_type="qwen3", vocab_size=63, hidden_size=48, intermediate_size=40, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, qk_norm=True, max_position_embeddings=64,
        tie_word_embeddings=True, dtype="float32",
    )  # fmt: skip


def global_batches() -> list[LMBatch]:
    """`STEPS` global batches of `ROWS` rows; row 0 packs two documents."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 63, (ROWS, SEQ), generator=gen)
        targets = torch.randint(0, 63, (ROWS, SEQ), generator=gen)
        mask = (torch.rand(ROWS, SEQ, generator=gen) > 0.2).float()
        positions = torch.arange(SEQ).repeat(ROWS, 1)
        positions[0, 5:] = torch.arange(SEQ - 5)
        mask[0, 4] = 0.0  # the first document's last target belongs to the next one
        out.append(LMBatch(tokens=tokens, targets=targets, loss_mask=mask, positions=positions))
    return out


def rows(batch: LMBatch, sel: slice) -> LMBatch:
    return LMBatch(*(getattr(batch, f.name)[sel] for f in attrs.fields(LMBatch)))


def micro_batches(batch: LMBatch, accum: int, rank: int, world: int) -> list[LMBatch]:
    """This rank's micro-batches of a global batch: `accum` groups of rows, each split over the ranks."""
    per_micro = ROWS // accum
    per_rank = per_micro // world
    return [rows(batch, slice(m * per_micro + rank * per_rank, m * per_micro + (rank + 1) * per_rank))
            for m in range(accum)]  # fmt: skip


def setup(variant: dict[str, Any], shard: Any = None) -> tuple[TrainStep, Any, Any]:
    """(step, state, frozen) of a variant; `shard` (a tree -> DTensor tree function) for the FSDP ranks."""
    cfg = model_config()
    base: DecoderParams = init_params(cfg, seed=1)
    if variant.get("optim") == "muon":
        optim: AdamWConfig = OptimConfig(name="muon", lr=3e-3, muon=MuonConfig(lr=0.02))
    else:
        optim = AdamWConfig(lr=3e-3)
    frozen, to_params, trainable = None, full_params, base
    if variant.get("lora"):
        lora = init_lora(base, LoRAConfig(r=4, alpha=8, targets=("all-linear",)), seed=2)
        # B starts at 0: give it values so the base and both factors matter from step 1
        gen = torch.Generator().manual_seed(3)
        lora = {k: attrs.evolve(v, lora_b=torch.randn(v.lora_b.shape, generator=gen) * 0.02) for k, v in lora.items()}
        frozen, to_params, trainable = base, apply_lora, lora
    if shard is not None:
        trainable = shard(trainable)
        frozen = shard(frozen) if frozen is not None else None
    state = init_train_state(trainable, optim)
    dtype = getattr(torch, variant["param_dtype"]) if variant.get("param_dtype") else None
    opts = StepOptions(max_grad_norm=1.0, checkpoint_blocks=bool(variant.get("ckpt")), compile=False,
                       autocast_dtype=dtype)  # fmt: skip
    step = TrainStep(cfg, opts, optim, trainable=state.trainable, to_params=to_params, sharded=shard is not None,
                     fsdp_unit=variant.get("unit", "block"), fsdp_param_dtype=dtype,
                     fsdp_prefetch=variant.get("prefetch", True))  # fmt: skip
    return step, state, frozen


def unit_bytes(cfg: ModelConfig, world: int) -> dict[str, int]:
    """Full bytes of each gathering unit (padded to whole shards) and of the whole model."""
    params = init_params(cfg, seed=1)

    def size(tree: Any) -> int:
        return sum(math.ceil(t.shape[0] / world) * world * t[0].numel() * t.element_size() for t in leaves(tree))

    block = max(size(b) for b in params.blocks)
    embed = size(params.embed_tokens) + size(params.norm)  # the head unit: final norm + (tied) embedding
    lora = init_lora(params, LoRAConfig(r=4, alpha=8, targets=("all-linear",)), seed=2)
    lora_block = max(size(b) + sum(size(ad) for name, ad in lora.items() if name.startswith(f"blocks.{i}."))
                     for i, b in enumerate(params.blocks))  # fmt: skip
    return {"block": block, "lora_block": lora_block, "embed": embed, "model": size(params)}


def main() -> None:
    import torch.distributed as dist

    from astrai.train.fsdp import BlockGather, full_tree, gather_tree, make_mesh, shard_tree, track_gathered
    from astrai.train.step import eval_sums

    out_dir, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh(torch.device("cpu"))
    for name in names:
        variant = VARIANTS[name]
        step, state, frozen = setup(variant, shard=lambda tree: shard_tree(tree, mesh))
        losses, peaks, gathers = [], [], []
        for batch in global_batches():
            with track_gathered() as stats:
                metrics = step(state, micro_batches(batch, variant.get("accum", 1), rank, world), 3e-3, frozen)
            losses.append(metrics["loss"].item())
            peaks.append(stats.peak_bytes)
            gathers.append(stats.gathers)
        # the eval pass per unit (no grad) against the whole-tree gather, on this rank's rows of the last batch
        evals = micro_batches(global_batches()[-1], 1, rank, world)
        kw = {"cfg": model_config(), "opts": step.opts, "to_params": step.loss.keywords["to_params"]}
        with track_gathered() as eval_stats:
            per_unit = eval_sums(state.trainable, frozen, evals, run_unit=BlockGather(prefetch=False), **kw)
        whole = eval_sums(gather_tree(state.trainable), gather_tree(frozen), evals, **kw)
        trained = full_tree(state.trainable)
        if rank == 0:
            result = {"losses": losses, "trained": trained, "peaks": peaks, "gathers": gathers,
                      "bound": unit_bytes(model_config(), world), "eval": [per_unit, whole],
                      "eval_peak": eval_stats.peak_bytes}  # fmt: skip
            torch.save(result, os.path.join(out_dir, f"{name}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker for the tensor-parallel training tests: run as a script on each of 4 gloo ranks, imported by the test
for the 1-process reference (the same builders, so both sides train the same tiny models on the same global
batches).

`python tp_worker.py OUT_DIR VARIANT...` (RANK, WORLD_SIZE=4, MASTER_ADDR, MASTER_PORT in the environment) trains
each variant for `STEPS` steps with `--tp` = the variant's `tp` and WORLD_SIZE / tp data-parallel replicas, and
writes, from rank 0, `OUT_DIR/VARIANT.pt`: per-step losses and gradient norms, the full trained tree (gathered
from the FSDP shards and the TP group), the whole-model parameter norm computed from the shards
(`TPTrain.clip_` on the parameters: checks the replica counts), and whether the AdamW state survives
`unshard_adamw` + `shard_adamw`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import attrs
import torch

from astrai.configs.models import tiny
from astrai.data.batch import LMBatch
from astrai.models.config import ModelConfig, MoEConfig
from astrai.models.decoder import init_params
from astrai.models.tp import shard_params, unshard_params
from astrai.train.fsdp import full_tree, shard_tree
from astrai.train.optim import AdamWConfig
from astrai.train.step import StepOptions, TrainStep, init_train_state
from astrai.train.tp import TPTrain, make_layout, shard_adamw, unshard_adamw
from astrai.tree import leaves, named_tensors

sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/, for `helpers` when run as a rank script
from helpers import random_biases  # noqa: E402

STEPS = 3
ROWS, SEQ = 4, 12  # global batch rows (split over micro-batches and data-parallel replicas), tokens per row


def moe_config() -> ModelConfig:
    """qwen2_moe-shaped: 4 experts (2 per rank), a gated shared expert, attention biases, the load-balancing loss."""
    moe = MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                    shared_expert_intermediate_size=24, shared_expert_gate=True)  # fmt: skip
    return ModelConfig(
        model_type="qwen2_moe", vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=64,
        ffn_type="moe", moe=moe,
    )  # fmt: skip


def kv1_config() -> ModelConfig:
    """One KV head for 2 ranks (replicated), tied embeddings over an odd vocab (a padded last shard), qk-norm."""
    return ModelConfig(
        model_type="qwen3", vocab_size=63, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, qk_norm=True, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip


def with_biases(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the bias switches on that the family allows: q/k/v, o_proj and the dense MLP's. Filled with random
    values (`random_biases`), they make a row-parallel bias added on every rank (or its gradient summed over them)
    fail the comparison with one process; `init_params` alone makes zero biases, which hide that bug."""
    return attrs.evolve(cfg, attention_bias=True, attention_out_bias=True, mlp_bias=cfg.ffn_type != "moe")


MODELS = {"tiny": lambda: with_biases(tiny(vocab_size=101)), "kv1": lambda: with_biases(kv1_config()),
          "moe": lambda: with_biases(moe_config())}  # fmt: skip

# tp: group size (dp = WORLD_SIZE / tp); clip: max_grad_norm; accum: micro-batches; smooth: label smoothing;
# fsdp: shard each TP shard over the dp group (2-D); broken: skip `finish_grads_` (the negative control)
VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {"model": "tiny", "tp": 2},
    "clip": {"model": "kv1", "tp": 2, "clip": 0.05, "accum": 2, "smooth": 0.1},
    "moe": {"model": "moe", "tp": 2},
    "tp4": {"model": "tiny", "tp": 4},
    "fsdp": {"model": "tiny", "tp": 2, "fsdp": True},
    "broken": {"model": "kv1", "tp": 2, "broken": True},
}


class _Unfinished(TPTrain):
    """The negative control: the partial gradients of replicated leaves inside the regions are left unsummed."""

    def finish_grads_(self, trainable: Any, grads: list[torch.Tensor]) -> None:
        pass


def global_batches(vocab: int) -> list[LMBatch]:
    """`STEPS` global batches of `ROWS` rows; row 0 packs two documents."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
        targets = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
        mask = (torch.rand(ROWS, SEQ, generator=gen) > 0.2).float()
        positions = torch.arange(SEQ).repeat(ROWS, 1)
        positions[0, 5:] = torch.arange(SEQ - 5)
        mask[0, 4] = 0.0
        out.append(LMBatch(tokens=tokens, targets=targets, loss_mask=mask, positions=positions))
    return out


def micro_batches(batch: LMBatch, accum: int, rank: int, world: int) -> list[LMBatch]:
    """Data-parallel replica `rank`'s micro-batches: `accum` groups of rows, each split over the replicas."""
    per_micro = ROWS // accum
    per_rank = per_micro // world
    sel = [slice(m * per_micro + rank * per_rank, m * per_micro + (rank + 1) * per_rank) for m in range(accum)]
    return [LMBatch(*(getattr(batch, f.name)[s] for f in attrs.fields(LMBatch))) for s in sel]


def setup(variant: dict[str, Any], layout: Any = None) -> tuple[TrainStep, Any]:
    """(step, state) of a variant: the whole model (`layout` None) or this rank's shard (`astrai.train.tp.Layout`)."""
    cfg = MODELS[variant["model"]]()
    trainable = random_biases(init_params(cfg, seed=1), seed=2, std=0.05)
    tp, sharded = None, False
    if layout is not None:
        trainable = shard_params(trainable, cfg, layout.tp)
        sharded = bool(variant.get("fsdp"))
        if sharded:
            trainable = shard_tree(trainable, layout.dp_mesh)
        tp = (_Unfinished if variant.get("broken") else TPTrain)(cfg, layout.tp, sharded=sharded)
    # eps 1e-6, not 1e-8: Adam's first steps move a weight by ~lr * sign(g) even where |g| ~ 1e-9, so the last-bit
    # difference between a matmul split over ranks and a whole one would flip such weights by ~lr
    optim = AdamWConfig(lr=3e-3, eps=1e-6)
    state = init_train_state(trainable, optim)
    opts = StepOptions(max_grad_norm=variant.get("clip", 1.0), label_smoothing=variant.get("smooth", 0.0),
                       compile=False)  # fmt: skip
    step = TrainStep(cfg, opts, optim, trainable=state.trainable, sharded=sharded, tp=tp,
                     dp_group=None if layout is None else layout.dp_group)  # fmt: skip
    return step, state


def train(variant: dict[str, Any], layout: Any = None, *, accum: int = 1, dp_rank: int = 0, dp: int = 1) -> tuple:
    """(losses, grad norms, state) after `STEPS` steps of `accum` micro-batches on data-parallel replica `dp_rank`.

    The 1-process reference of a run over `dp` replicas accumulates `accum * dp` micro-batches: the same groups of
    rows (the MoE load-balancing loss is a function of each micro-batch's routing, so the grouping matters)."""
    step, state = setup(variant, layout)
    losses, norms = [], []
    for batch in global_batches(MODELS[variant["model"]]().vocab_size):
        metrics = step(state, micro_batches(batch, accum, dp_rank, dp), 3e-3)
        losses.append(metrics["loss"].item())
        norms.append(metrics["grad_norm"].item())
    return losses, norms, state


def main() -> None:
    import torch.distributed as dist

    out_dir, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in names:
        variant = VARIANTS[name]
        cfg = MODELS[variant["model"]]()
        layout = make_layout(variant["tp"], rank, world, torch.device("cpu"))
        accum = variant.get("accum", 1)
        losses, norms, state = train(variant, layout, accum=accum, dp_rank=layout.dp_rank, dp=layout.dp_size)
        shard = full_tree(state.trainable)
        trained = unshard_params(shard, cfg, layout.tp)
        # the replica counts: the whole model's parameter norm from the shards (no clipping)
        param_norm = TPTrain(cfg, layout.tp).clip_(shard, [t.clone() for t in leaves(shard)], None).item()
        opt = full_tree(state.opt)
        back = shard_adamw(unshard_adamw(opt, cfg, layout.tp), cfg, layout.tp)
        a, b = named_tensors(opt), named_tensors(back)
        opt_round_trip = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if rank == 0:
            result = {"losses": losses, "norms": norms, "trained": trained, "param_norm": param_norm,
                      "opt_round_trip": opt_round_trip, "dp": layout.dp_size}  # fmt: skip
            torch.save(result, os.path.join(out_dir, f"{name}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Tensor-parallel training (`astrai train --tp N`): the TP x DP layout, the vocab-parallel loss, finishing the
gradients, the global gradient norm, and full-model checkpoints from TP shards.

Layout: under torchrun with WORLD_SIZE = tp * dp, ranks [k tp, (k + 1) tp) form tensor-parallel group k
(consecutive ranks, as Megatron and torchtitan: the TP all-reduces stay inside a node), and the ranks with the
same TP rank form a data-parallel group. A 2-D `DeviceMesh` ("dp", "tp") builds both groups; its "dp" sub-mesh
is where `--fsdp` shards each TP shard further (ZeRO-3 over dp). Every rank of a TP group reads the same batches
(the sampler is sharded over the dp index); gradients are summed over the DP group only.

The model runs as `astrai.models.tp` lays it out (the shard and the local config; three collectives in the
forward). What training adds:
- `vocab_parallel_loss`: the masked cross-entropy sum over the vocab-parallel LM head without gathering the
  logits (Megatron's vocab-parallel cross-entropy: a max, a sum of exponentials and the target logit, each
  all-reduced), so a rank holds [tokens, V / tp] logits, never [tokens, V].
- `TPTrain.finish_grads_`: `reduce_partial_grads` on the gradients (after the DP sum, before clipping).
- `TPTrain.clip_`: the global norm of the *model's* gradient: each leaf's squared norm divided by the number of
  TP ranks holding a copy of it (norms, the leaves `region_replicated` lists, KV heads shared by several ranks),
  summed over the group (and over the FSDP shards), so the norm and the clipping equal one process's.
- `unshard_adamw` / `shard_adamw`: checkpoints hold the full model and the full AdamW state, in the layout a
  1-process run writes, so `astrai generate` loads the model and a run resumes on any `--tp` (or none).

The MoE load-balancing loss is computed by every rank of the group from the replicated router; its gradient
reaches the router and the region's input once per rank and is summed by the group, so the step weighs it by
1 / tp (`aux_scale`), which makes the sum the 1-process gradient.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams
from astrai.models.tp import check_tp, reduce_partial_grads, region_replicated, shard_params, unshard_params
from astrai.ops.collectives import TensorParallel, tp_copy, tp_reduce
from astrai.train.optim import AdamWState
from astrai.tree import leaves, tree_map

__all__ = [
    "Layout",
    "TPTrain",
    "check_tp_run",
    "make_layout",
    "shard_adamw",
    "unshard_adamw",
    "vocab_parallel_loss",
]


def check_tp_run(tp: int, model_cfg: ModelConfig | None, world: int | None = None) -> None:
    """ValueErrors naming `--tp` for a world that is not a multiple of it, or a model it does not split."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    if tp == 1:
        return
    if world % tp:
        hint = "launch with torchrun --nproc-per-node" if world == 1 else "use a multiple of it"
        raise ValueError(f"--tp {tp} needs WORLD_SIZE a multiple of {tp}, got {world} ({hint})")
    if model_cfg is not None:
        try:
            check_tp(model_cfg, tp)
        except ValueError as err:
            raise ValueError(f"--tp {tp}: the model does not split: {err}") from None


@attrs.frozen
class Layout:
    """Where this rank sits in a TP x DP job.

    Attributes:
        tp: this rank's tensor-parallel group (None when `--tp` is 1).
        dp_rank: index of this rank's TP group (the data shard it reads).
        dp_size: number of TP groups (data-parallel replicas).
        dp_group: process group of the ranks with this rank's TP rank (None: the world, when `--tp` is 1).
        dp_mesh: 1-D `DeviceMesh` over `dp_group` (None when `--tp` is 1): FSDP shards over it.
    """

    tp: TensorParallel | None
    dp_rank: int
    dp_size: int
    dp_group: Any = None
    dp_mesh: Any = None


def make_layout(tp: int, rank: int, world: int, device: torch.device) -> Layout:
    """The groups of a TP x DP job (a collective when `tp` > 1: every rank calls it, in the same order)."""
    check_tp_run(tp, None, world)
    if tp == 1:
        return Layout(tp=None, dp_rank=rank, dp_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))  # row k: ranks k tp...
    group = TensorParallel(rank=rank % tp, size=tp, group=mesh.get_group("tp"))
    return Layout(tp=group, dp_rank=rank // tp, dp_size=world // tp, dp_group=mesh.get_group("dp"),
                  dp_mesh=mesh["dp"])  # fmt: skip


def _all_reduce_max(x: Tensor, tp: TensorParallel) -> Tensor:
    out = x.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=tp.group)
    return out


def vocab_parallel_loss(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    mask: Tensor,
    *,
    vocab_size: int,
    tp: TensorParallel,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Masked sum of token cross-entropies (as `chunked_cross_entropy`) of a vocab-parallel LM head.

    `h` [N, E]: the final-norm hidden states (replicated); `weight` [V_r, E] / `bias` [V_r]: this rank's vocab rows
    [rank V_r, (rank + 1) V_r), zero-padded past `vocab_size`. Every rank returns the full loss; the gradient
    reaching `h` is summed over the ranks (`tp_copy`).
    """
    rows = weight.shape[0]
    start = tp.rank * rows
    logits = torch.nn.functional.linear(tp_copy(h, tp), weight, bias).float()  # [N, V_r]
    valid = torch.arange(start, start + rows, device=logits.device) < vocab_size  # the padding rows are no token
    logits = logits.masked_fill(~valid, float("-inf"))
    shifted = logits - _all_reduce_max(logits.max(dim=-1, keepdim=True).values, tp)  # lse is independent of it
    lse = tp_reduce(shifted.exp().sum(dim=-1), tp).log()
    local = targets - start
    inside = (local >= 0) & (local < rows)
    picked = shifted.gather(1, local.clamp(0, rows - 1).unsqueeze(1)).squeeze(1)
    nll = lse - tp_reduce(torch.where(inside, picked, torch.zeros_like(picked)), tp)
    if label_smoothing:
        mean = tp_reduce(shifted.masked_fill(~valid, 0.0).sum(dim=-1), tp) / vocab_size
        nll = (1.0 - label_smoothing) * nll + label_smoothing * (lse - mean)
    return (nll * mask.to(nll.dtype)).sum()


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


@attrs.frozen
class TPTrain:
    """What the train step needs to finish a TP step: the full model config and this rank's group.

    Attributes:
        cfg: the full model's config (`astrai.models.tp.tp_config(cfg, size)` is what the shard runs with).
        tp: this rank's tensor-parallel group.
        sharded: the trainable leaves are FSDP `Shard(0)` DTensors over the DP group (`--tp N --fsdp`).
    """

    cfg: ModelConfig
    tp: TensorParallel
    sharded: bool = False

    @property
    def aux_scale(self) -> float:
        """Weight of the MoE load-balancing loss on each rank (the group sums the ranks' gradients of it)."""
        return 1.0 / self.tp.size

    def copies(self, trainable: DecoderParams) -> list[int]:
        """Per leaf of `trainable` (flatten order): how many ranks of the group hold the same values."""
        size, replicated = self.tp.size, {}
        for t in (*region_replicated(trainable), *leaves(trainable.norm)):
            replicated[id(t)] = size
        for b in trainable.blocks:
            for t in leaves((b.attn_norm, b.mlp_norm)):
                replicated[id(t)] = size
        if self.cfg.attn_type == "gqa" and self.cfg.num_key_value_heads < size:
            for b in trainable.blocks:  # one KV head per `share` ranks
                for t in leaves((b.attn.k_proj, b.attn.v_proj)):
                    replicated[id(t)] = size // self.cfg.num_key_value_heads
        return [replicated.get(id(t), 1) for t in leaves(trainable)]

    def finish_grads_(self, trainable: DecoderParams, grads: list[Tensor]) -> None:
        """Sum the partial gradients of replicated leaves inside the parallel regions, in place."""
        it = iter(_local(g) for g in grads)
        reduce_partial_grads(tree_map(lambda _: next(it), trainable), self.cfg, self.tp)

    def clip_(self, trainable: DecoderParams, grads: list[Tensor], max_norm: float | None) -> Tensor:
        """Global-norm clipping of the whole model's gradient (one scalar all-reduce); returns the pre-clip norm."""
        locals_ = [_local(g) for g in grads]
        parts = [g.float().pow(2).sum() / n for g, n in zip(locals_, self.copies(trainable), strict=True)]
        sq = torch.stack(parts).sum()
        dist.all_reduce(sq, group=None if self.sharded else self.tp.group)  # FSDP: the DP shards too
        norm = sq.sqrt()
        if max_norm is not None and max_norm > 0:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for g in locals_:
                g.mul_(scale.to(g.dtype))
        return norm


def unshard_adamw(state: AdamWState, cfg: ModelConfig, tp: TensorParallel) -> AdamWState:
    """The full model's AdamW state from every rank's (plain tensors; collective over the group)."""
    step = leaves(state.step)[0]  # every leaf is updated every step: one counter value
    exp_avg = unshard_params(state.exp_avg, cfg, tp)
    return AdamWState(exp_avg=exp_avg, exp_avg_sq=unshard_params(state.exp_avg_sq, cfg, tp),
                      step=tree_map(lambda _: step.clone(), exp_avg))  # fmt: skip


def shard_adamw(state: AdamWState, cfg: ModelConfig, tp: TensorParallel) -> AdamWState:
    """This rank's AdamW state from the full model's (the inverse of `unshard_adamw`)."""
    step = leaves(state.step)[0]
    exp_avg = shard_params(state.exp_avg, cfg, tp)
    return AdamWState(exp_avg=exp_avg, exp_avg_sq=shard_params(state.exp_avg_sq, cfg, tp),
                      step=tree_map(lambda _: step.clone(), exp_avg))  # fmt: skip

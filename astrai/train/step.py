"""The train step: masked causal-LM loss over packed rows, gradient accumulation, clipping and the optimizer
(AdamW, or Muon + AdamW).

`train_loss` is a pure function of its arguments (trainable tree, frozen tree, batch, normaliser) with the
static settings (model config, step options, `to_params`) bound by `functools.partial`; it is what gets
compiled (forward + backward through AOTAutograd, as torchtitan compiles its blocks). `TrainStep.__call__` is
the thin host part around it that sums micro-batch gradients, all-reduces them across data-parallel ranks,
clips and updates in place. `eval_sums` is the eval pass over the same loss, also a function of explicit
inputs.

Notable features:
- Token-level normalisation: every micro-batch's loss is its *sum* over trained tokens divided by the trained
  tokens of the whole global batch (all micro-batches on all ranks), so k accumulated micro-batches and R
  data-parallel ranks give exactly the gradient of one big batch.
- Document-aware attention: packed rows never attend across documents (`LMBatch.positions` restarts at 0).
- Chunked cross-entropy: fp32 [tokens, vocab] logits never exist at once.
- Trainable vs frozen: the optimiser sees only `trainable` (the whole tree, or LoRA adapters);
  `to_params(frozen, trainable)` builds the tree the forward runs on.
- Mixed precision: fp32 master weights, optional autocast (bf16 on GPUs); NEFTune noise on the embeddings
  (uniform, alpha / sqrt(T * E) as in the paper); per-block activation checkpointing.
- FSDP (`astrai.train.fsdp`): with sharded trees the loss runs each unit (embedding, every block, final norm +
  LM head) through a unit runner that all-gathers its shards only for that unit (`fsdp_unit="block"`, eager), or
  the whole tree is gathered per micro-batch (`fsdp_unit="model"`, the compiled loss). DPO (`DPOStep`) uses the
  latter.
- Tensor parallelism (`astrai.train.tp.TPTrain`): the loss runs the rank's shard with the local config and the
  vocab-parallel cross-entropy; after the data-parallel sum (over `dp_group` only) the partial gradients of
  replicated leaves inside the parallel regions are summed over the group and the clipping norm counts each
  replicated leaf once.
- MoE: the load-balancing loss (`astrai.nn.moe.load_balancing_loss`, transformers' formula) is added with
  `moe_aux_loss_coef`, weighted by the micro-batch's trained tokens so accumulation keeps a token-weighted
  mean; with one micro-batch the loss is mean CE + coef * aux, exactly as transformers computes it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from astrai.data.batch import LMBatch, document_ids
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams, hidden_states
from astrai.models.tp import tp_config
from astrai.nn.chunked_loss import chunked_cross_entropy
from astrai.nn.embedding import EmbeddingParams, embed
from astrai.nn.linear import LinearParams
from astrai.nn.moe import load_balancing_loss, router_stats
from astrai.nn.norm import RMSNormParams, rms_norm
from astrai.ops.collectives import TensorParallel
from astrai.train.fsdp import BlockGather, clip_sharded_, gather_tree
from astrai.train.muon import muon_mask
from astrai.train.optim import (
    AdamWConfig,
    AdamWState,
    MuonAdamWState,
    clip_grad_norm_,
    decay_mask,
    init_optimizer,
    optimizer_update_,
    uses_muon,
)
from astrai.train.tp import TPTrain, vocab_parallel_loss
from astrai.tree import leaves, pytree, tree_map


@attrs.frozen
class StepOptions:
    """Static settings of the train step.

    Attributes:
        max_grad_norm: global-norm clipping threshold (None or <= 0: no clipping; the norm is still reported).
        neftune_alpha: NEFTune noise scale (0: off).
        checkpoint_blocks: recompute each block in backward instead of storing its activations.
        autocast_dtype: compute dtype under autocast (e.g. torch.bfloat16 on GPUs); None: params' dtype.
        ce_chunk: rows per cross-entropy chunk.
        label_smoothing: cross-entropy label smoothing.
        moe_aux_loss_coef: weight of the MoE load-balancing loss (no effect on dense models).
        compile: wrap the loss (forward + backward) in torch.compile.
    """

    max_grad_norm: float | None = 1.0
    neftune_alpha: float = 0.0
    checkpoint_blocks: bool = False
    autocast_dtype: torch.dtype | None = None
    ce_chunk: int = 4096
    label_smoothing: float = 0.0
    moe_aux_loss_coef: float = 0.01
    compile: bool = True


@pytree
@attrs.frozen(eq=False)
class TrainState:
    """What the optimiser updates: the trainable tree (leaves require grad) and its optimizer state (AdamW, or
    Muon + AdamW)."""

    trainable: Any
    opt: AdamWState | MuonAdamWState


def is_packed(batch: LMBatch) -> bool:
    """Whether some row holds more than one document (host check; rows of one document skip the mask)."""
    return bool((batch.positions[:, 1:] == 0).any())


def lm_loss(
    params: DecoderParams,
    batch: LMBatch,
    norm: Tensor,
    *,
    cfg: ModelConfig,
    opts: StepOptions,
    packed: bool = True,
    run_unit: Callable[..., Any] | None = None,
    tp: TPTrain | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(loss to backpropagate = (task sum + coef * MoE aux * trained tokens) / norm, detached task sum, the MoE
    routers' detached statistics (`astrai.nn.moe.router_stats`; {} for dense models)).

    `packed=False` promises one document per row (pretraining windows): attention takes the plain causal path
    instead of building a document mask. `run_unit` (FSDP per block, `astrai.train.fsdp.BlockGather`) makes the
    call of each unit: the embedding, every block (`hidden_states`) and the head (final norm + LM head + loss).
    `tp` (`astrai.train.tp`): `params` is this rank's tensor-parallel shard and `cfg` its local config.
    """
    run = _call if run_unit is None else run_unit
    group = None if tp is None else tp.tp
    with torch.autocast(batch.tokens.device.type, dtype=opts.autocast_dtype, enabled=opts.autocast_dtype is not None):
        embeds = None
        if opts.neftune_alpha > 0 or group is not None:  # the vocab-parallel lookup takes the group
            embeds = run(embed, params.embed_tokens, batch.tokens, group)
        if opts.neftune_alpha > 0:
            scale = opts.neftune_alpha / math.sqrt(embeds.shape[1] * embeds.shape[2])
            embeds = embeds + (torch.rand_like(embeds) * 2 - 1) * scale
        h, moe_aux = hidden_states(
            params,
            cfg,
            batch.tokens,
            positions=batch.positions,
            doc_ids=document_ids(batch.positions) if packed else None,
            embeds=embeds,
            checkpoint_blocks=opts.checkpoint_blocks,
            return_aux=True,
            run_unit=run_unit,
            tp=group,
        )
    head = params.embed_tokens if params.lm_head is None else params.lm_head
    task = run(_head_loss, (params.norm, head), h, batch, cfg=cfg, opts=opts, tp=group)
    loss, stats = task, {}
    if cfg.ffn_type == "moe" and moe_aux is not None:
        stats = {k: v.detach() for k, v in router_stats(moe_aux).items()}
        if opts.moe_aux_loss_coef:
            # token-weighted so that summing micro-batch losses / norm gives coef * (token-weighted mean aux)
            coef = opts.moe_aux_loss_coef * (1.0 if tp is None else tp.aux_scale)  # TP: the group sums its grads
            loss = loss + coef * load_balancing_loss(moe_aux) * batch.loss_mask.sum()
    return loss / norm, task.detach(), stats


def _call(fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> Any:
    """The plain unit runner: `fn(params, *args, **kwargs)`."""
    return fn(params, *args, **kwargs)


def _head_loss(
    head: tuple[RMSNormParams, EmbeddingParams | LinearParams], h: Tensor, batch: LMBatch, *, cfg: ModelConfig,
    opts: StepOptions, tp: TensorParallel | None = None,
) -> Tensor:  # fmt: skip
    """The head unit: final norm (under autocast) then the chunked cross-entropy sum over trained tokens (with
    `tp`: the vocab-parallel loss, `astrai.train.tp.vocab_parallel_loss`)."""
    norm, out = head
    with torch.autocast(batch.tokens.device.type, dtype=opts.autocast_dtype, enabled=opts.autocast_dtype is not None):
        h = rms_norm(norm, h, eps=cfg.rms_norm_eps)
        if tp is not None and tp.size > 1:
            return vocab_parallel_loss(
                h.reshape(-1, h.shape[-1]), out.weight, out.bias if isinstance(out, LinearParams) else None,
                batch.targets.reshape(-1), batch.loss_mask.reshape(-1), vocab_size=cfg.vocab_size, tp=tp,
                label_smoothing=opts.label_smoothing,
            )  # fmt: skip
    return chunked_cross_entropy(
        h.reshape(-1, h.shape[-1]),
        out.weight,
        batch.targets.reshape(-1),
        batch.loss_mask.reshape(-1),
        bias=out.bias if isinstance(out, LinearParams) else None,
        chunk_size=opts.ce_chunk,
        label_smoothing=opts.label_smoothing,
    )


def full_params(frozen: Any, trainable: Any) -> Any:
    """`to_params` when the whole tree trains: the trainable tree itself (`frozen` is None)."""
    return trainable


def train_loss(
    trainable: Any,
    frozen: Any,
    batch: LMBatch,
    norm: Tensor,
    packed: bool,
    *,
    cfg: ModelConfig,
    opts: StepOptions,
    to_params: Callable[[Any, Any], DecoderParams] = full_params,
    run_unit: Callable[..., Any] | None = None,
    tp: TPTrain | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """`lm_loss` on the tree `to_params(frozen, trainable)`: the function the train step compiles.

    Everything it reads is an argument; `cfg`, `opts` and `to_params` are static and bound with
    `functools.partial` before compiling.

    Args:
        trainable: the tree the optimiser updates (the whole model, or LoRA adapters).
        frozen: the tree that does not train (the LoRA base), or None.
        batch: one micro-batch.
        norm: trained tokens of the whole global batch (the loss is a sum divided by it).
        packed: whether some row holds several documents (`is_packed`, decided on the host).
        cfg: the model's config.
        opts: the step's static settings.
        to_params: builds the forward's tree from (frozen, trainable), e.g. `apply_lora` or `full_params`.
        run_unit: FSDP per block: the runner that gathers each unit's shards (`trainable`/`frozen` then hold
            `Shard(0)` DTensors); None: the trees are plain tensors.
        tp: tensor parallelism (`astrai.train.tp.TPTrain`): `trainable` is this rank's shard, `cfg` its local config.

    Returns:
        As `lm_loss`.
    """
    params = to_params(frozen, trainable)
    return lm_loss(params, batch, norm, cfg=cfg, opts=opts, packed=packed, run_unit=run_unit, tp=tp)


@torch.no_grad()
def eval_sums(
    trainable: Any,
    frozen: Any,
    batches: Sequence[LMBatch],
    *,
    cfg: ModelConfig,
    opts: StepOptions,
    to_params: Callable[[Any, Any], DecoderParams] = full_params,
    run_unit: Callable[..., Any] | None = None,
    tp: TPTrain | None = None,
) -> tuple[Tensor, Tensor]:
    """(summed task loss, trained tokens) over `batches` on this rank, eager; the eval loss is their ratio.

    Takes the same inputs as `train_loss` (full, unsharded `trainable`, or sharded ones with `run_unit`, e.g.
    `astrai.train.fsdp.BlockGather()`, which gathers one unit at a time; batches on the params' device), so the
    eval pass reads nothing from the train step object.
    """
    params = to_params(frozen, trainable)
    device = batches[0].tokens.device if batches else None
    total, count = torch.zeros((), device=device), torch.zeros((), device=device)
    one = torch.ones((), device=device)
    for batch in batches:
        _, task_sum, _ = lm_loss(params, batch, one, cfg=cfg, opts=opts, packed=is_packed(batch), run_unit=run_unit,
                                 tp=tp)  # fmt: skip
        total += task_sum
        count += batch.loss_mask.sum()
    return total, count


def init_train_state(trainable: Any, optim: AdamWConfig | None = None) -> TrainState:
    """Detached leaves that require grad (fp32 master copies are the caller's choice) + fresh optimizer state
    (AdamW, or Muon + AdamW when `optim` is an `OptimConfig` with name "muon")."""
    trainable = tree_map(lambda t: t.detach().requires_grad_(True), trainable)
    return TrainState(trainable=trainable, opt=init_optimizer(trainable, optim))


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_reduce_sum_(tensors: list[Tensor], group: Any = None) -> None:
    """Sum `tensors` over data-parallel ranks (`group`; None: the world) in one flat bucket (in place)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


class TrainStep:
    """Callable `(state, micro_batches, lr, frozen=None) -> metrics`: one optimiser step over a global batch.

    Host code (never compiled itself); `train_loss` inside it is, with only the static settings bound. The
    object holds nothing but those settings: the trees, batches and learning rate come in with each call.
    State is updated in place (AdamW on the leaves, like `torch.optim`), so the caller keeps using the same
    `TrainState`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        opts: StepOptions,
        optim: AdamWConfig,
        *,
        trainable: Any,
        to_params: Callable[[Any, Any], DecoderParams] = full_params,
        sharded: bool = False,
        fsdp_unit: Literal["block", "model"] = "block",
        fsdp_param_dtype: torch.dtype | None = None,
        fsdp_reduce_dtype: torch.dtype | None = torch.float32,
        fsdp_prefetch: bool = True,
        tp: TPTrain | None = None,
        dp_group: Any = None,
    ) -> None:
        """`sharded`: the trainable leaves (and those of a LoRA `frozen` base, if sharded) are `Shard(0)` DTensors
        (`astrai.train.fsdp`). `fsdp_unit` "block" gathers each unit (embedding, block, head) only while it runs
        (eager: the loss is not compiled), "model" gathers the whole tree per micro-batch (the compiled loss);
        subclasses with their own `micro_loss` (DPO) always use "model". `fsdp_param_dtype` / `fsdp_reduce_dtype`:
        the all-gather and the gradient reduce-scatter dtypes (mixed precision; None: the shards' dtype);
        `fsdp_prefetch`: per block, gather the next unit while this one computes (`BlockGather.prefetch`).
        `tp` (`astrai.train.tp.TPTrain`): `trainable` is this rank's tensor-parallel shard of a model with config
        `cfg` (the full config; the loss runs with the local one); `dp_group`: the process group gradients are
        summed over (None: the world)."""
        if fsdp_unit not in ("block", "model"):
            raise ValueError(f"fsdp_unit must be 'block' or 'model', got {fsdp_unit!r}")
        if fsdp_param_dtype not in (None, torch.float32, opts.autocast_dtype):
            raise ValueError(f"fsdp_param_dtype {fsdp_param_dtype} needs autocast in that dtype (autocast_dtype is "
                             f"{opts.autocast_dtype}): the gathered weights are the compute weights")  # fmt: skip
        self.opts, self.optim = opts, optim
        self.sharded, self.tp, self.dp_group = sharded, tp, dp_group
        self.per_block = sharded and fsdp_unit == "block" and type(self).micro_loss is TrainStep.micro_loss
        self.gather_dtypes = {"param_dtype": fsdp_param_dtype, "reduce_dtype": fsdp_reduce_dtype}
        self.decay = decay_mask(trainable)  # from the tree's names and shapes only
        self.muon = muon_mask(trainable) if uses_muon(optim) else None
        run_unit = BlockGather(**self.gather_dtypes, prefetch=fsdp_prefetch) if self.per_block else None
        self.run_unit = run_unit
        local_cfg = cfg if tp is None else tp_config(cfg, tp.tp.size)
        loss = functools.partial(train_loss, cfg=local_cfg, opts=opts, to_params=to_params, run_unit=run_unit, tp=tp)
        self.loss = torch.compile(loss) if opts.compile and not self.per_block else loss

    def __call__(
        self,
        state: TrainState,
        micro_batches: Sequence[LMBatch],
        lr: float,
        frozen: Any = None,
        *,
        muon_lr: float | None = None,
    ) -> dict[str, Tensor]:
        """Accumulate gradients over `micro_batches`, sync ranks, clip, update; returns fp32 scalar metrics.

        `frozen` is the tree that does not train (the LoRA base), passed to the loss as an input. `lr` is the
        (AdamW) learning rate of this step, `muon_lr` the Muon matrices' one (default `lr`; Muon runs only).
        """
        if not micro_batches:
            raise ValueError("a train step needs at least one micro-batch")
        # [items normalising the loss, trained tokens] of the global batch (one all-reduce)
        counts = torch.stack([self.counts(mb) for mb in micro_batches]).sum(dim=0).float()
        world = _world() if self.dp_group is None else dist.get_world_size(self.dp_group)
        if world > 1:
            dist.all_reduce(counts, group=self.dp_group)
        norm, tokens = counts[0].clamp(min=1.0), counts[1]
        total = torch.zeros((), device=counts.device)
        stats: dict[str, Tensor] = {}  # statistics summed over micro-batches (and ranks below)
        for mb in micro_batches:
            trainable, frozen_mb = state.trainable, frozen
            if self.sharded and not self.per_block:  # fsdp_unit "model": one full copy per micro-batch
                trainable = gather_tree(trainable, **self.gather_dtypes)
                frozen_mb = gather_tree(frozen, **self.gather_dtypes) if frozen is not None else None
            loss, task_sum, mb_stats = self.micro_loss(trainable, frozen_mb, mb, norm)
            loss.backward()
            if self.run_unit is not None:  # backward prefetches never unpacked by the backward
                self.run_unit.drain()
            total += task_sum
            for name, value in mb_stats.items():
                stats[name] = stats.get(name, 0) + value
        params = leaves(state.trainable)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.sharded:  # the backward already reduce-scattered the gradients into the shards
            _all_reduce_sum_([total, *stats.values()], self.dp_group)
        elif world > 1:
            _all_reduce_sum_([total, *stats.values(), *grads], self.dp_group)
        if self.tp is not None:  # partial sums of replicated leaves, then the whole model's norm
            self.tp.finish_grads_(state.trainable, grads)
            grad_norm = self.tp.clip_(state.trainable, grads, self.opts.max_grad_norm)
        elif self.sharded:
            grad_norm = clip_sharded_(grads, self.opts.max_grad_norm)
        else:
            grad_norm = clip_grad_norm_(grads, self.opts.max_grad_norm)
        with torch.no_grad():
            optimizer_update_(
                state.trainable, grads, state.opt, lr=lr, cfg=self.optim, muon_lr=muon_lr, decay=self.decay,
                muon=self.muon,
            )  # fmt: skip
        for p in params:
            p.grad = None
        means = self.stat_means(stats, norm, len(micro_batches) * world)
        return {"loss": total / norm, "grad_norm": grad_norm, "tokens": tokens, **means}

    # ---- what differs between objectives (`astrai.train.dpo.DPOStep` overrides these) ---------------------------
    def counts(self, mb: Any) -> Tensor:
        """[2]: (items the loss is normalised by, trained tokens) of one micro-batch: both its trained tokens."""
        tokens = mb.loss_mask.sum()
        return torch.stack([tokens, tokens])

    def micro_loss(
        self, trainable: Any, frozen: Any, mb: Any, norm: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """(loss to backpropagate, detached loss sum, statistics) of one micro-batch."""
        return self.loss(trainable, frozen, mb, norm, is_packed(mb))

    def stat_means(self, stats: dict[str, Tensor], norm: Tensor, n_micro: int) -> dict[str, Tensor]:
        """Global means of the summed statistics: MoE router statistics average over micro-batches and ranks."""
        return {name: value / n_micro for name, value in stats.items()}

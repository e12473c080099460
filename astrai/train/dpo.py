"""The DPO train step and its reference log-probs: what `astrai train` runs when `TrainConfig.dpo` is set.

`dpo_train_loss` is the compiled function, beside `astrai.train.step.train_loss`: one forward over the chosen and
rejected rows concatenated ([2B, T]), sequence log-probs summed over each side's loss mask
(`astrai.train.preference.sequence_logprobs`: chunked LM head, no fp32 [tokens, vocab] tensor), then
`astrai.train.preference.dpo_loss`. `DPOStep` is `TrainStep` with that loss: the same accumulation, data-parallel
all-reduce (or FSDP reduce-scatter), clipping and optimizer, so k micro-batches on R ranks give the gradient of
one big batch.

Notable features:
- Pair-level normalisation: each micro-batch's loss is its *sum* over pairs divided by the pairs of the whole
  global batch (all micro-batches on all ranks), as the LM step divides token sums by the global token count;
  the metrics (`rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies`, `logps/chosen`,
  `logps/rejected`) are global means over pairs too.
- Reference log-probs from the start weights, two ways (`DPOConfig.reference`):
  `precomputed`: one no-grad pass over the training pairs before step 1, stored as
  RUN/reference_logps.safetensors ([N] `chosen` and `rejected`, indexed by dataset index) and read back on
  resume; `frozen`: the start weights compute them per micro-batch. With LoRA the reference is the base tree
  (adapters off) in both modes: no second copy of the weights. Without LoRA, `frozen` keeps one copy.
- Rows are right-padded to seq_len, so the compiled step sees one shape.

Not here: NEFTune noise and the MoE load-balancing loss (the LM step's extras) in the DPO loss; an eval pass.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from astrai.data.datasets import DPODataset, PairBatch
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams
from astrai.train.config import DPOConfig
from astrai.train.data import DPOBatch, dpo_batch
from astrai.train.optim import AdamWConfig
from astrai.train.preference import dpo_loss, sequence_logprobs
from astrai.train.step import StepOptions, TrainStep, full_params
from astrai.tree import tree_map

REFERENCE_FILE = "reference_logps.safetensors"

_log = logging.getLogger("astrai.train")


def pair_logprobs(params: DecoderParams, pairs: PairBatch, *, cfg: ModelConfig, opts: StepOptions) -> Tensor:
    """[2, B] fp32 sequence log-probs of (chosen, rejected), in one forward over the concatenated [2B, T] rows.

    Rows are right-padded single documents, so attention takes the plain causal path (no positions needed).
    """
    tokens = torch.cat([pairs.chosen.tokens, pairs.rejected.tokens])  # [2B, T]
    mask = torch.cat([pairs.chosen.loss_mask, pairs.rejected.loss_mask])  # [2B, T]
    with torch.autocast(tokens.device.type, dtype=opts.autocast_dtype, enabled=opts.autocast_dtype is not None):
        logps = sequence_logprobs(
            params, cfg, tokens, mask, chunk_size=opts.ce_chunk, checkpoint_blocks=opts.checkpoint_blocks
        )  # [2B]
    return logps.view(2, -1)  # [2, B]


def dpo_train_loss(
    trainable: Any,
    frozen: Any,
    pairs: PairBatch,
    ref_logps: Tensor,
    norm: Tensor,
    *,
    cfg: ModelConfig,
    opts: StepOptions,
    dpo: DPOConfig,
    to_params: Callable[[Any, Any], DecoderParams] = full_params,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """DPO loss of one micro-batch on the tree `to_params(frozen, trainable)`: the function the DPO step compiles.

    Args:
        trainable: the tree the optimiser updates (the whole model, or LoRA adapters).
        frozen: the tree that does not train (the LoRA base), or None.
        pairs: the micro-batch's chosen and rejected rows ([B, T] each).
        ref_logps: [2, B] reference log-probs of (chosen, rejected) (constants).
        norm: preference pairs of the whole global batch (the loss is a sum over pairs divided by it).
        cfg: the model's config.
        opts: the step's static settings.
        dpo: beta, loss type and label smoothing.
        to_params: builds the forward's tree from (frozen, trainable).

    Returns:
        (loss to backpropagate = sum of per-pair losses / norm, detached sum of per-pair losses, detached sums over
        the micro-batch's pairs of the `dpo_loss` metrics).
    """
    policy = pair_logprobs(to_params(frozen, trainable), pairs, cfg=cfg, opts=opts)  # [2, B]
    lengths = (pairs.chosen.loss_mask.sum(-1), pairs.rejected.loss_mask.sum(-1))  # completion tokens, for ipo
    mean, metrics = dpo_loss(
        policy[0], policy[1], ref_logps[0], ref_logps[1], beta=dpo.beta, loss_type=dpo.loss_type,
        label_smoothing=dpo.label_smoothing, chosen_lengths=lengths[0], rejected_lengths=lengths[1],
    )  # fmt: skip
    pairs_here = policy.shape[1]
    total = mean * pairs_here  # dpo_loss averages over this micro-batch's pairs; the step wants their sum
    return total / norm, total.detach(), {name: value * pairs_here for name, value in metrics.items()}


class DPOStep(TrainStep):
    """`TrainStep` with `dpo_train_loss`: micro-batches are `DPOBatch`es whose `ref` is filled in.

    The loss is normalised by the global pair count and the metrics are global means over pairs; the returned
    `tokens` counts trained (completion) tokens of both sides.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        opts: StepOptions,
        optim: AdamWConfig,
        dpo: DPOConfig,
        *,
        trainable: Any,
        to_params: Callable[[Any, Any], DecoderParams] = full_params,
        sharded: bool = False,
    ) -> None:
        super().__init__(cfg, opts, optim, trainable=trainable, to_params=to_params, sharded=sharded)
        loss = functools.partial(dpo_train_loss, cfg=cfg, opts=opts, dpo=dpo, to_params=to_params)
        self.loss = torch.compile(loss) if opts.compile else loss

    def counts(self, mb: DPOBatch) -> Tensor:
        pairs = mb.pairs
        tokens = pairs.chosen.loss_mask.sum() + pairs.rejected.loss_mask.sum()
        return torch.stack([torch.full_like(tokens, pairs.chosen.tokens.shape[0]), tokens])

    def micro_loss(
        self, trainable: Any, frozen: Any, mb: DPOBatch, norm: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        return self.loss(trainable, frozen, mb.pairs, mb.ref, norm)

    def stat_means(self, stats: dict[str, Tensor], norm: Tensor, n_micro: int) -> dict[str, Tensor]:
        return {name: value / norm for name, value in stats.items()}  # sums over pairs -> means over pairs


# ---- reference log-probs -------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_logprobs(params: DecoderParams, pairs: PairBatch, *, cfg: ModelConfig, opts: StepOptions) -> Tensor:
    """[2, B] reference log-probs of a micro-batch's (chosen, rejected) rows (no grad, eager)."""
    return pair_logprobs(params, pairs, cfg=cfg, opts=opts).float()


class PrecomputedReference:
    """Reference log-probs looked up by dataset index in a [2, N] table (`precompute_reference`)."""

    def __init__(self, table: Tensor) -> None:
        self.table = table

    def __call__(self, batch: DPOBatch) -> Tensor:
        return self.table[:, batch.index.to(self.table.device)]


class FrozenReference:
    """Reference log-probs computed per micro-batch by a tree that never trains (the LoRA base, or a copy)."""

    def __init__(self, params: DecoderParams, *, cfg: ModelConfig, opts: StepOptions) -> None:
        self.params, self.cfg, self.opts = params, cfg, opts

    def __call__(self, batch: DPOBatch) -> Tensor:
        return reference_logprobs(self.params, batch.pairs, cfg=self.cfg, opts=self.opts)


def precompute_reference(
    params: DecoderParams,
    data: DPODataset,
    *,
    cfg: ModelConfig,
    opts: StepOptions,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
) -> Tensor:
    """[2, N] reference log-probs of every pair of `data` (rank r does items r, r + R, ...; then all-reduced)."""
    table = torch.zeros(2, len(data), device=device)
    mine = list(range(rank, len(data), world_size))
    for start in range(0, len(mine), batch_size):
        indices = mine[start : start + batch_size]
        batch = dpo_batch([data[i] for i in indices], indices, pad_id=data.pad_id, seq_len=seq_len)
        pairs = tree_map(lambda t: t.to(device), batch.pairs)
        table[:, torch.tensor(indices, device=device)] = reference_logprobs(params, pairs, cfg=cfg, opts=opts)
    if world_size > 1:
        dist.all_reduce(table)  # every item was computed by exactly one rank; the others hold 0
    return table


def save_reference(path: Path, table: Tensor) -> None:
    """Write the [2, N] table as `chosen` and `rejected` tensors (atomically: a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"chosen": table[0].cpu().contiguous(), "rejected": table[1].cpu().contiguous()}, str(tmp))
    os.replace(tmp, path)


def load_reference(path: Path, num_pairs: int) -> Tensor | None:
    """The [2, N] table saved at `path`, or None when it is missing or holds another number of pairs."""
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        chosen, rejected = f.get_tensor("chosen"), f.get_tensor("rejected")
    if chosen.shape != (num_pairs,) or rejected.shape != (num_pairs,):
        _log.warning(f"warning: {path} holds {chosen.shape[0]} pairs, the data {num_pairs}: recomputing it")
        return None
    return torch.stack([chosen, rejected])


def make_reference(
    dpo: DPOConfig,
    start: DecoderParams,
    *,
    shared: bool,
    data: DPODataset,
    run_dir: Path,
    resuming: bool,
    cfg: ModelConfig,
    opts: StepOptions,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    rank: int,
    world_size: int,
) -> Callable[[DPOBatch], Tensor]:
    """The run's reference: `PrecomputedReference` (read from `run_dir` on resume, else computed and saved by rank
    0) or `FrozenReference`.

    Args:
        start: the start weights, before any step (or resume) changes them.
        shared: `start` is never updated in place (the LoRA base): `frozen` uses it as is, no copy; otherwise
            `frozen` keeps a copy.
    """
    if dpo.reference == "frozen":
        params = start if shared else tree_map(lambda t: t.detach().clone(), start)
        return FrozenReference(params, cfg=cfg, opts=opts)
    path = run_dir / REFERENCE_FILE
    table = load_reference(path, len(data)) if resuming else None
    if table is None:
        table = precompute_reference(
            start, data, cfg=cfg, opts=opts, batch_size=batch_size, seq_len=seq_len, device=device, rank=rank,
            world_size=world_size,
        )  # fmt: skip
        if rank == 0:
            save_reference(path, table)
    return PrecomputedReference(table.to(device))


def batch_rows(micro_batches: Sequence[Any]) -> int:
    """Token positions (rows x T) a step's micro-batches feed to the model (both sides of DPO pairs)."""
    total = 0
    for mb in micro_batches:
        total += 2 * mb.pairs.chosen.tokens.numel() if isinstance(mb, DPOBatch) else mb.tokens.numel()
    return total

"""The GRPO train step: what `astrai train` runs on rollout batches when `TrainConfig.grpo` is set.

`grpo_train_loss` is the compiled function, beside `astrai.train.step.train_loss` and the DPO one: a teacher-forced
forward of prompt + completion rows (`astrai.train.preference.token_logprobs_of`, chunked LM head, at the sampling
temperature as TRL), then `astrai.train.preference.grpo_loss` (token-level clipped ratio, k3 KL, TRL's four
normalisations). `GRPOStep` is `TrainStep` with that loss: the same accumulation, data-parallel all-reduce,
clipping and optimizer (AdamW or Muon + AdamW). The rollouts, rewards, advantages and reference log-probs that fill
a `GRPOBatch` are `astrai.train.rollout`'s.

Notable features:
- Global normalisation, so k micro-batches on R ranks give the gradient of one big batch: each micro-batch's loss
  is the per-micro-batch `grpo_loss` turned back into a sum and divided by the global count of its unit:
  `grpo` and `dr_grpo` by the sequences of the whole global batch, `dapo` by its completion tokens (TRL's
  `num_items_in_batch`); `bnpo` keeps TRL's per-micro-batch token mean and averages it over the micro-batches of
  all ranks (so only `bnpo` depends on how the batch is split, as in TRL).
- Old-policy log-probs: with `num_iterations` 1 the ratio is exactly 1 (TRL: `old = logps.detach()`); above 1
  every optimizer step on the same rollouts uses the log-probs recorded at rollout time (`GRPOBatch.old_logps`).
- Metrics (`clip_ratio/*`, `kl`) are completion-token means over the global batch.

Not here: FSDP (the rollout engine reads whole weights), entropy masking, sequence-level importance sampling
(GSPO), truncated-completion masking.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor

from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams
from astrai.train.config import GRPOConfig
from astrai.train.optim import AdamWConfig
from astrai.train.preference import grpo_loss, token_logprobs_of
from astrai.train.step import StepOptions, TrainStep, full_params
from astrai.tree import pytree

TOKENS_STAT = "completion_tokens"  # the micro-batch statistic that turns summed token metrics into means


@pytree
@attrs.frozen(eq=False)
class GRPOBatch:
    """One GRPO micro-batch: the G completions of each of its prompts, prompt-major, right-padded to seq_len.

    Attributes:
        tokens: [N, T] int64 prompt + completion ids (N = prompts * G), padded with the pad id.
        mask: [N, T] fp32 completion mask in the shifted-target convention: mask[n, t] = 1 when tokens[n, t + 1]
            is a sampled completion token (the stop token included), 0 on the prompt and padding.
        advantages: [N] fp32 group-relative advantages.
        old_logps: [N, T] fp32 log-probs of the targets recorded at rollout time (zeros where mask is 0).
        ref_logps: [N, T] fp32 reference log-probs of the targets (zeros when beta is 0).
    """

    tokens: Tensor
    mask: Tensor
    advantages: Tensor
    old_logps: Tensor
    ref_logps: Tensor


def completion_logprobs(
    params: DecoderParams, tokens: Tensor, *, cfg: ModelConfig, opts: StepOptions, temperature: float
) -> Tensor:
    """[N, T] fp32 log-probs of each row's next token at `temperature` (the teacher-forced forward)."""
    with torch.autocast(tokens.device.type, dtype=opts.autocast_dtype, enabled=opts.autocast_dtype is not None):
        return token_logprobs_of(
            params, cfg, tokens, chunk_size=opts.ce_chunk, checkpoint_blocks=opts.checkpoint_blocks,
            temperature=temperature,
        )  # fmt: skip


def grpo_train_loss(
    trainable: Any,
    frozen: Any,
    mb: GRPOBatch,
    norm: Tensor,
    *,
    cfg: ModelConfig,
    opts: StepOptions,
    grpo: GRPOConfig,
    to_params: Callable[[Any, Any], DecoderParams] = full_params,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """GRPO loss of one micro-batch on the tree `to_params(frozen, trainable)`: the function the GRPO step compiles.

    Args:
        trainable: the tree the optimiser updates (the whole model, or LoRA adapters).
        frozen: the tree that does not train (the LoRA base), or None.
        mb: the micro-batch.
        norm: the global count of the loss type's unit (`GRPOStep.counts`, summed over micro-batches and ranks).
        cfg: the model's config.
        opts: the step's static settings.
        grpo: the objective's settings.
        to_params: builds the forward's tree from (frozen, trainable).

    Returns:
        (loss to backpropagate, its detached un-normalised sum (the step reports sum / norm), detached sums over
        the micro-batch's completion tokens of the `grpo_loss` metrics, and their token count as TOKENS_STAT).
    """
    logps = completion_logprobs(to_params(frozen, trainable), mb.tokens, cfg=cfg, opts=opts,
                                temperature=grpo.temperature)  # fmt: skip
    mean, metrics = grpo_loss(
        logps, mb.old_logps if grpo.num_iterations > 1 else None, mb.ref_logps if grpo.beta > 0 else None,
        mb.advantages, mb.mask, epsilon_low=grpo.epsilon_low, epsilon_high=grpo.epsilon_high, beta=grpo.beta,
        loss_type=grpo.loss_type, max_completion_length=grpo.max_completion_tokens, num_items_in_batch=norm,
    )  # fmt: skip
    if grpo.loss_type in ("grpo", "dr_grpo"):  # means over this micro-batch's sequences -> their sum
        total = mean * mb.tokens.shape[0]
        loss = total / norm
    elif grpo.loss_type == "bnpo":  # TRL: this micro-batch's token mean, averaged over micro-batches (norm)
        total = mean
        loss = total / norm
    else:  # dapo: already the sum over the global batch's completion tokens (norm)
        total, loss = mean * norm, mean
    tokens = mb.mask.sum()
    stats = {name: value * tokens for name, value in metrics.items()}
    stats[TOKENS_STAT] = tokens.detach()
    return loss, total.detach(), stats


class GRPOStep(TrainStep):
    """`TrainStep` with `grpo_train_loss` on `GRPOBatch`es (normalisation in the module docstring); the returned
    `tokens` counts completion tokens."""

    def __init__(
        self,
        cfg: ModelConfig,
        opts: StepOptions,
        optim: AdamWConfig,
        grpo: GRPOConfig,
        *,
        trainable: Any,
        to_params: Callable[[Any, Any], DecoderParams] = full_params,
        sharded: bool = False,
    ) -> None:
        if sharded:
            raise ValueError("grpo with fsdp is not supported: the rollout engine reads whole weights")
        super().__init__(cfg, opts, optim, trainable=trainable, to_params=to_params)
        self.grpo = grpo
        loss = functools.partial(grpo_train_loss, cfg=cfg, opts=opts, grpo=grpo, to_params=to_params)
        self.loss = torch.compile(loss) if opts.compile else loss

    def counts(self, mb: GRPOBatch) -> Tensor:
        tokens = mb.mask.sum()
        unit = {"grpo": mb.mask.shape[0], "dr_grpo": mb.mask.shape[0], "bnpo": 1}.get(self.grpo.loss_type)
        return torch.stack([tokens if unit is None else torch.full_like(tokens, unit), tokens])

    def micro_loss(
        self, trainable: Any, frozen: Any, mb: GRPOBatch, norm: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        return self.loss(trainable, frozen, mb, norm)

    def stat_means(self, stats: dict[str, Tensor], norm: Tensor, n_micro: int) -> dict[str, Tensor]:
        tokens = stats.pop(TOKENS_STAT).clamp(min=1.0)
        return {name: value / tokens for name, value in stats.items()}  # token sums -> global token means

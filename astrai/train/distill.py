"""Knowledge distillation: what `astrai train` runs when `TrainConfig.distill` is set (a draft model for speculative
decoding, or any smaller student of a bigger teacher).

The loss of one token t with a label (the positions the causal-LM loss trains: `LMBatch.loss_mask`), with student
logits s_t and teacher logits z_t over the same vocabulary, temperature T and weight alpha:

    kl_t   = KL(p_T || q_T) = sum_v p_T(v) (log p_T(v) - log q_T(v)),  p_T = softmax(z_t / T), q_T = softmax(s_t / T)
    ce_t   = -log softmax(s_t)[label_t]                (label smoothing as `TrainConfig.label_smoothing`)
    loss_t = alpha * T^2 * kl_t + (1 - alpha) * ce_t

averaged over the labelled tokens of the global batch (the LM step's token-level normalisation). The direction is
the *forward* KL, teacher || student (Hinton et al. 2015, https://arxiv.org/abs/1503.02531; TRL's GKD
`generalized_jsd_loss` with beta = 0 is the same, tested): it is mass-covering, so the student learns to put
probability wherever the teacher does, which is what a draft model needs (its proposals are accepted with
probability sum_v min(p, q), Leviathan et al. 2023). The T^2 factor is Hinton's: the gradient of the softened KL
scales as 1 / T^2, so multiplying by T^2 keeps the KL term's gradient magnitude independent of T when it is mixed
with the cross-entropy; with T = 1 the loss is the plain KL. The logged `kl` metric is the unscaled KL.

The teacher is a model folder (`DistillConfig.teacher`, loaded as `--model FOLDER` is), frozen: its forward runs
under no_grad inside the step with the same positions and document mask as the student's, and its logits are
computed chunk by chunk of rows beside the student's (`ce_chunk` rows, at most `CHUNK_LOGITS` logits, at a time;
each chunk is recomputed in the backward: no [tokens, vocab] fp32 tensor of the whole batch is kept).
Checked at start (ValueErrors naming the problem): the teacher folder loads, and its vocabulary is the student's
(config vocab_size and, when both have one, the tokenizer's token -> id map). A student built from a named config
takes the teacher's vocab_size (its padded rows too) and, without `--tokenizer`, the teacher's tokenizer, so it is
a valid draft of the teacher.

Not here: NEFTune noise (refused with distill), FSDP and tensor parallelism (refused; data parallelism works),
DPO / GRPO in the same run (refused), top-k or sparse teacher logits, on-policy (student-generated) distillation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from astrai.data.batch import LMBatch, document_ids
from astrai.io.model import Model, load
from astrai.io.tokenizer import Tokenizer
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams, hidden_states
from astrai.nn.linear import LinearParams
from astrai.nn.moe import load_balancing_loss, router_stats
from astrai.nn.norm import rms_norm
from astrai.train.optim import AdamWConfig
from astrai.train.step import StepOptions, TrainStep, full_params, is_packed

CHUNK_LOGITS = 2**26
"""Most logits of one [rows, V] chunk (256 MB in fp32; the step holds a few such tensors per chunk at once)."""


@attrs.frozen(kw_only=True)
class DistillConfig:
    """Knowledge distillation from a teacher model folder (`astrai.train.distill`): KL(teacher || student) on the
    teacher's logits at every trained token, mixed with the usual cross-entropy."""

    teacher: Path
    """The teacher: a model folder (as `--model FOLDER` loads one) with the student's vocabulary; frozen."""
    temperature: float = 1.0
    """T: both distributions are softmax(logits / T); the KL term is scaled by T^2 (Hinton's convention)."""
    alpha: float = 1.0
    """Weight of the KL term; (1 - alpha) weighs the cross-entropy on the labels (1: pure distillation)."""

    def __attrs_post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"distill.temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"distill.alpha must be in [0, 1], got {self.alpha}")


# ---- the loss -------------------------------------------------------------------------------------------------------


def distill_sums(
    student_logits: Tensor,
    teacher_logits: Tensor,
    targets: Tensor,
    loss_mask: Tensor,
    *,
    temperature: float = 1.0,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss sum, KL sum, cross-entropy sum) over the tokens with a label; fp32 scalars.

    Args:
        student_logits: [..., V] the student's logits (grad flows through them).
        teacher_logits: [..., V] the teacher's logits at the same positions (constants).
        targets: [...] int64 label ids (any valid id where `loss_mask` is 0).
        loss_mask: [...] 1 where the position is trained.
        temperature: T (module docstring).
        alpha: weight of T^2 * KL; (1 - alpha) weighs the cross-entropy.
        label_smoothing: the cross-entropy's label smoothing (torch's definition).

    Returns:
        (sum of alpha T^2 kl_t + (1 - alpha) ce_t, sum of kl_t (unscaled), sum of ce_t), each over masked tokens.
    """
    s, z = student_logits.float(), teacher_logits.float()
    s_logp = F.log_softmax(s / temperature, dim=-1)  # [..., V]
    z_logp = F.log_softmax(z / temperature, dim=-1)  # [..., V]
    kl = (z_logp.exp() * (z_logp - s_logp)).sum(-1)  # [...] forward KL(teacher || student)
    # cross-entropy at T = 1 from the logsumexp alone: no second [..., V] log-softmax
    lse = torch.logsumexp(s, dim=-1)  # [...]
    nll = lse - s.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [...]
    ce = nll if not label_smoothing else (1 - label_smoothing) * nll + label_smoothing * (lse - s.mean(-1))
    on = loss_mask > 0
    kl_sum = torch.where(on, kl, 0.0).sum()
    ce_sum = torch.where(on, ce, 0.0).sum()
    return alpha * temperature**2 * kl_sum + (1 - alpha) * ce_sum, kl_sum, ce_sum


def distill_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    targets: Tensor,
    loss_mask: Tensor,
    *,
    temperature: float = 1.0,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The distillation loss averaged over the tokens with a label (module docstring), and its parts.

    Args:
        student_logits, teacher_logits: [..., V] (e.g. [B, T, V]) logits at the same positions.
        targets: [...] int64 label ids; loss_mask: [...] 1 where trained (`LMBatch.targets`, `LMBatch.loss_mask`).
        temperature, alpha, label_smoothing: as `distill_sums`.

    Returns:
        (mean loss, {"kl": mean unscaled KL(teacher || student), "ce": mean cross-entropy}); 0 with no token.
    """
    loss, kl, ce = distill_sums(student_logits, teacher_logits, targets, loss_mask, temperature=temperature,
                                alpha=alpha, label_smoothing=label_smoothing)  # fmt: skip
    count = (loss_mask > 0).sum().clamp(min=1)
    return loss / count, {"kl": kl / count, "ce": ce / count}


# ---- the train step -------------------------------------------------------------------------------------------------


def _head(params: DecoderParams) -> tuple[Tensor, Tensor | None]:
    """(weight [V, E], bias) of the LM head (the embedding when tied)."""
    if params.lm_head is None:
        return params.embed_tokens.weight, None
    return params.lm_head.weight, params.lm_head.bias if isinstance(params.lm_head, LinearParams) else None


def _chunk_sums(
    h: Tensor, weight: Tensor, bias: Tensor | None, t_h: Tensor, t_weight: Tensor, t_bias: Tensor | None,
    targets: Tensor, mask: Tensor, *, dtype: torch.dtype | None, temperature: float, alpha: float,
    label_smoothing: float,
) -> Tensor:  # fmt: skip
    """[3] `distill_sums` of one chunk of rows: h [N, E] and t_h [N, E_t] final-normed hidden rows."""
    with torch.autocast(h.device.type, dtype=dtype, enabled=dtype is not None):
        s = F.linear(h, weight, bias)  # [N, V]
        z = F.linear(t_h, t_weight, t_bias)  # [N, V]
    sums = distill_sums(s, z, targets, mask, temperature=temperature, alpha=alpha, label_smoothing=label_smoothing)
    return torch.stack(sums)


def distill_train_loss(
    trainable: Any,
    frozen: Any,
    teacher: DecoderParams,
    batch: LMBatch,
    norm: Tensor,
    packed: bool,
    *,
    cfg: ModelConfig,
    teacher_cfg: ModelConfig,
    opts: StepOptions,
    temperature: float,
    alpha: float,
    to_params: Callable[[Any, Any], DecoderParams] = full_params,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Distillation loss of one micro-batch: the function `DistillStep` compiles (beside `train_loss`).

    Args:
        trainable, frozen, to_params: the student's trees, as `astrai.train.step.train_loss`.
        teacher: the teacher's parameter tree (no grad).
        batch: one micro-batch of packed rows.
        norm: trained tokens of the whole global batch (the loss is a sum divided by it).
        packed: some row holds several documents (`is_packed`); both models then attend within documents only.
        cfg, teacher_cfg: the student's and the teacher's configs.
        opts: the step's settings (autocast, activation checkpointing, ce_chunk, label smoothing, MoE coef).
        temperature, alpha: `DistillConfig`'s.

    Returns:
        (loss to backpropagate = (loss sum + coef * MoE aux * trained tokens) / norm, detached loss sum, detached
        {"kl": KL sum, "ce": cross-entropy sum} and the student's MoE router statistics).
    """
    params = to_params(frozen, trainable)
    dtype = opts.autocast_dtype
    doc_ids = document_ids(batch.positions) if packed else None
    with torch.autocast(batch.tokens.device.type, dtype=dtype, enabled=dtype is not None):
        with torch.no_grad():
            t_h = hidden_states(teacher, teacher_cfg, batch.tokens, positions=batch.positions, doc_ids=doc_ids)
            t_h = rms_norm(teacher.norm, t_h, eps=teacher_cfg.rms_norm_eps)  # [B, T, E_t]
        h, moe_aux = hidden_states(params, cfg, batch.tokens, positions=batch.positions, doc_ids=doc_ids,
                                   checkpoint_blocks=opts.checkpoint_blocks, return_aux=True)  # fmt: skip
        h = rms_norm(params.norm, h, eps=cfg.rms_norm_eps)  # [B, T, E]
    h, t_h = h.reshape(-1, h.shape[-1]), t_h.reshape(-1, t_h.shape[-1]).detach()  # [B*T, E], [B*T, E_t]
    targets, mask = batch.targets.reshape(-1), batch.loss_mask.reshape(-1)  # [B*T]
    chunk = functools.partial(_chunk_sums, dtype=dtype, temperature=temperature, alpha=alpha,
                              label_smoothing=opts.label_smoothing)  # fmt: skip
    heads = (*_head(params), *_head(teacher))
    sums = torch.zeros(3, device=h.device)
    rows, size = h.shape[0], max(1, min(opts.ce_chunk, CHUNK_LOGITS // heads[0].shape[0]))
    for start in range(0, rows, size):
        part = slice(start, start + size)
        args = (h[part], heads[0], heads[1], t_h[part], heads[2], heads[3], targets[part], mask[part])
        if rows > size:  # recompute each chunk's [rows, V] logits in the backward instead of keeping them
            sums = sums + torch.utils.checkpoint.checkpoint(chunk, *args, use_reentrant=False)
        else:
            sums = sums + chunk(*args)
    task, stats = sums[0], {"kl": sums[1].detach(), "ce": sums[2].detach()}
    loss = task
    if cfg.ffn_type == "moe" and moe_aux is not None:
        stats.update({k: v.detach() for k, v in router_stats(moe_aux).items()})
        if opts.moe_aux_loss_coef:  # token-weighted, as `astrai.train.step.lm_loss`
            loss = loss + opts.moe_aux_loss_coef * load_balancing_loss(moe_aux) * batch.loss_mask.sum()
    return loss / norm, task.detach(), stats


class DistillStep(TrainStep):
    """`TrainStep` with `distill_train_loss`: the same accumulation, data-parallel all-reduce, clipping and optimizer.

    Holds the teacher's tree (frozen, like `astrai.train.dpo.FrozenReference` holds the reference) and passes it to
    the loss as an input. Metrics: `loss` (the mixed loss), `kl` and `ce`, global means over trained tokens.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        opts: StepOptions,
        optim: AdamWConfig,
        distill: DistillConfig,
        *,
        teacher: Model,
        trainable: Any,
        to_params: Callable[[Any, Any], DecoderParams] = full_params,
    ) -> None:
        super().__init__(cfg, opts, optim, trainable=trainable, to_params=to_params)
        self.teacher = teacher.params
        loss = functools.partial(distill_train_loss, cfg=cfg, teacher_cfg=teacher.config, opts=opts,
                                 temperature=distill.temperature, alpha=distill.alpha, to_params=to_params)  # fmt: skip
        self.loss = torch.compile(loss) if opts.compile else loss

    def micro_loss(
        self, trainable: Any, frozen: Any, mb: LMBatch, norm: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        return self.loss(trainable, frozen, self.teacher, mb, norm, is_packed(mb))

    def stat_means(self, stats: dict[str, Tensor], norm: Tensor, n_micro: int) -> dict[str, Tensor]:
        # kl / ce are token sums -> token means; MoE router statistics average over micro-batches, as the LM step
        return {name: value / (norm if name in ("kl", "ce") else n_micro) for name, value in stats.items()}


# ---- the teacher ----------------------------------------------------------------------------------------------------


def load_teacher(distill: DistillConfig, device: torch.device, *, bf16: bool = False) -> Model:
    """The teacher model from `distill.teacher` on `device`, frozen (its leaves never require grad); fp32, or bf16
    for a bf16 run (the teacher then computes in bf16 under autocast as the student does, at half the memory).

    Raises:
        ValueError: the folder is missing or not a loadable model (the message names it and why).
    """
    try:
        model = load(distill.teacher, dtype=torch.bfloat16 if bf16 else torch.float32, device=device)
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError
        raise ValueError(f"distill.teacher {distill.teacher}: cannot load the teacher model ({err}); give a model "
                         "folder such as runs/sft-tiny/model") from None  # fmt: skip
    return model


def draft_config(
    model_cfg: ModelConfig, teacher: Model, tokenizer: Tokenizer | None
) -> tuple[ModelConfig, Tokenizer | None]:
    """A named (random-init) student's config as a draft of `teacher`, and its tokenizer: the teacher's vocab_size
    (padded embedding rows included, so the logits line up id for id), the given tokenizer or else the teacher's,
    and that tokenizer's eos ids (else the teacher's)."""
    tokenizer = tokenizer if tokenizer is not None else teacher.tokenizer
    eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else tuple(teacher.eos_token_ids)
    cfg = attrs.evolve(model_cfg, vocab_size=teacher.config.vocab_size, eos_token_id=eos,
                       bos_token_id=teacher.config.bos_token_id)  # fmt: skip
    return cfg, tokenizer


def check_teacher(teacher: Model, path: Path, student_cfg: ModelConfig, tokenizer: Tokenizer | None) -> None:
    """Refuse a teacher whose vocabulary is not the student's (`path`: the teacher folder, for the message).

    Raises:
        ValueError: the configs' vocab_size differ, the tokenizer has ids past it, or the student's and the
            teacher's tokenizers map some token to different ids.
    """
    ours, theirs = student_cfg.vocab_size, teacher.config.vocab_size
    if ours != theirs:
        raise ValueError(
            f"distill.teacher {path}: its vocab_size is {theirs}, the student's {ours}: distillation compares logits "
            "id by id, so both need the same vocabulary (a student from a named config takes the teacher's; a "
            "--model folder must already have it)"
        )
    if tokenizer is not None and len(tokenizer) > theirs:
        raise ValueError(f"distill.teacher {path}: the tokenizer has {len(tokenizer)} tokens, more than the "
                         f"teacher's vocab_size {theirs}: pass the teacher's (--tokenizer {path})")  # fmt: skip
    if tokenizer is not None and teacher.tokenizer is not None:
        mine = tokenizer.backend.get_vocab(with_added_tokens=True)
        other = teacher.tokenizer.backend.get_vocab(with_added_tokens=True)
        if mine != other:
            differ = sum(other.get(token) != i for token, i in mine.items()) + len(other.keys() - mine.keys())
            raise ValueError(
                f"distill.teacher {path}: the student's tokenizer differs from the teacher's ({differ} tokens have "
                f"another id or are missing): a draft model must share the teacher's tokenizer (--tokenizer {path})"
            )

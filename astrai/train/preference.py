"""Post-training losses as pure functions: sequence log-probs, DPO (sigmoid/cDPO, IPO, hinge) and GRPO.

Everything here is a function of tensors (and, for the log-probs, of a parameter tree and its config): no
trainer, no model copies, no host syncs. The trainers (reference log-probs, rollouts, optimisation loops) build
on these in later increments of issue 12.

Notable features:
- `token_logprobs_of` / `sequence_logprobs`: log p(next token) of a right-padded batch through the chunked LM
  head (`astrai.nn.chunked_loss.token_logprobs`), so no fp32 [tokens, vocab] tensor ever exists, forward or
  backward. Sequence sums run over an explicit loss mask (the completion tokens), never over "token id != 0"
  (the reference system's defect 11b.12: id 0 is a real token in most vocabularies).
- `dpo_loss`: the formulas of TRL's `DPOTrainer._compute_loss` (TRL 1.16) for `sigmoid`, `ipo` and `hinge`, plus
  conservative DPO (cDPO) label smoothing on `sigmoid` as older TRL releases computed it in
  `DPOTrainer.dpo_loss`. Metrics use TRL's names (`rewards/chosen`, ...).
- `group_advantages` and `grpo_loss`: TRL's `GRPOTrainer` advantages and per-token clipped objective with the k3
  KL estimator and TRL's four normalisations (`grpo`, `bnpo`, `dr_grpo`, `dapo`).

Metrics are detached 0-d tensors (no `.item()`, so the functions can sit inside a compiled step); the host loop
converts them.

Not here: TRL's other DPO loss types (robust, exo_pair, apo_*, ...), f-divergences, LD-DPO, WPO weighting; GRPO's
sequence-level importance sampling (GSPO), two-sided `delta` clipping, cispo/sapo/vespo, entropy masks and bonuses.

References: Rafailov et al. 2023 (DPO, arXiv:2305.18290); Mitchell 2023 (cDPO, https://ericmitchell.ai/cdpo.pdf);
Azar et al. 2023 (IPO, arXiv:2310.12036); Shao et al. 2024 (GRPO, arXiv:2402.03300); Liu et al. 2025 (Dr. GRPO,
arXiv:2503.20783); Yu et al. 2025 (DAPO, arXiv:2503.14476); Schulman 2020 (k3 KL, http://joschu.net/blog/kl-approx.html);
TRL (https://github.com/huggingface/trl) `DPOTrainer` and `GRPOTrainer`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.data.batch import document_ids
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams, hidden_states, lm_head_weight
from astrai.nn.chunked_loss import token_logprobs
from astrai.nn.norm import rms_norm

DPOLossType = Literal["sigmoid", "ipo", "hinge"]
GRPOLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]


# ---- log-probs ---------------------------------------------------------------------------------------------------


def token_logprobs_of(
    params: DecoderParams,
    cfg: ModelConfig,
    tokens: Tensor,
    *,
    chunk_size: int = 4096,
    positions: Tensor | None = None,
    checkpoint_blocks: bool = False,
    temperature: float = 1.0,
) -> Tensor:
    """Per-position log p(tokens[:, t + 1] | tokens[:, :t + 1]) under the model, in fp32.

    Same combination as the train step's `lm_loss`: hidden states -> final RMSNorm -> chunked LM head, so at most
    one [chunk_size, V] fp32 block exists at a time (backward recomputes it). Differentiable with respect to
    `params`.

    Args:
        params: decoder parameter tree.
        cfg: its config.
        tokens: [B, T] int64 ids, right-padded (padding after a row's last real token cannot change the earlier
            positions under causal attention; pad with any valid id).
        chunk_size: LM-head rows per block.
        positions: optional [B, T] int64 position ids (e.g. restarting at 0 for left padding or packed rows);
            attention then stays inside each document, as in `lm_loss`. Default: 0..T-1 on every row.
        checkpoint_blocks: recompute each block in backward (activation checkpointing, as the train step).
        temperature: log-probs of softmax(logits / temperature), as TRL's GRPO scores completions sampled at that
            temperature (the hidden states and the head's bias are divided by it: no logits are materialised).

    Returns:
        [B, T] fp32: entry t is the log-prob of the target tokens[:, t + 1] (the `LMBatch.targets` convention);
        the last column has no target and is 0.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
    b, t = tokens.shape
    doc_ids = None if positions is None else document_ids(positions)
    h = hidden_states(
        params,
        cfg,
        tokens[:, :-1],
        positions=_head(positions),
        doc_ids=_head(doc_ids),
        checkpoint_blocks=checkpoint_blocks,
    )
    h = rms_norm(params.norm, h, eps=cfg.rms_norm_eps)  # [B, T - 1, E]
    bias = None if params.lm_head is None else params.lm_head.bias
    weight = lm_head_weight(params)
    if temperature != 1.0:  # (h / tau) W^T + b / tau = logits / tau
        h, bias = h / temperature, None if bias is None else bias / temperature
    logp = token_logprobs(
        h.reshape(-1, h.shape[-1]).to(weight.dtype), weight, tokens[:, 1:].reshape(-1), bias=bias, chunk_size=chunk_size
    )  # [B * (T - 1)]
    return F.pad(logp.view(b, t - 1), (0, 1))  # [B, T]: no target after the last token


def _head(x: Tensor | None) -> Tensor | None:
    """All columns but the last (the inputs whose targets exist)."""
    return None if x is None else x[:, :-1]


def sequence_logprobs(
    params: DecoderParams,
    cfg: ModelConfig,
    tokens: Tensor,
    loss_mask: Tensor,
    *,
    chunk_size: int = 4096,
    positions: Tensor | None = None,
    checkpoint_blocks: bool = False,
) -> Tensor:
    """Per-sequence sum of log p(target) over the loss mask: log pi(completion | prompt) for DPO.

    The mask follows `LMBatch.loss_mask` (what `astrai.data.datasets.collate_pairs` builds): `loss_mask[b, t]`
    weights the target tokens[b, t + 1], so it is 1 on the positions *before* each completion token. Padding and
    the prompt must be 0 there; nothing is inferred from token ids. `loss_mask[:, -1]` has no target and is ignored.

    Args:
        params: decoder parameter tree.
        cfg: its config.
        tokens: [B, T] int64 right-padded prompt + completion ids.
        loss_mask: [B, T] float (or bool) weights of the shifted targets.
        chunk_size: LM-head rows per block.
        positions: optional [B, T] position ids (see `token_logprobs_of`).
        checkpoint_blocks: recompute each block in backward.

    Returns:
        [B] fp32 sums, differentiable with respect to `params`.
    """
    if loss_mask.shape != tokens.shape:
        raise ValueError(f"loss_mask must match tokens {tuple(tokens.shape)}, got {tuple(loss_mask.shape)}")
    logp = token_logprobs_of(
        params, cfg, tokens, chunk_size=chunk_size, positions=positions, checkpoint_blocks=checkpoint_blocks
    )
    mask = loss_mask[:, :-1].to(logp.dtype)  # [B, T - 1]: the last column has no target
    return (logp[:, :-1] * mask).sum(dim=-1)


# ---- DPO ---------------------------------------------------------------------------------------------------------


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO-family loss over a batch of preference pairs, averaged over pairs.

    With the log-ratios c = policy_chosen - ref_chosen, r = policy_rejected - ref_rejected and the margin
    d = c - r (all sums over the completion tokens):

    - `sigmoid` (DPO, cDPO): -(1 - eps) * log sigmoid(beta * d) - eps * log sigmoid(-beta * d). eps = 0 is DPO;
      eps > 0 is conservative DPO (the preference label is flipped with probability eps), as TRL's
      `DPOTrainer.dpo_loss` computed it before TRL 1.0. TRL 1.x dropped eps from "sigmoid" (it keeps it only in
      "robust", "exo_pair" and "aot"), so with eps = 0 this is exactly TRL 1.x's sigmoid loss.
    - `ipo`: (c / n_c - r / n_r - 1 / (2 beta))^2 with n the completion lengths (clamped to >= 1). The
      length normalisation is TRL's (`DPOTrainer._compute_loss`, confirmed with the IPO authors there): the
      paper's log-ratios are per-token averages, which keeps beta comparable across lengths. Pass
      `chosen_lengths`/`rejected_lengths` (the number of completion tokens of each sequence).
    - `hinge` (SLiC): relu(1 - beta * d).

    Rewards (the metrics) are beta * c and beta * r for every loss type, as in TRL.

    Args:
        policy_chosen: [B] policy log pi(chosen | prompt) (differentiable).
        policy_rejected: [B] policy log pi(rejected | prompt).
        ref_chosen: [B] reference log-probs of the chosen responses (treated as constants).
        ref_rejected: [B] reference log-probs of the rejected responses.
        beta: inverse temperature (DPO, hinge) or the IPO regulariser tau.
        loss_type: "sigmoid", "ipo" or "hinge".
        label_smoothing: cDPO's eps in [0, 0.5), `sigmoid` only.
        chosen_lengths: [B] completion token counts of the chosen sides (required for `ipo`).
        rejected_lengths: [B] the same for the rejected sides.

    Returns:
        (loss, metrics): the fp32 scalar mean over pairs, and detached 0-d tensors `rewards/chosen`,
        `rewards/rejected`, `rewards/margins`, `rewards/accuracies` (fraction with chosen reward > rejected),
        `logps/chosen`, `logps/rejected` (TRL's names, batch means).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing applies to loss_type 'sigmoid' only, not {loss_type!r}")
    chosen = policy_chosen.float() - ref_chosen.float().detach()  # [B] log-ratio of the chosen responses
    rejected = policy_rejected.float() - ref_rejected.float().detach()
    margin = chosen - rejected
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    elif loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type 'ipo' needs chosen_lengths and rejected_lengths (completion token counts)")
        per_token = chosen / chosen_lengths.float().clamp(min=1.0) - rejected / rejected_lengths.float().clamp(min=1.0)
        losses = (per_token - 1 / (2 * beta)) ** 2  # IPO paper, Eq. 17 (tau = beta)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected 'sigmoid', 'ipo' or 'hinge'")
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": policy_chosen.detach().float().mean(),
        "logps/rejected": policy_rejected.detach().float().mean(),
    }
    return losses.mean(), metrics


# ---- GRPO --------------------------------------------------------------------------------------------------------


def group_advantages(rewards: Tensor, group_size: int, *, scale_rewards: bool = True, eps: float = 1e-4) -> Tensor:
    """Group-relative advantages: each completion's reward minus its group's mean, optionally over the group's std.

    A = (r - mean_group(r)) / (std_group(r) + eps) with `scale_rewards` (TRL's "group" scaling, Bessel-corrected
    std, eps = 1e-4), else A = r - mean_group(r) (Dr. GRPO: std scaling biases towards too easy/hard prompts). As
    in TRL, NaN rewards (unscorable completions) are left out of their group's mean and std and get advantage 0.

    Args:
        rewards: [B * G] rewards, the G completions of each prompt contiguous (prompt-major).
        group_size: G, completions per prompt (>= 2: one completion has no baseline to compare with).
        scale_rewards: divide by the group std.
        eps: added to the std.

    Returns:
        [B * G] fp32 advantages.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (G = 1 gives every completion advantage 0), got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [B * G] with G={group_size}, got shape {tuple(rewards.shape)}")
    grouped = rewards.float().view(-1, group_size)  # [B, G]
    mean = torch.nanmean(grouped, dim=1, keepdim=True)  # [B, 1]
    advantages = grouped - mean
    if scale_rewards:
        count = (~grouped.isnan()).sum(dim=1, keepdim=True)
        var = torch.nansum(advantages**2, dim=1, keepdim=True) / (count - 1)  # Bessel; NaN when count < 2, as TRL
        advantages = advantages / (var.sqrt() + eps)
    return torch.nan_to_num(advantages.view(-1), nan=0.0)


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    loss_type: GRPOLossType = "dapo",
    max_completion_length: int | None = None,
    num_items_in_batch: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's clipped surrogate with an optional k3 KL penalty, per token, normalised as TRL's `loss_type`.

    Per completion token (TRL `GRPOTrainer._compute_loss`, token-level importance sampling):
        rho = exp(logp - logp_old)
        l = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * kl
        kl = exp(logp_ref - logp) - (logp_ref - logp) - 1        (k3: unbiased, >= 0; only when beta > 0)
    and over the completion mask m:
        grpo:    mean_b [ sum_t l m / max(sum_t m, 1) ]     (per-sequence mean, then batch mean: length-biased)
        bnpo:    sum l m / max(sum m, 1)                    (token mean over this micro-batch)
        dr_grpo: sum l m / (B * max_completion_length)      (a constant normaliser, Dr. GRPO)
        dapo:    sum l m / num_items_in_batch               (token mean over the whole generation batch, DAPO)
    With beta = 0 the reference is never read (no reference forward is needed at all).

    Args:
        logps: [B, T] per-token log-probs of the completions under the policy being trained (differentiable).
        old_logps: [B, T] log-probs recorded when the completions were sampled (the behaviour policy); None uses
            `logps.detach()` (one optimisation step per rollout: rho = 1, as TRL).
        ref_logps: [B, T] reference-model log-probs; required when beta > 0, ignored otherwise.
        advantages: [B] per-completion advantages (`group_advantages`).
        mask: [B, T] completion mask (1 on sampled completion tokens, 0 on padding).
        epsilon_low: lower clip range (rho >= 1 - epsilon_low).
        epsilon_high: upper clip range (rho <= 1 + epsilon_high; DAPO's clip-higher suggests 0.28).
        beta: KL coefficient (TRL's default 0 skips the reference).
        loss_type: the normalisation, see above.
        max_completion_length: the generation budget, required for `dr_grpo`.
        num_items_in_batch: `dapo` only: completion tokens in the whole generation batch (all micro-batches and
            ranks that share one optimiser step, divided by the number of ranks, as TRL); default `mask.sum()`.

    Returns:
        (loss, metrics): the fp32 scalar, and detached masked token means `clip_ratio/low_mean` (rho below the
        range with A < 0), `clip_ratio/high_mean` (above it with A > 0), `clip_ratio/region_mean` (either), and
        `kl` when beta > 0 (TRL's names).
    """
    if logps.dim() != 2 or mask.shape != logps.shape or advantages.shape != logps.shape[:1]:
        got = f"logps {tuple(logps.shape)}, mask {tuple(mask.shape)}, advantages {tuple(advantages.shape)}"
        raise ValueError(f"expected logps and mask [B, T] and advantages [B], got {got}")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (or set beta = 0 to train without a reference)")
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps.detach()
    adv = advantages.to(logps.dtype)[:, None]  # [B, 1]
    ratio = torch.exp(logps - old)  # [B, T]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # [B, T]
    metrics = {}
    if beta > 0:
        delta = ref_logps.detach() - logps  # [B, T] log(pi_ref / pi)
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    total = (per_token * mask).sum()
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = total / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        loss = total / (logps.shape[0] * max_completion_length)
    elif loss_type == "dapo":
        items = (
            mask.sum()
            if num_items_in_batch is None
            else torch.as_tensor(num_items_in_batch, dtype=mask.dtype, device=mask.device)
        )
        loss = total / items.clamp(min=1.0)
    else:
        raise ValueError(f"unknown GRPO loss_type {loss_type!r}; expected 'grpo', 'bnpo', 'dr_grpo' or 'dapo'")
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        metrics["clip_ratio/low_mean"] = _masked_mean(low.to(mask.dtype), mask)
        metrics["clip_ratio/high_mean"] = _masked_mean(high.to(mask.dtype), mask)
        metrics["clip_ratio/region_mean"] = _masked_mean((low | high).to(mask.dtype), mask)
    return loss, metrics


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)

"""`grpo_loss` and `group_advantages` against TRL's GRPO code.

References:
- loss, clip ratios, KL: TRL 1.16.0's real `trl.trainer.grpo_trainer.GRPOTrainer._compute_loss`, called unbound on
  a stub `self` carrying exactly the attributes it reads in TRL 1.16.0 (token-level importance sampling, no
  vLLM, no entropy mask or bonus, one accumulation step) whose `_get_per_token_logps_and_entropies` returns the
  per-token log-probs we choose.
- advantages: the group-normalisation lines of TRL 1.16.0 `GRPOTrainer._generate_and_score_completions`
  (`multi_objective_aggregation="sum_then_normalize"`), transcribed verbatim below because that method also
  generates and scores completions; it uses TRL's own `nanstd`.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from astrai.train.preference import group_advantages, grpo_loss
from tests.helpers import assert_close

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def _trl_grpo(logps, inputs, *, loss_type, beta, epsilon_low, epsilon_high, max_completion_length):
    """(loss, metrics) from TRL 1.16.0's `GRPOTrainer._compute_loss` on a stub trainer."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl is the GRPO reference (dev extra)")
    b, t = logps.shape
    accelerator = SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x)
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros(b, t), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length,
        accelerator=accelerator,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    loss = trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items()}


def _rollout(b: int = 8, t: int = 10, seed: int = 0):
    """Random per-token log-probs (policy drifted from the old policy so that some ratios clip), masks, refs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b, 1), generator=g)
    mask = (torch.arange(t)[None] < lengths).long()  # [B, T] right-padded completions
    old = -torch.rand(b, t, generator=g) * 4
    logps = (old + torch.randn(b, t, generator=g) * 0.3).requires_grad_(True)
    ref = old + torch.randn(b, t, generator=g) * 0.5
    advantages = torch.randn(b, generator=g)
    inputs = {
        "prompt_ids": torch.zeros(b, 3, dtype=torch.int64),
        "prompt_mask": torch.ones(b, 3, dtype=torch.int64),
        "completion_ids": torch.zeros(b, t, dtype=torch.int64),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return logps, inputs


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_equals_trl(loss_type, beta):
    eps_low, eps_high, max_len = 0.2, 0.28, 16
    logps, inputs = _rollout(seed=LOSS_TYPES.index(loss_type))
    want, want_metrics = _trl_grpo(
        logps, inputs, loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high,
        max_completion_length=max_len,
    )  # fmt: skip
    (want_grad,) = torch.autograd.grad(want, logps)
    got, metrics = grpo_loss(
        logps, inputs["old_per_token_logps"], inputs["ref_per_token_logps"] if beta else None,
        inputs["advantages"], inputs["completion_mask"], epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
        loss_type=loss_type, max_completion_length=max_len,
    )  # fmt: skip
    (got_grad,) = torch.autograd.grad(got, logps)
    assert_close(got, want.detach(), atol=1e-6, rtol=1e-6)
    assert_close(got_grad, want_grad, atol=1e-7, rtol=1e-6)
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"] + (["kl"] if beta else [])
    for name in names:
        assert metrics[name].item() == pytest.approx(want_metrics[name], rel=1e-6, abs=1e-7), name
    assert ("kl" in metrics) == bool(beta)
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0  # clipping is exercised
    # negative control: a different clip range is caught
    wrong, _ = grpo_loss(
        logps, inputs["old_per_token_logps"], inputs["ref_per_token_logps"], inputs["advantages"],
        inputs["completion_mask"], epsilon_low=eps_low, epsilon_high=0.2, beta=beta, loss_type=loss_type,
        max_completion_length=max_len,
    )  # fmt: skip
    assert abs(wrong.item() - want.item()) > 1e-5


def test_normalisations_differ_and_dapo_uses_the_global_token_count():
    logps, inputs = _rollout(seed=7)
    args = (logps, inputs["old_per_token_logps"], None, inputs["advantages"], inputs["completion_mask"])
    losses = {lt: grpo_loss(*args, loss_type=lt, max_completion_length=16)[0].item() for lt in LOSS_TYPES}
    assert len({round(losses[lt], 6) for lt in ("grpo", "bnpo", "dr_grpo")}) == 3
    assert losses["dapo"] == pytest.approx(losses["bnpo"], rel=1e-6)  # one micro-batch: the same token count
    n = inputs["completion_mask"].sum()
    half, _ = grpo_loss(*args, loss_type="dapo", num_items_in_batch=2 * n)
    assert half.item() == pytest.approx(losses["dapo"] / 2, rel=1e-6)


class _Poison:
    """Raises on any use: proves the beta = 0 path never reads the reference log-probs."""

    def __getattr__(self, name):
        raise AssertionError(f"ref_logps.{name} was read with beta = 0")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"ref_logps went into {func} with beta = 0")


def test_beta_zero_never_touches_the_reference_and_gradients_flow():
    logps, inputs = _rollout(seed=3)
    loss, metrics = grpo_loss(
        logps, inputs["old_per_token_logps"], _Poison(), inputs["advantages"], inputs["completion_mask"], beta=0.0
    )
    assert "kl" not in metrics
    loss.backward()
    assert logps.grad is not None and torch.isfinite(logps.grad).all()
    mask = inputs["completion_mask"].bool()
    assert (logps.grad[~mask] == 0).all() and (logps.grad[mask] != 0).any()  # padding gets no gradient
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, None, None, inputs["advantages"], inputs["completion_mask"], beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logps, None, None, inputs["advantages"], inputs["completion_mask"], loss_type="dr_grpo")


def test_on_policy_step_is_the_policy_gradient():
    """old_logps=None (one step per rollout): rho = 1, nothing clips, and d loss / d logp = -A m / count."""
    logps, inputs = _rollout(seed=4)
    mask, adv = inputs["completion_mask"].float(), inputs["advantages"]
    loss, metrics = grpo_loss(logps, None, None, adv, mask, loss_type="bnpo")
    (grad,) = torch.autograd.grad(loss, logps)
    assert_close(grad, -adv[:, None] * mask / mask.sum(), atol=1e-7)
    assert metrics["clip_ratio/region_mean"].item() == 0.0


def _trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    nanstd = pytest.importorskip("trl.trainer.utils", reason="trl is the GRPO reference (dev extra)").nanstd
    # Transcribed from TRL 1.16.0 `GRPOTrainer._generate_and_score_completions` (sum_then_normalize branch):
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if num_generations > 1:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:  # doesn't occur during training, but could occur in eval when num_generations_eval=1
        std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_equal_trl(scale):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (6 * 4,), generator=g).float()  # ties and zero-std groups included
    rewards[:4] = 1.0  # a group with std 0: advantages 0
    rewards[5] = float("nan")  # an unscorable completion: left out of its group, advantage 0
    got = group_advantages(rewards, 4, scale_rewards=scale)
    want = _trl_advantages(rewards, 4, "group" if scale else "none")
    assert_close(got, want, atol=1e-6)
    assert (got[:4] == 0).all() and got[5] == 0
    wrong = group_advantages(rewards, 4, scale_rewards=not scale)
    assert (wrong - want).abs().max() > 1e-3
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, 1)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(rewards[:-1], 4)

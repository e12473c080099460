"""Sequence log-probs against transformers, and `dpo_loss` against TRL's own DPO loss code.

References:
- log-probs: a transformers forward (eager, fp32) of each unpadded sequence on the same weights.
- DPO: TRL 1.16.0's real `trl.trainer.dpo_trainer.DPOTrainer._compute_loss`, called unbound on a stub `self` whose
  "model" returns the per-token log-probs we choose (TRL sums them per sequence itself) and with
  `precompute_ref_logps=True` (the reference log-probs come from the batch). The stub carries exactly the
  attributes that function reads in TRL 1.16.0. TRL 1.x no longer applies label smoothing to "sigmoid"; its
  cDPO expression survives verbatim in the "aot" branch, which sorts the policy and reference log-ratios over
  the batch, so that case feeds pre-sorted pairs (sorting is then the identity) and is also checked against the
  pre-1.0 `DPOTrainer.dpo_loss` formula transcribed below.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from astrai.data.datasets import collate_pairs
from astrai.io.model import load
from astrai.models.decoder import forward
from astrai.train.preference import dpo_loss, sequence_logprobs, token_logprobs_of
from astrai.tree import leaves, tree_map
from tests.helpers import assert_close, save_hf, tiny_hf_model

# ---- sequence log-probs ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_and_model(tmp_path_factory):
    hf = tiny_hf_model("llama", seed=3)
    return hf, load(save_hf(hf, tmp_path_factory.mktemp("llama_dpo")))


def _pairs(seed: int = 0):
    """Three preference items of different lengths; token id 0 appears inside prompts and completions."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for prompt_len, chosen_len, rejected_len in [(3, 5, 2), (6, 1, 7), (2, 9, 4)]:
        prompt = torch.randint(0, 256, (prompt_len,), generator=g)
        prompt[0] = 0
        sides = {}
        for side, n in (("chosen", chosen_len), ("rejected", rejected_len)):
            completion = torch.randint(0, 256, (n,), generator=g)
            completion[-1] = 0
            sides[side] = torch.cat([prompt, completion])
            sides[f"{side}_mask"] = torch.cat(
                [torch.zeros(prompt_len, dtype=torch.bool), torch.ones(n, dtype=torch.bool)]
            )
        items.append(sides)
    return items


def _hf_sequence_logprob(hf, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum over completion tokens of log p(token | prefix), from transformers' logits of the unpadded sequence."""
    with torch.no_grad():
        logits = hf(ids[None]).logits[0].float()  # [n, V]
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]  # [n - 1]
    return (logp * mask[1:].float()).sum()


def test_sequence_logprobs_match_transformers_on_padded_pairs(hf_and_model):
    hf, model = hf_and_model
    items = _pairs()
    batch = collate_pairs(items, pad_id=7)  # right-padded, LMBatch loss-mask convention
    got = {}
    for side in ("chosen", "rejected"):
        rows = getattr(batch, side)
        got[side] = sequence_logprobs(model.params, model.config, rows.tokens, rows.loss_mask, chunk_size=5)
        want = torch.stack([_hf_sequence_logprob(hf, it[side], it[f"{side}_mask"]) for it in items])
        assert_close(got[side], want, atol=1e-4, msg=side)
    # the masks really select: scoring every target (prompt and padding too) gives a much lower sum
    rows = batch.chosen
    full = sequence_logprobs(model.params, model.config, rows.tokens, torch.ones_like(rows.loss_mask), chunk_size=5)
    assert (full < got["chosen"] - 1.0).all()


def test_left_padding_with_positions_matches_unpadded(hf_and_model):
    """Left padding: positions restart at the first real token, pads are one-token documents of their own."""
    hf, model = hf_and_model
    item = _pairs(seed=1)[0]
    ids, mask = item["chosen"], item["chosen_mask"]
    pad = 4
    tokens = torch.cat([torch.full((pad,), 9), ids])[None]  # [1, pad + n]
    positions = torch.cat([torch.zeros(pad, dtype=torch.int64), torch.arange(len(ids))])[None]
    loss_mask = torch.cat([torch.zeros(pad), mask[1:].float(), torch.zeros(1)])[None]  # shifted: target t = token t+1
    got = sequence_logprobs(model.params, model.config, tokens, loss_mask, chunk_size=3, positions=positions)
    assert_close(got, _hf_sequence_logprob(hf, ids, mask)[None], atol=1e-4)


def test_sequence_logprobs_gradients_match_dense_head(hf_and_model):
    """Backward through the chunked head equals autograd through full [B, T, V] logits."""
    _, model = hf_and_model
    batch = collate_pairs(_pairs(seed=2), pad_id=1).chosen
    params = tree_map(lambda x: x.detach().clone().requires_grad_(True), model.params)
    got = sequence_logprobs(params, model.config, batch.tokens, batch.loss_mask, chunk_size=4)
    g_chunked = torch.autograd.grad(got.sum(), leaves(params))
    logits = forward(params, model.config, batch.tokens)  # [B, T, V] fp32 (the dense reference)
    dense = torch.log_softmax(logits, dim=-1).gather(2, batch.targets[..., None])[..., 0]
    want = (dense * batch.loss_mask).sum(-1)
    assert_close(got, want, atol=1e-4)
    g_dense = torch.autograd.grad(want.sum(), leaves(params))
    for a, b in zip(g_chunked, g_dense, strict=True):
        assert_close(a, b, atol=1e-4 * max(b.abs().max().item(), 1.0))


def test_token_logprobs_last_column_is_zero(hf_and_model):
    _, model = hf_and_model
    tokens = torch.randint(0, 256, (2, 6))
    out = token_logprobs_of(model.params, model.config, tokens, chunk_size=4)
    assert out.shape == (2, 6) and out.dtype == torch.float32
    assert (out[:, -1] == 0).all() and (out[:, :-1] < 0).all()


# ---- DPO against TRL -----------------------------------------------------------------------------------------


def _trl_dpo(per_token, completion_mask, ref_chosen, ref_rejected, *, beta, loss_type, label_smoothing=0.0):
    """(loss, metrics) from TRL 1.16.0's `DPOTrainer._compute_loss` on a stub trainer and a stub model."""
    trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer", reason="trl is the DPO reference (dev extra)")
    b2, t = completion_mask.shape
    outputs = SimpleNamespace(
        log_probs=per_token,  # [2B, T - 1]; TRL's model returns 0 where labels are -100 (we pre-mask)
        entropy=torch.zeros(b2, t - 1),
        mean_logits=torch.zeros(b2, t - 1),
        is_top1=torch.zeros(b2, t - 1, dtype=torch.bool),
    )
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=accelerator,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(b2, t, dtype=torch.int64),
        "attention_mask": torch.ones(b2, t, dtype=torch.int64),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    loss = trl_dpo.DPOTrainer._compute_loss(stub, lambda **kw: outputs, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items()}


def _random_pairs(b: int = 6, t: int = 12, seed: int = 0):
    """Per-token policy log-probs [2B, T-1] (chosen rows first, masked), completion masks [2B, T], refs [B]."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 5, (2 * b, 1), generator=g)
    length = torch.randint(1, t - 5, (2 * b, 1), generator=g)
    col = torch.arange(t)[None]
    completion_mask = ((col >= prompt) & (col < prompt + length)).long()  # [2B, T], TRL's unshifted mask
    per_token = -torch.rand(2 * b, t - 1, generator=g) * 3 * completion_mask[:, 1:]
    ref = per_token.sum(1) + torch.randn(2 * b, generator=g) * 2
    return per_token.requires_grad_(True), completion_mask, ref[:b], ref[b:]


def _ours(per_token, completion_mask, ref_chosen, ref_rejected, **kw):
    seq = per_token.sum(1)  # the masked per-token sums = what `sequence_logprobs` returns
    lengths = completion_mask.sum(1)
    b = seq.shape[0] // 2
    return dpo_loss(
        seq[:b], seq[b:], ref_chosen, ref_rejected, chosen_lengths=lengths[:b], rejected_lengths=lengths[b:], **kw
    )


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_equals_trl(loss_type, beta):
    per_token, mask, ref_c, ref_r = _random_pairs(seed=int(beta * 10))
    want, want_metrics = _trl_dpo(per_token, mask, ref_c, ref_r, beta=beta, loss_type=loss_type)
    (want_grad,) = torch.autograd.grad(want, per_token)
    got, metrics = _ours(per_token, mask, ref_c, ref_r, beta=beta, loss_type=loss_type)
    (got_grad,) = torch.autograd.grad(got, per_token)
    assert_close(got, want.detach(), atol=1e-6, rtol=1e-6)
    assert_close(got_grad, want_grad, atol=1e-7, rtol=1e-6)
    for name in METRICS:
        assert metrics[name].item() == pytest.approx(want_metrics[name], rel=1e-6, abs=1e-6), name
    assert 0.0 < metrics["rewards/accuracies"].item() < 1.0  # the inputs exercise both outcomes
    # negative control: a wrong beta is caught
    wrong, _ = _ours(per_token, mask, ref_c, ref_r, beta=beta * 1.1, loss_type=loss_type)
    assert abs(wrong.item() - want.item()) > 1e-4


def test_cdpo_label_smoothing_equals_trl():
    eps, beta = 0.2, 0.3
    per_token, mask, _, ref_r = _random_pairs(seed=5)
    seq = per_token.detach().sum(1)
    b = seq.shape[0] // 2
    # reorder pairs by the policy log-ratio and give the reference ascending log-ratios too: TRL's "aot" sorts both
    order = torch.argsort(seq[:b] - seq[b:])
    idx = torch.cat([order, order + b])
    per_token = per_token.detach()[idx].requires_grad_(True)
    mask, ref_r = mask[idx], ref_r[order]
    ref_c = ref_r + torch.sort(torch.randn(b, generator=torch.Generator().manual_seed(9)) * 3).values
    want, _ = _trl_dpo(per_token, mask, ref_c, ref_r, beta=beta, loss_type="aot", label_smoothing=eps)
    got, _ = _ours(per_token, mask, ref_c, ref_r, beta=beta, loss_type="sigmoid", label_smoothing=eps)
    assert_close(got, want.detach(), atol=1e-6, rtol=1e-6)
    # the pre-1.0 formula, transcribed from TRL's `DPOTrainer.dpo_loss` (loss_type == "sigmoid"; Eq. 3 of cDPO):
    #   losses = (-F.logsigmoid(self.beta * logits) * (1 - self.label_smoothing)
    #             - F.logsigmoid(-self.beta * logits) * self.label_smoothing)
    seq = per_token.detach().sum(1)
    logits = (seq[:b] - seq[b:]) - (ref_c - ref_r)
    legacy = (-F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps).mean()
    assert_close(got.detach(), legacy, atol=1e-6, rtol=1e-6)
    plain, _ = _ours(per_token, mask, ref_c, ref_r, beta=beta, loss_type="sigmoid")
    assert abs(plain.item() - got.item()) > 1e-3  # eps changes the loss


def test_dpo_reference_gets_no_gradient_and_bad_options_raise():
    pc, pr = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    rc, rr = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.1)
    loss.backward()
    assert pc.grad is not None and pr.grad is not None and rc.grad is None and rr.grad is None
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="robust")

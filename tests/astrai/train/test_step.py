"""The train step against transformers + torch.optim.AdamW, packing, accumulation and the compiled path."""

import pytest
import torch
import torch.nn.functional as F

from astrai.configs.models import tiny
from astrai.data.batch import LMBatch
from astrai.io.hf import astrai_to_hf_name
from astrai.io.model import load
from astrai.models.decoder import init_params
from astrai.train.optim import AdamWConfig
from astrai.train.step import StepOptions, TrainStep, eval_sums, init_train_state, is_packed, lm_loss
from astrai.tree import named_tensors
from helpers import assert_close, save_hf, tiny_hf_model

OPTIM = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _batch(rows, length, vocab, seed, positions=None):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, length + 1), generator=g)
    mask = (torch.rand(rows, length, generator=g) < 0.7).float()
    mask[:, 0] = 1.0
    pos = torch.arange(length).repeat(rows, 1) if positions is None else positions
    return LMBatch(tokens=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=mask, positions=pos)


def _hf_decay_groups(hf):
    decay, no_decay = [], []
    for name, p in hf.named_parameters():
        (decay if p.dim() >= 2 and not any(k in name for k in ("norm", "bias", "embed")) else no_decay).append(p)
    return [{"params": decay, "weight_decay": OPTIM.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_steps_match_transformers_and_torch_adamw(family, tmp_path):
    hf = tiny_hf_model(family, attention_bias=family == "llama").train()
    params = load(save_hf(hf, tmp_path), dtype=torch.float32).params
    cfg = load(tmp_path).config
    opt = torch.optim.AdamW(_hf_decay_groups(hf), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, foreach=False)
    step = TrainStep(cfg, StepOptions(max_grad_norm=0.5, compile=False), OPTIM, trainable=params)
    state = init_train_state(params, OPTIM)
    hf_params = dict(hf.named_parameters())
    for i in range(3):
        batch = _batch(2, 12, cfg.vocab_size, seed=i)
        # our gradients, straight from the loss, before the step consumes them
        norm = batch.loss_mask.sum()
        loss, _, _ = lm_loss(state.trainable, batch, norm, cfg=cfg, opts=step.opts)
        ours = dict(
            zip(
                named_tensors(state.trainable),
                torch.autograd.grad(loss, list(named_tensors(state.trainable).values())),
                strict=True,
            )
        )
        # transformers + torch.optim
        logits = hf(input_ids=batch.tokens).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1), reduction="none")
        hf_loss = (ce * batch.loss_mask.reshape(-1)).sum() / norm
        opt.zero_grad()
        hf_loss.backward()
        for name, grad in ours.items():
            assert_close(grad, hf_params[astrai_to_hf_name(name)].grad, atol=1e-5, msg=name)
        hf_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 0.5)
        opt.step()
        metrics = step(state, [batch], OPTIM.lr)
        assert abs(metrics["loss"].item() - hf_loss.item()) <= 1e-5
        assert abs(metrics["grad_norm"].item() - hf_norm.item()) <= 1e-5
        # AdamW's first steps are ~lr * sign(g): an element whose gradient is ~eps-sized amplifies 1e-7 noise,
        # so the weights get 2% of one lr-sized update as slack (the gradients above are held to 1e-5)
        for name, value in named_tensors(state.trainable).items():
            assert_close(value, hf_params[astrai_to_hf_name(name)], atol=2e-5, msg=f"step {i}: {name}")


def test_packed_row_loss_equals_separate_documents():
    cfg = tiny(vocab_size=61)
    params = init_params(cfg, seed=1)
    opts = StepOptions(compile=False, ce_chunk=7)
    lengths = (6, 9, 4)
    docs = [_batch(1, n, 61, seed=n) for n in lengths]
    for d in docs:
        d.loss_mask[0, -1] = 0.0  # the last target of a packed document is the next document's token
    packed = LMBatch(
        tokens=torch.cat([d.tokens for d in docs], 1),
        targets=torch.cat([d.targets for d in docs], 1),
        loss_mask=torch.cat([d.loss_mask for d in docs], 1),
        positions=torch.cat([torch.arange(n) for n in lengths])[None],
    )
    one = torch.ones(())
    packed_sum = lm_loss(params, packed, one, cfg=cfg, opts=opts)[1]
    separate = sum(lm_loss(params, d, one, cfg=cfg, opts=opts)[1] for d in docs)
    assert_close(packed_sum, separate, atol=1e-4)
    # the same row read as one long document gives a different loss (so the comparison can fail)
    leaky = LMBatch(packed.tokens, packed.targets, packed.loss_mask, torch.arange(sum(lengths))[None])
    assert abs(lm_loss(params, leaky, one, cfg=cfg, opts=opts)[1] - separate) > 1e-3


def test_eval_sums_add_the_task_losses_and_trained_tokens_of_every_batch():
    cfg = tiny(vocab_size=61)
    params = init_params(cfg, seed=3)
    opts = StepOptions(compile=False)
    batches = [_batch(2, 10, 61, seed=s) for s in (1, 2)]
    total, count = eval_sums(params, None, batches, cfg=cfg, opts=opts)
    one = torch.ones(())
    assert_close(total, sum(lm_loss(params, b, one, cfg=cfg, opts=opts)[1] for b in batches), atol=1e-4)
    assert count.item() == sum(b.loss_mask.sum().item() for b in batches)
    # the forward's tree comes from (frozen, trainable) through to_params, as in the train step
    other = init_params(cfg, seed=4)
    from_frozen, _ = eval_sums(params, other, batches, cfg=cfg, opts=opts, to_params=lambda frozen, _: frozen)
    assert_close(from_frozen, eval_sums(other, None, batches, cfg=cfg, opts=opts)[0], atol=1e-6)
    assert abs(from_frozen - total) > 1e-3


# a large eps makes the update proportional to the gradient for small gradients: with eps 1e-8, AdamW's early
# steps are ~lr * sign(g), and elements with ~zero gradient would turn rounding noise into lr-sized differences
SMOOTH = AdamWConfig(lr=1e-3, eps=1e-3, weight_decay=0.1)


def _run(micro_batches, compile=False, steps=2):
    cfg = tiny(vocab_size=61)
    step = TrainStep(cfg, StepOptions(compile=compile), SMOOTH, trainable=init_params(cfg, seed=2))
    state = init_train_state(init_params(cfg, seed=2), SMOOTH)
    losses = [step(state, micro_batches, SMOOTH.lr)["loss"].item() for _ in range(steps)]
    return losses, named_tensors(state.trainable)


def test_accumulated_micro_batches_equal_one_big_batch():
    a, b = _batch(2, 10, 61, seed=5), _batch(3, 10, 61, seed=6)
    b.loss_mask[:, 5:] = 0.0  # unequal trained-token counts: a mean of per-micro-batch means would differ
    big = LMBatch(*(torch.cat([getattr(a, f), getattr(b, f)]) for f in ("tokens", "targets", "loss_mask", "positions")))
    losses_acc, params_acc = _run([a, b])
    losses_big, params_big = _run([big])
    assert losses_acc == pytest.approx(losses_big, abs=1e-6)
    for name in params_big:
        assert_close(params_acc[name], params_big[name], atol=1e-6, msg=name)


def test_compiled_step_matches_eager():
    batch = _batch(2, 16, 61, seed=9)
    eager_losses, eager = _run([batch], compile=False)
    compiled_losses, compiled = _run([batch], compile=True)
    assert compiled_losses == pytest.approx(eager_losses, abs=1e-5)
    for name in eager:
        assert_close(compiled[name], eager[name], atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_compiled_step_matches_cpu(precision):
    """On a GPU: Triton rotary (with its registered backward), CUDA SDPA with the document mask, the chunked-CE
    custom ops and fused AdamW, compiled, against the eager CPU step."""
    cfg = tiny(vocab_size=61)
    positions = torch.cat([torch.arange(9), torch.arange(7)]).repeat(2, 1)  # two packed documents per row
    batch = _batch(2, 16, 61, seed=11, positions=positions)
    cpu_losses, cpu_params = _run([batch], compile=False, steps=3)
    autocast = torch.bfloat16 if precision == "bf16" else None
    step = TrainStep(cfg, StepOptions(compile=True, autocast_dtype=autocast), SMOOTH,
                     trainable=init_params(cfg, seed=2, device="cuda"))  # fmt: skip
    state = init_train_state(init_params(cfg, seed=2, device="cuda"), SMOOTH)
    cuda_batch = LMBatch(*(getattr(batch, f).cuda() for f in ("tokens", "targets", "loss_mask", "positions")))
    losses = [step(state, [cuda_batch], SMOOTH.lr)["loss"].item() for _ in range(3)]
    tol = 1e-3 if precision == "fp32" else 3e-2
    assert losses == pytest.approx(cpu_losses, abs=tol * 10)
    for name, value in named_tensors(state.trainable).items():
        assert_close(value.cpu(), cpu_params[name], atol=tol, msg=name)


def test_rows_of_one_document_skip_the_mask_with_the_same_loss():
    cfg = tiny(vocab_size=61)
    params = init_params(cfg, seed=4)
    batch = _batch(2, 12, 61, seed=3)
    opts = StepOptions(compile=False)
    one = torch.ones(())
    assert not is_packed(batch)
    masked = lm_loss(params, batch, one, cfg=cfg, opts=opts, packed=True)[1]
    assert_close(lm_loss(params, batch, one, cfg=cfg, opts=opts, packed=False)[1], masked, atol=1e-5)
    batch.positions[1, 5:] = torch.arange(7)
    assert is_packed(batch)

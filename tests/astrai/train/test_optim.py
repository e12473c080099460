"""AdamW over trees vs torch.optim.AdamW (two param groups), state save/load, decay mask and grad clipping."""

from __future__ import annotations

import attrs
import pytest
import torch

from astrai.models.config import ModelConfig
from astrai.models.decoder import init_params
from astrai.train.optim import (
    AdamWConfig,
    adamw_state_dict,
    adamw_update_,
    clip_grad_norm_,
    decay_mask,
    init_adamw,
    load_adamw_state,
)
from astrai.tree import leaves, named_tensors, pytree, tree_map
from helpers import assert_close


def _model_cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        attention_bias=True,
        qk_norm=True,
    )
    return ModelConfig(**{**base, **kw})


def _params(**kw):
    return init_params(_model_cfg(**kw), seed=3)


def test_decay_mask_follows_the_naming_convention():
    names = list(named_tensors(_params()))
    flags = dict(zip(names, decay_mask(_params()), strict=True))
    decayed = {n for n, f in flags.items() if f}
    assert "lm_head.weight" in decayed  # an untied LM head decays like any matrix (nanoGPT / torchtitan)
    assert "blocks.1.attn.q_proj.weight" in decayed and "blocks.0.mlp.down_proj.weight" in decayed
    for name in ("embed_tokens.weight", "norm.weight", "blocks.0.attn_norm.weight", "blocks.0.attn.q_norm.weight"):
        assert not flags[name], name
    assert not any(flags[n] for n in names if n.endswith(".bias"))
    # exactly the >= 2-D leaves other than the embedding
    assert decayed == {n for n, t in named_tensors(_params()).items() if t.dim() >= 2 and n != "embed_tokens.weight"}
    tied = _params(tie_word_embeddings=True)
    assert "lm_head.weight" not in named_tensors(tied)
    assert not dict(zip(named_tensors(tied), decay_mask(tied), strict=True))["embed_tokens.weight"]


def _torch_reference(params, cfg: AdamWConfig, **impl):
    copies = [p.detach().clone().requires_grad_() for p in leaves(params)]
    mask = decay_mask(params)
    groups = [
        {"params": [c for c, d in zip(copies, mask, strict=True) if d], "weight_decay": cfg.weight_decay},
        {"params": [c for c, d in zip(copies, mask, strict=True) if not d], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **impl)
    return copies, opt


@pytest.mark.parametrize("impl", [dict(foreach=True), dict(foreach=False), dict(fused=True)], ids=str)
def test_matches_torch_adamw_bitwise(impl):
    cfg = AdamWConfig(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3, **impl)
    params = _params()
    state = init_adamw(params, cfg)
    copies, opt = _torch_reference(params, cfg, **impl)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        lr = cfg.lr * (step + 1) / 6  # a schedule: lr changes every step
        grads = [torch.randn(p.shape, generator=g) for p in leaves(params)]
        for c, gr in zip(copies, grads, strict=True):
            c.grad = gr.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        adamw_update_(params, grads, state, lr=lr, cfg=cfg)
    ref_state = [opt.state[c] for c in copies]
    for p, c, m, v, s, ref in zip(
        leaves(params),
        copies,
        leaves(state.exp_avg),
        leaves(state.exp_avg_sq),
        leaves(state.step),
        ref_state,
        strict=True,
    ):
        assert torch.equal(p, c.detach())
        assert torch.equal(m, ref["exp_avg"]) and torch.equal(v, ref["exp_avg_sq"])
        assert torch.equal(s, ref["step"]) and s.dtype == ref["step"].dtype and s.device == ref["step"].device


def test_update_takes_grad_tree_and_tensor_lr():
    cfg = AdamWConfig(lr=1e-2)
    params = _params()
    state = init_adamw(params, cfg)
    copies, opt = _torch_reference(params, cfg)
    grads_tree = init_params(_model_cfg(), seed=4)  # a tree with the params' structure, e.g. from torch.func.grad
    for c, gr in zip(copies, leaves(grads_tree), strict=True):
        c.grad = gr.clone()
    opt.step()
    # a tensor lr is accepted: with foreach left to choose, torch's own auto rule picks the per-tensor loop
    adamw_update_(params, grads_tree, state, lr=torch.tensor(1e-2), cfg=cfg)
    for p, c in zip(leaves(params), copies, strict=True):
        assert_close(p, c, atol=1e-7, rtol=1e-6)
    with pytest.raises(ValueError, match="Tensor lr"):
        adamw_update_(params, grads_tree, state, lr=torch.tensor(1e-2), cfg=AdamWConfig(foreach=True))


def test_bf16_params_keep_bf16_state():
    params = init_params(_model_cfg(dtype="bfloat16"), seed=3)
    cfg = AdamWConfig(lr=1e-2, foreach=True)
    state = init_adamw(params, cfg)
    copies, opt = _torch_reference(params, cfg, foreach=True)
    grads = [torch.randn_like(p) for p in leaves(params)]
    for c, gr in zip(copies, grads, strict=True):
        c.grad = gr.clone()
    opt.step()
    adamw_update_(params, grads, state, lr=cfg.lr, cfg=cfg)
    assert all(m.dtype == torch.bfloat16 for m in leaves(state.exp_avg))
    assert all(torch.equal(p, c.detach()) for p, c in zip(leaves(params), copies, strict=True))


def test_state_dict_roundtrip_resumes_identically():
    cfg = AdamWConfig(lr=1e-2)
    params = _params()
    state = init_adamw(params, cfg)
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=g) for p in leaves(params)] for _ in range(4)]
    for gr in grads[:2]:
        adamw_update_(params, gr, state, lr=cfg.lr, cfg=cfg)
    saved = {k: v.clone() for k, v in adamw_state_dict(state).items()}  # what a checkpoint would hold
    snapshot = {k: v.clone() for k, v in saved.items()}
    assert "exp_avg.blocks.0.attn.q_proj.weight" in saved and "step.lm_head.weight" in saved
    assert len(saved) == 3 * len(leaves(params))
    resumed_params = tree_map(torch.clone, params)
    resumed = load_adamw_state(init_adamw(resumed_params, cfg), saved)
    for gr in grads[2:]:
        adamw_update_(params, gr, state, lr=cfg.lr, cfg=cfg)
        adamw_update_(resumed_params, gr, resumed, lr=cfg.lr, cfg=cfg)
    assert all(torch.equal(a, b) for a, b in zip(leaves(params), leaves(resumed_params), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(leaves(state), leaves(resumed), strict=True))
    assert int(leaves(resumed.step)[0]) == 4
    # the loaded state is a copy: updating it never wrote into the tensors it was loaded from
    assert all(torch.equal(saved[k], snapshot[k]) for k in saved)


def test_load_of_mismatched_state_raises():
    cfg = AdamWConfig()
    template = init_adamw(_params(), cfg)
    other = adamw_state_dict(init_adamw(_params(num_hidden_layers=1), cfg))
    with pytest.raises(ValueError, match="missing"):
        load_adamw_state(template, other)
    good = adamw_state_dict(template)
    with pytest.raises(ValueError, match="unexpected"):
        load_adamw_state(template, {**good, "exp_avg.extra": torch.zeros(1)})
    bad = dict(good, **{"exp_avg.norm.weight": torch.zeros(17)})
    with pytest.raises(ValueError, match="exp_avg.norm.weight"):
        load_adamw_state(template, bad)


def test_update_rejects_mismatched_grads():
    params = _params()
    state = init_adamw(params)
    grads = [torch.zeros_like(p) for p in leaves(params)]
    with pytest.raises(ValueError, match="grads has"):
        adamw_update_(params, grads[:-1], state, lr=1e-3, cfg=AdamWConfig())
    grads[0] = torch.zeros(3)
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        adamw_update_(params, grads, state, lr=1e-3, cfg=AdamWConfig())


def test_update_rejects_steps_on_the_wrong_device():
    params = [torch.zeros(2, 2, device="meta")]  # stands in for a CUDA tensor: fused needs on-device steps
    state = init_adamw(params, AdamWConfig(fused=False))  # host-side step counters
    assert leaves(state.step)[0].device.type == "cpu"
    with pytest.raises(ValueError, match="init_adamw"):
        adamw_update_(params, [torch.zeros(2, 2, device="meta")], state, lr=1e-3, cfg=AdamWConfig(fused=True))


@pytree
@attrs.frozen(eq=False)
class _Toy:
    w: torch.Tensor
    ids: torch.Tensor


def test_init_rejects_non_float_leaves():
    with pytest.raises(ValueError, match="'ids'"):
        init_adamw(_Toy(w=torch.zeros(2, 2), ids=torch.zeros(2, dtype=torch.int64)))


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(lr=-1.0), "lr"), (dict(betas=(0.9, 1.0)), "betas"), (dict(weight_decay=-0.1), "weight_decay")],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdamWConfig(**kwargs)


def test_config_defaults():
    cfg = AdamWConfig()
    assert (cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay, cfg.fused) == (3e-4, (0.9, 0.95), 1e-8, 0.1, None)
    assert leaves(init_adamw(_params(), cfg).step)[0].device.type == "cpu"  # torch.optim's placement on CPU


@pytest.mark.parametrize("max_norm", [0.5, 1e6, None, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_grad_norm_matches_torch(max_norm, dtype):
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(s, generator=g) * 3).to(dtype) for s in [(5, 7), (11,), (2, 3, 4)]]
    ref = [torch.nn.Parameter(x.clone().float()) for x in grads]
    for r, x in zip(ref, grads, strict=True):
        r.grad = x.clone().float()
    torch_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm if max_norm else float("inf"))
    norm = clip_grad_norm_(grads, max_norm)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    assert_close(norm, torch_norm, atol=0, rtol=1e-6)
    if max_norm == 0.5:
        fp32_norm = torch.linalg.vector_norm(torch.cat([x.grad.flatten() for x in ref]))
        assert_close(fp32_norm, torch.tensor(0.5), atol=1e-5)  # the reference did clip
    atol = 0 if dtype == torch.float32 else 2e-2
    for x, r in zip(grads, ref, strict=True):
        assert_close(x.float(), r.grad, atol=atol, rtol=atol)


def test_clip_grad_norm_empty_and_tree():
    assert float(clip_grad_norm_([], 1.0)) == 0.0
    tree = _Toy(w=torch.full((1, 1), 3.0), ids=torch.full((1,), 4.0))  # any tree of tensors
    norm = clip_grad_norm_(tree, 1.0)
    assert_close(norm, torch.tensor(5.0), atol=1e-6)
    assert_close(tree.w, torch.full((1, 1), 3.0 / (5.0 + 1e-6)), atol=1e-7)
    assert_close(tree.ids, torch.full((1,), 4.0 / (5.0 + 1e-6)), atol=1e-7)


@pytest.mark.parametrize("foreach, tensor_lr", [(None, True), (True, False)])
def test_compiled_clip_and_update_match_eager(foreach, tensor_lr):
    cfg = AdamWConfig(lr=1e-2, foreach=foreach)
    shapes = [(8, 4), (4,)]  # a small tree keeps inductor's compile time low; one matrix decays, one vector not
    params = [torch.randn(s) for s in shapes]
    eager_params = [p.clone() for p in params]
    state, eager_state = init_adamw(params, cfg), init_adamw(eager_params, cfg)

    def step(params, grads, state, lr):
        norm = clip_grad_norm_(grads, 1.0)
        adamw_update_(params, grads, state, lr=lr, cfg=cfg)
        return norm

    compiled = torch.compile(step)
    for i in range(3):
        grads = [torch.randn_like(p) * 3 for p in params]
        lr = 1e-2 * (i + 1)
        norm = compiled(params, [g.clone() for g in grads], state, torch.tensor(lr) if tensor_lr else lr)
        eager_norm = step(eager_params, [g.clone() for g in grads], eager_state, lr)
        assert_close(norm, eager_norm, atol=0, rtol=1e-6)
    for a, b in zip(params + leaves(state), eager_params + leaves(eager_state), strict=True):
        assert_close(a, b, atol=1e-6, rtol=1e-6)

"""MoE layer: DeepSeek-V3 routing vs transformers' module, grouped dispatch vs a per-token loop, aux statistics by
hand, torch.compile, config validation and HF config round trips."""

import math

import pytest
import torch
import torch.nn.functional as F

from astrai.io.errors import UnsupportedModelError
from astrai.io.hf import config_from_hf, config_to_hf
from astrai.models.config import ModelConfig, check_config
from astrai.nn.linear import LinearParams
from astrai.nn.mlp import MLPParams
from astrai.nn.moe import (
    ExpertsParams,
    MoEConfig,
    MoEParams,
    check_moe_config,
    grouped_experts,
    grouped_experts_backward,
    init_moe,
    load_balancing_loss,
    moe,
    route,
    router_aux,
    router_stats,
)
from helpers import assert_close


def _experts_loop_ref(x, idx, weights, gate_proj, up_proj, down_proj):
    # naive: one token and one slot at a time
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = F.silu(gate_proj[e] @ x[t]) * (up_proj[e] @ x[t])
            out[t] += weights[t, j] * (down_proj[e] @ h)
    return out


def test_grouped_dispatch_matches_per_token_loop():
    g = torch.Generator().manual_seed(0)
    n, d, f, e, k = 23, 8, 12, 6, 3
    x = torch.randn(n, d, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    idx[:, 0] = 2  # a crowded expert; expert 5 may be idle: empty segments must work
    idx[idx == 5] = 4
    idx[:, 1] = torch.where(idx[:, 1] == 2, 1, idx[:, 1])
    idx[:, 2] = torch.where((idx[:, 2] == 2) | (idx[:, 2] == idx[:, 1]), 0, idx[:, 2])
    weights = torch.rand(n, k, generator=g)
    w = [torch.randn(e, f, d, generator=g), torch.randn(e, f, d, generator=g), torch.randn(e, d, f, generator=g)]
    assert_close(grouped_experts(x, idx, weights, *w), _experts_loop_ref(x, idx, weights, *w), atol=1e-4)


def test_hand_written_backward_matches_autograd():
    g = torch.Generator().manual_seed(3)
    n, d, f, e, k = 9, 8, 12, 5, 2
    x = torch.randn(n, d, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(n)])  # expert 4 idle
    weights = torch.rand(n, k, generator=g, requires_grad=True)
    w = [torch.randn(*s, generator=g, requires_grad=True) for s in ((e, f, d), (e, f, d), (e, d, f))]
    grad = torch.randn(n, d, generator=g)
    expected = torch.autograd.grad(grouped_experts(x, idx, weights, *w), [x, weights, *w], grad)
    actual = grouped_experts_backward(grad, x.detach(), idx, weights.detach(), *(t.detach() for t in w))
    for a, b, name in zip(actual, expected, ["x", "weights", "gate_proj", "up_proj", "down_proj"], strict=True):
        assert_close(a, b, atol=1e-4, rtol=1e-5, msg=name)


def _deepseek_pair():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=32,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_shared_experts=2,
    )
    torch.manual_seed(0)
    ref = DeepseekV3MoE(hf_cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
        ref.gate.e_score_correction_bias.normal_(0.0, 0.3)  # large enough to change choices
    gate, up = ref.experts.gate_up_proj.detach().chunk(2, dim=1)
    params = MoEParams(
        gate=LinearParams(weight=ref.gate.weight.detach().clone()),
        experts=ExpertsParams(gate_proj=gate.clone(), up_proj=up.clone(), down_proj=ref.experts.down_proj.detach()),
        e_score_correction_bias=ref.gate.e_score_correction_bias.detach().clone(),
        shared_experts=MLPParams(
            gate_proj=LinearParams(weight=ref.shared_experts.gate_proj.weight.detach()),
            up_proj=LinearParams(weight=ref.shared_experts.up_proj.weight.detach()),
            down_proj=LinearParams(weight=ref.shared_experts.down_proj.weight.detach()),
        ),
    )
    cfg = MoEConfig(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        scoring="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        e_score_correction_bias=True,
        shared_expert_intermediate_size=32,
    )
    return ref, params, cfg


def test_deepseek_v3_routing_matches_transformers_module():
    ref, params, cfg = _deepseek_pair()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        expected = ref(x)
        _, ref_w, ref_idx = ref.gate(x)
    out, aux = moe(params, x, cfg=cfg)
    assert_close(out, expected, atol=1e-5)
    logits = F.linear(x.reshape(-1, 32), params.gate.weight)
    w, idx, probs = route(logits, cfg, params.e_score_correction_bias)
    order, ref_order = idx.sort(-1), ref_idx.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    assert_close(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices), atol=1e-6)
    # chosen experts come from at most topk_group groups of 2
    assert bool(((idx // 2).unsqueeze(-1) == (idx // 2).unsqueeze(-2)).any(-1).all())
    assert (idx // 2).unique(dim=None).numel() >= 2
    assert_close(probs.sum(-1), torch.ones(18), atol=1e-6)
    assert int(aux.layers) == 1


def test_bias_changes_the_choice_but_not_the_weights():
    _, params, cfg = _deepseek_pair()
    logits = torch.randn(5, 8)
    bias = torch.zeros(8)
    bias[7] = 100.0  # expert 7 always chosen; its weight still comes from the unbiased score
    w, idx, _ = route(logits, cfg, bias)
    assert bool((idx == 7).any(-1).all())
    scores = torch.sigmoid(logits).gather(1, idx)
    assert_close(w, 2.5 * scores / scores.sum(-1, keepdim=True), atol=1e-6)


def test_aux_statistics_by_hand():
    # uniform probabilities over 4 experts, every token routed to experts 0 and 1
    n = 10
    idx = torch.tensor([[0, 1]]).repeat(n, 1)
    probs = torch.full((n, 4), 0.25)
    aux = router_aux(idx, probs, 4)
    stats = router_stats(aux)
    assert_close(stats["moe_dead_fraction"], torch.tensor(0.5), atol=1e-7)
    assert_close(stats["moe_load_max"], torch.tensor(2.0), atol=1e-6)
    assert_close(stats["moe_entropy"], torch.tensor(math.log(4)), atol=1e-6)
    # f = (1, 1, 0, 0), P = 1/4 each: loss = 4 * (1/4 + 1/4) = 2; balanced top-2 routing gives k = 2 too
    assert_close(load_balancing_loss(aux), torch.tensor(2.0), atol=1e-6)
    # two layers pool f and P (transformers), stats average
    from astrai.nn.moe import add_aux

    other = router_aux(torch.tensor([[2, 3]]).repeat(n, 1), probs, 4)
    both = add_aux(aux, other)
    assert_close(load_balancing_loss(both), torch.tensor(2.0), atol=1e-6)  # f = 1/2 each, P = 1/4
    assert_close(router_stats(both)["moe_load_max"], torch.tensor(2.0), atol=1e-6)
    assert_close(router_stats(both)["moe_dead_fraction"], torch.tensor(0.5), atol=1e-7)


def _qwen_like(shared: bool = True) -> tuple[MoEParams, MoEConfig]:
    cfg = MoEConfig(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=8 if shared else 0,
        shared_expert_gate=shared,
    )
    return init_moe(16, cfg, std=0.3, generator=torch.Generator().manual_seed(1)), cfg


def test_dense_and_flat_token_layouts_agree():
    params, cfg = _qwen_like()
    x = torch.randn(3, 5, 16)
    dense, _ = moe(params, x, cfg=cfg)
    flat, _ = moe(params, x.reshape(15, 16), cfg=cfg)
    assert dense.shape == x.shape
    assert_close(flat, dense.reshape(15, 16), atol=1e-6)


def test_compiled_forward_and_backward_match_eager():
    params, cfg = _qwen_like()
    x = torch.randn(2, 7, 16)

    def loss_fn(p, x):
        out, aux = moe(p, x, cfg=cfg)
        return (out**2).sum() + load_balancing_loss(aux)

    def grads(fn):
        leaves = [params.gate.weight, params.experts.gate_proj, params.experts.up_proj, params.experts.down_proj]
        for t in leaves:
            t.requires_grad_(True)
            t.grad = None
        xx = x.clone().requires_grad_(True)
        loss = fn(params, xx)
        loss.backward()
        out = [loss.detach(), xx.grad, *(t.grad for t in leaves)]
        for t in leaves:
            t.requires_grad_(False)
        return out

    eager = grads(loss_fn)
    compiled = grads(torch.compile(loss_fn, fullgraph=True))
    for a, b in zip(compiled, eager, strict=True):
        assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="n_group"):
        check_moe_config(MoEConfig(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=4, n_group=4))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        check_moe_config(MoEConfig(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=4))
    with pytest.raises(ValueError, match="scoring"):
        check_moe_config(MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4, scoring="relu"))
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2)
    base |= dict(num_key_value_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="ModelConfig.moe is None"):
        check_config(ModelConfig(ffn_type="moe", **base))


def test_layer_schedule():
    moe_cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4, decoder_sparse_step=2)
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=6, num_attention_heads=2)
    base |= dict(num_key_value_heads=2, head_dim=4, ffn_type="moe")
    cfg = ModelConfig(moe=attrs_evolve(moe_cfg, mlp_only_layers=(3,)), **base)
    assert [cfg.layer_is_moe(i) for i in range(6)] == [False, True, False, False, False, True]
    cfg = ModelConfig(moe=attrs_evolve(moe_cfg, decoder_sparse_step=1, first_k_dense_replace=2), **base)
    assert [cfg.layer_is_moe(i) for i in range(6)] == [False, False, True, True, True, True]
    assert not ModelConfig(moe=moe_cfg, **{**base, "ffn_type": "mlp"}).layer_is_moe(1)


def attrs_evolve(obj, **kw):
    import attrs

    return attrs.evolve(obj, **kw)


def _hf_config(family: str, **extra):
    d = dict(model_type=family, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    d |= dict(num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
    if family == "mixtral":
        return d | {"num_local_experts": 4} | extra
    d |= {"num_experts": 4, "moe_intermediate_size": 16, "mlp_only_layers": [1], "norm_topk_prob": True}
    if family == "qwen2_moe":
        d["shared_expert_intermediate_size"] = 24
    return d | extra


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_hf_config_round_trip(family):
    cfg = config_from_hf(_hf_config(family))
    assert cfg.ffn_type == "moe" and cfg.moe.num_experts == 4
    assert config_from_hf(config_to_hf(cfg)) == cfg
    if family == "mixtral":
        assert cfg.moe.norm_topk_prob and cfg.moe.moe_intermediate_size == 48
    if family == "qwen2_moe":
        assert cfg.moe.shared_expert_gate and cfg.attention_bias and not cfg.attention_out_bias


def test_hf_config_unsupported_options_are_named():
    with pytest.raises(UnsupportedModelError, match="router_jitter_noise"):
        config_from_hf(_hf_config("mixtral", router_jitter_noise=0.1))
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        config_from_hf(_hf_config("qwen3_moe", use_sliding_window=True, sliding_window=8))
    cfg = config_from_hf(_hf_config("qwen3_moe"))
    bad = attrs_evolve(cfg, moe=attrs_evolve(cfg.moe, scoring="sigmoid"))
    with pytest.raises(UnsupportedModelError, match="scoring='sigmoid'"):
        config_to_hf(bad)

"""Fused projections (`astrai.models.fuse`): q/k/v and gate/up as one projection each, for serving.

Reference: the same model's unfused forward. A fused tree must give the same logits to fp32 rounding for every
family (biases, qk-norm, GQA with one KV head, MoE shared experts, MLA left as it is), int8 weights and LoRA
layers (left unfused); a fused tree with its q and k rows swapped must not (negative control). `into=` must
write new values into the served storage, never allocate a second copy, and refuse a tree of another structure.
Engine-level tests (greedy text, update_params, refresh after an in-place step): tests/astrai/inference.
"""

from __future__ import annotations

import pytest
import torch

from astrai.models.decoder import forward, init_params
from astrai.models.fuse import fuse_projections, fused_bytes
from astrai.models.quantize import quantize_params
from astrai.nn.attention import AttentionParams, FusedAttentionParams
from astrai.nn.linear import LinearParams, LoRALinearParams
from astrai.nn.lora import LoRAConfig, apply_lora, init_lora
from astrai.nn.mla import MLAParams
from astrai.nn.mlp import FusedMLPParams, MLPParams
from astrai.nn.moe import MoEParams
from astrai.tree import leaves, replace, tree_map
from tests.astrai.models.tp_worker import configs

FAMILIES = ["llama", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3"]


def _close(got, ref, rel=1e-5):
    return (got - ref).abs().max().item() <= rel * max(1.0, ref.abs().max().item())


def _tokens(cfg, seed=0):
    return torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_tree_gives_the_unfused_logits(family):
    cfg = configs()[family]
    params = init_params(cfg, seed=1)
    fused = fuse_projections(params)
    tokens = _tokens(cfg)
    assert _close(forward(fused, cfg, tokens), forward(params, cfg, tokens))
    for block, was in zip(fused.blocks, params.blocks, strict=True):
        if isinstance(was.attn, MLAParams):
            assert block.attn is was.attn  # MLA is left as it is
        else:
            assert isinstance(block.attn, FusedAttentionParams)
            assert block.attn.o_proj.weight is was.attn.o_proj.weight  # the unfused leaves are shared, not copied
        ffn = block.mlp.shared_experts if isinstance(block.mlp, MoEParams) else block.mlp
        if ffn is not None:
            assert isinstance(ffn, FusedMLPParams)
        if isinstance(block.mlp, MoEParams):
            assert block.mlp.experts is was.mlp.experts  # routed experts are one grouped GEMM already
    assert fused_bytes(params) == sum(
        t.numel() * t.element_size() for t in leaves(fused) if not any(t is u for u in leaves(params))
    )


def test_swapped_rows_change_the_logits():
    """Negative control: a fused projection in another row order (k, q, v) is a different model."""
    cfg = configs()["qwen3"]
    params = init_params(cfg, seed=2)
    fused = fuse_projections(params)
    a = params.blocks[0].attn
    swapped = replace(
        fused.blocks[0].attn,
        qkv_proj=LinearParams(weight=torch.cat([a.k_proj.weight, a.q_proj.weight, a.v_proj.weight])),
    )
    wrong = replace(fused, blocks=(replace(fused.blocks[0], attn=swapped), *fused.blocks[1:]))
    tokens = _tokens(cfg)
    assert not _close(forward(wrong, cfg, tokens), forward(params, cfg, tokens), rel=1e-3)


def test_int8_weights_fuse_with_their_scales():
    cfg = configs()["llama"]
    q = quantize_params(init_params(cfg, seed=3))
    fused = fuse_projections(q)
    qkv = fused.blocks[0].attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.scale is not None and qkv.bias is not None
    tokens = _tokens(cfg)
    assert _close(forward(fused, cfg, tokens), forward(q, cfg, tokens))


def test_layers_with_an_adapter_stay_unfused():
    cfg = configs()["qwen3"]
    base = init_params(cfg, seed=4)
    lora = init_lora(base, LoRAConfig(r=2, targets=("q_proj", "up_proj")), seed=0)
    lora = tree_map(lambda t: t + 0.05, lora)  # B starts at zero: make the update real
    params = apply_lora(base, lora)
    fused = fuse_projections(params)
    for block in fused.blocks:
        assert isinstance(block.attn, AttentionParams) and isinstance(block.attn.q_proj, LoRALinearParams)
        assert isinstance(block.mlp, MLPParams) and isinstance(block.mlp.up_proj, LoRALinearParams)
    tokens = _tokens(cfg)
    assert _close(forward(fused, cfg, tokens), forward(params, cfg, tokens))
    assert fused_bytes(params) == 0


def test_missing_biases_are_zero_rows():
    cfg = configs()["qwen3"]
    params = init_params(cfg, seed=5)
    attn = params.blocks[0].attn
    biased = replace(attn, k_proj=replace(attn.k_proj, bias=torch.randn(attn.k_proj.weight.shape[0])))
    params = replace(params, blocks=(replace(params.blocks[0], attn=biased), *params.blocks[1:]))
    fused = fuse_projections(params)
    bias = fused.blocks[0].attn.qkv_proj.bias
    q_rows, k_rows = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    assert torch.equal(bias[:q_rows], torch.zeros(q_rows)) and torch.equal(
        bias[q_rows : q_rows + k_rows], biased.k_proj.bias
    )
    tokens = _tokens(cfg)
    assert _close(forward(fused, cfg, tokens), forward(params, cfg, tokens))


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_into_writes_new_values_into_the_served_storage(family):
    cfg = configs()[family]
    params = init_params(cfg, seed=6)
    served = fuse_projections(params)
    pointers = [t.data_ptr() for t in leaves(served)]
    tokens = _tokens(cfg)
    with torch.no_grad():  # an optimizer step, in place on the checkpoint-layout tensors
        for t in leaves(params):
            t.add_(torch.randn_like(t) * 0.05)
    # negative control: the fused copy does not follow in-place changes by itself (only the shared leaves do)
    assert not _close(forward(served, cfg, tokens), forward(params, cfg, tokens), rel=1e-3)
    again = fuse_projections(params, into=served)
    assert [t.data_ptr() for t in leaves(again)] == pointers  # the same storage: no second copy
    assert _close(forward(served, cfg, tokens), forward(params, cfg, tokens))
    # new tensors altogether (update_params(tree)): the fused storage is reused, the other leaves are the new ones
    other = init_params(cfg, seed=7)
    swapped = fuse_projections(other, into=served)
    assert swapped.blocks[0].attn.qkv_proj.weight.data_ptr() == served.blocks[0].attn.qkv_proj.weight.data_ptr()
    assert swapped.blocks[0].attn.o_proj.weight is other.blocks[0].attn.o_proj.weight
    assert _close(forward(swapped, cfg, tokens), forward(other, cfg, tokens))


def test_into_refuses_another_structure():
    cfg = configs()["qwen3"]
    params = init_params(cfg, seed=8)
    served = fuse_projections(params)
    with pytest.raises(ValueError, match="blocks"):
        fuse_projections(replace(params, blocks=params.blocks[:1]), into=served)
    lora = apply_lora(params, init_lora(params, LoRAConfig(r=2, targets=("q_proj",)), seed=0))
    with pytest.raises(ValueError, match="does not match"):
        fuse_projections(lora, into=served)  # an adapter where the served tree has a fused projection
    mla = init_params(configs()["deepseek_v3"], seed=8)
    assert len(mla.blocks) == len(params.blocks)
    with pytest.raises(ValueError, match="into has a FusedAttentionParams where params has a MLAParams"):
        fuse_projections(mla, into=served)


def test_trainer_tensors_give_a_copy_outside_autograd():
    """RL serves the trainer's tensors (requires_grad): the fused copy holds no graph and takes in-place updates."""
    cfg = configs()["qwen3"]
    params = tree_map(lambda t: t.requires_grad_(True), init_params(cfg, seed=9))
    served = fuse_projections(params)
    qkv = served.blocks[0].attn.qkv_proj.weight
    assert not qkv.requires_grad and qkv.grad_fn is None
    with torch.no_grad():
        params.blocks[0].attn.q_proj.weight.mul_(2.0)  # an optimizer step
    fuse_projections(params, into=served)
    rows = params.blocks[0].attn.q_proj.weight.shape[0]
    assert torch.equal(qkv[:rows], params.blocks[0].attn.q_proj.weight.detach())


def test_a_copy_made_under_inference_mode_takes_later_refreshes():
    cfg = configs()["llama"]
    params = init_params(cfg, seed=10)
    with torch.inference_mode():  # e.g. an engine built inside a caller's inference_mode block
        served = fuse_projections(params)
    assert not served.blocks[0].attn.qkv_proj.weight.is_inference()
    fuse_projections(params, into=served)  # outside it: an in-place copy into the served tensors
    tokens = _tokens(cfg)
    assert _close(forward(served, cfg, tokens), forward(params, cfg, tokens))

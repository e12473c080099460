"""Backend dispatch: a tiny model's greedy generation is the same through the Triton kernels as through torch."""

import pytest

import astrai
from astrai.inference.generate import generate_ids
from astrai.ops.backend import attn_backend
from helpers import DEVICE, save_hf, tiny_hf_model


def test_greedy_generation_triton_equals_torch(tmp_path, monkeypatch):
    # On CPU Triton runs under TRITON_INTERPRET=1 (set by conftest), so keep it small: 2 layers, 3 prompts.
    # On a GPU the same test runs the compiled kernels.
    model = astrai.load(save_hf(tiny_hf_model("qwen3", head_dim=16, num_hidden_layers=2), tmp_path), device=DEVICE)
    prompts = [[3, 4, 5, 6, 7], [9] * 11, [100, 101]]
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "torch")
    reference = generate_ids(model, prompts, max_tokens=6, stop_token_ids=[])
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "triton")
    assert generate_ids(model, prompts, max_tokens=6, stop_token_ids=[]) == reference


def test_backend_selection(monkeypatch):
    import torch

    x = torch.zeros(1)
    monkeypatch.delenv("ASTRAI_ATTN_BACKEND", raising=False)
    assert attn_backend(x) == "torch"
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "triton")
    assert attn_backend(x) == "triton"
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "cuda_ref")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        attn_backend(x)
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "fast")
    with pytest.raises(ValueError, match="must be one of"):
        attn_backend(x)


def test_moe_generation_through_the_fused_experts_equals_torch(tmp_path, monkeypatch):
    # on the triton backend MoE layers run the sync-free fused experts (what lets a CUDA graph capture them)
    from astrai.nn import moe

    hf = tiny_hf_model("qwen3_moe", head_dim=16, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16)  # fmt: skip
    model = astrai.load(save_hf(hf, tmp_path), device=DEVICE)
    prompts = [[3, 4, 5, 6, 7], [9] * 11]
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "torch")
    reference = generate_ids(model, prompts, max_tokens=5, stop_token_ids=[])
    calls = []
    fused = moe.fused_experts
    monkeypatch.setattr(moe, "fused_experts", lambda *a: calls.append(a[0].shape[0]) or fused(*a))
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "triton")
    assert generate_ids(model, prompts, max_tokens=5, stop_token_ids=[]) == reference
    assert len(calls) >= 2 * 5 and 2 in calls  # both layers, prefill and decode steps (2 rows)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fused_layout_through_the_triton_kernels_equals_torch(tmp_path, monkeypatch, family):
    """The CUDA serving path on CPU: fused q/k/v and gate/up (strided q/k/v views) into the fused rotary + KV-store
    kernel, which must run once per layer and step, against the torch backend on the checkpoint layout. qwen3's
    q/k RMSNorm runs inside that kernel: it must be handed the gains (and qwen2 none)."""
    from astrai.inference.engine import Engine, EngineConfig
    from astrai.inference.params import SamplingParams
    from astrai.triton_kernels import rotary_kv_store

    model = astrai.load(save_hf(tiny_hf_model(family, head_dim=16, num_hidden_layers=2), tmp_path), device=DEVICE)
    prompts = [[3, 4, 5, 6, 7], [9] * 11, [100, 101]]
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "torch")
    reference = generate_ids(model, prompts, max_tokens=6, stop_token_ids=[])
    calls, normed = [], []
    kernel = rotary_kv_store.rotary_kv_store_

    def spy(*args):
        calls.append(args[0].shape[0])
        normed.append(args[9] is not None and args[10] is not None)  # q_norm, k_norm
        return kernel(*args)

    monkeypatch.setattr(rotary_kv_store, "rotary_kv_store_", spy)
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "triton")
    cfg = EngineConfig(fuse_projections=True, compile=False, cuda_graphs=False, background=False)
    with Engine(model, cfg) as engine:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        got = [list(c.outputs[0].token_ids) for c in engine.generate(prompts, params)]
    assert got == reference
    assert len(calls) >= 2 * 6 and 3 in calls  # both layers, every step (3 decoding rows)
    assert all(normed) if family == "qwen3" else not any(normed)

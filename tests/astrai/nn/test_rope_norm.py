"""RoPE tables and RMSNorm against transformers' own modules, component by component.

The model parity tests (tests/astrai/models/test_decoder.py) compare logits of tiny random models, whose attention
is nearly uniform: there a rotary schedule changes the logits by ~1e-3 of their scale at most, so a wrong NTK
exponent or a norm that ignores `rms_norm_eps` stays inside the 1e-4 tolerance (both mutations were tried and
stayed green). Here the reference is transformers' `LlamaRotaryEmbedding` (its cos/sin for the config's rope
type, the dynamic schedule's growth included) and `LlamaRMSNorm`, on inputs where the compared quantity is the
whole signal: cos/sin at positions far past the trained context, and activations small enough that eps matters.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from astrai.io.hf import config_from_hf
from astrai.nn.norm import RMSNormParams, rms_norm
from astrai.nn.rope import rope_cos_sin
from helpers import assert_close

HEAD_DIM = 64  # 32 frequencies: llama3's and yarn's bands each hold several
ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },  # fmt: skip
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
    },  # fmt: skip
}


def _hf_config(rope_scaling, *, max_pos=128, theta=500000.0):
    return LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                       num_hidden_layers=1, vocab_size=32, max_position_embeddings=max_pos, rope_theta=theta,
                       rope_scaling=rope_scaling)  # fmt: skip


@pytest.mark.parametrize("kind", ROPES)
@pytest.mark.parametrize("longest", [100, 1000], ids=["within", "past_context"])
def test_cos_sin_equal_transformers_rotary_embedding(kind, longest):
    hf_cfg = _hf_config(ROPES[kind])
    cfg = config_from_hf(hf_cfg.to_dict())
    positions = torch.cat([torch.arange(0, longest, 7), torch.tensor([longest - 1])])
    cos, sin = rope_cos_sin(positions, rope=cfg.rope, head_dim=cfg.head_dim,
                            max_position_embeddings=cfg.max_position_embeddings)  # fmt: skip
    rotary = LlamaRotaryEmbedding(hf_cfg)
    hf_cos, hf_sin = rotary(torch.zeros(1, 1, dtype=torch.float32), positions[None])  # HF: [1, N, D], halves repeated
    assert_close(hf_cos[0, :, HEAD_DIM // 2 :], hf_cos[0, :, : HEAD_DIM // 2], atol=0)
    # positions up to 1000 in float32: angles ~1e3 rad, so cos/sin agree to ~1e-4 whatever the order of operations
    assert_close(cos, hf_cos[0, :, : HEAD_DIM // 2], atol=2e-4, msg=f"{kind} cos")
    assert_close(sin, hf_sin[0, :, : HEAD_DIM // 2], atol=2e-4, msg=f"{kind} sin")


def test_the_schedules_differ_where_compared():
    """Negative control: past the context every rope type's table differs from the default one by far more than
    the tolerance, so the comparison above discriminates between schedules."""
    positions = torch.arange(0, 1000, 7)
    tables = {}
    for kind, scaling in ROPES.items():
        cfg = config_from_hf(_hf_config(scaling).to_dict())
        tables[kind] = rope_cos_sin(positions, rope=cfg.rope, head_dim=HEAD_DIM, max_position_embeddings=128)[0]
    for kind, table in tables.items():
        if kind != "default":
            assert (table - tables["default"]).abs().max() > 0.1, kind


@pytest.mark.parametrize("eps", [1e-6, 0.05, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_transformers(eps, dtype):
    """Activations with mean square ~1e-2, so eps = 0.05 or 1 changes the output by tens of percent."""
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 48) * 0.1).to(dtype)
    weight = torch.randn(48).to(dtype)
    hf = LlamaRMSNorm(48, eps=eps).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        expected = hf(x)
    out = rms_norm(RMSNormParams(weight=weight), x, eps=eps)
    assert out.dtype == expected.dtype
    assert_close(out, expected, atol=0 if dtype == torch.float32 else 1e-2, rtol=1e-6)
    if eps >= 0.05:  # negative control: another eps gives a visibly different output
        assert (rms_norm(RMSNormParams(weight=weight), x, eps=1e-6).float() - expected.float()).abs().max() > 0.05

"""config.json <-> ModelConfig: transformers' configs round-trip and unsupported options are named."""

import pytest
import transformers

from astrai.io.errors import UnsupportedModelError
from astrai.io.hf import astrai_to_hf_name, config_from_hf, config_to_hf, hf_to_astrai_name
from helpers import TINY


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (
            transformers.LlamaConfig,
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        (transformers.MistralConfig, {"sliding_window": 32}),
        (transformers.Qwen2Config, {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
        (
            transformers.Qwen3Config,
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
        ),
    ],
)
def test_roundtrip_through_transformers_config(cls, kw):
    cfg = config_from_hf(cls(**TINY, **kw).to_dict())
    again = config_from_hf(cls(**config_to_hf(cfg)).to_dict())
    assert again == cfg


def test_family_quirks():
    qwen2 = config_from_hf(transformers.Qwen2Config(**TINY).to_dict())
    assert qwen2.attention_bias and not qwen2.attention_out_bias and not qwen2.qk_norm
    qwen3 = config_from_hf(transformers.Qwen3Config(**TINY, attention_bias=True).to_dict())
    assert qwen3.qk_norm and qwen3.attention_bias and qwen3.attention_out_bias
    windowed = config_from_hf(
        transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=1).to_dict()
    )
    assert [windowed.layer_window(i) for i in range(2)] == [0, 16]
    v4_style = {
        **transformers.LlamaConfig(**TINY).to_dict(),
        "rope_parameters": None,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    cfg = config_from_hf(v4_style)
    assert cfg.rope.theta == 5e5 and cfg.rope.rope_type == "linear" and cfg.rope.factor == 2.0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"model_type": "bert"}, "model_type 'bert' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}}, "'longrope'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "wobble": 1}}, "wobble"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, r"quantization_config: gptq.*quantize='int8'"),
    ],
)
def test_unsupported_settings_are_named(edit, message):
    d = {**transformers.LlamaConfig(**TINY).to_dict(), **edit}
    if "rope_scaling" in edit:
        d["rope_parameters"] = None
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf(d)


def test_weight_names_map_both_ways():
    for hf_name in [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.12.self_attn.k_norm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.3.post_attention_layernorm.weight",
        "model.layers.3.mlp.down_proj.weight",
    ]:
        assert astrai_to_hf_name(hf_to_astrai_name(hf_name)) == hf_name
    assert hf_to_astrai_name("model.layers.0.input_layernorm.weight") == "blocks.0.attn_norm.weight"
    assert hf_to_astrai_name("model.vision_tower.x") is None

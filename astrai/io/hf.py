"""Hugging Face interop: `config.json` <-> `ModelConfig` and HF tensor names <-> astrai tree names.

Supported `model_type`s: llama, mistral, qwen2, qwen3, the MoE families qwen2_moe, qwen3_moe, mixtral, and
deepseek_v3 / deepseek_v2 (MLA + DeepSeek MoE; their config fields live in `astrai.io.hf_deepseek`).
Family quirks handled here so the decoder stays
family-agnostic: qwen2 always has q/k/v bias and no o_proj bias; llama/qwen3 `attention_bias` covers q/k/v/o;
qwen3 has qk-norm; mistral slides every layer; qwen2/qwen3 slide layers >= `max_window_layers` when
`use_sliding_window`. Both the transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`)
spellings of RoPE settings are read; both are written. MoE experts are stored stacked ([E, F, D]) in astrai and
per expert in HF files (`mlp.experts.j.gate_proj.weight`, mixtral `block_sparse_moe.experts.j.w1.weight`):
`expert_hf_names` lists the per-expert names that `io/checkpoint.py` stacks on load and splits on save.

Unsupported settings raise `UnsupportedModelError` naming the field instead of being silently ignored; invalid
values (`rms_norm_eps: NaN`, `hidden_size: "32"`, an eos id outside the vocabulary) raise ValueError naming the key
(`astrai.io.hf_checks`, then `astrai.models.config.check_config`).
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import cattrs

from astrai.io.errors import UnsupportedModelError
from astrai.io.hf_checks import check_hf_fields
from astrai.io.hf_deepseek import DEEPSEEK_FAMILIES, deepseek_from_hf, deepseek_to_hf
from astrai.models.config import DTYPES, ModelConfig, MoEConfig, check_config
from astrai.nn.rope import ROPE_TYPES, RopeConfig

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
# transformers' defaults for keys a config.json may omit.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768},
    "qwen2_moe": {"max_position_embeddings": 32768, "num_experts": 60, "num_experts_per_tok": 4}
    | {"moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_experts": 128, "num_experts_per_tok": 8}
    | {"moe_intermediate_size": 768},
    "mixtral": {"max_position_embeddings": 4096 * 32, "num_local_experts": 8, "num_experts_per_tok": 2},
    "deepseek_v2": {"max_position_embeddings": 2048},
    "deepseek_v3": {"max_position_embeddings": 4096},
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_converter = cattrs.Converter(forbid_extra_keys=True)


def _strict_int(value: Any, _: type) -> int:
    # cattrs' default int hook calls int(value): "32" would become 32 and 4.7 would become 4
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _strict_float(value: Any, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _strict_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


_converter.register_structure_hook(int, _strict_int)
_converter.register_structure_hook(float, _strict_float)
_converter.register_structure_hook(bool, _strict_bool)  # bool subclasses int: it would get the int hook


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = _or(_or(params.pop("rope_theta", None), d.get("rope_theta")), 10000.0)
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported (only full rotary)")
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    for key in ("beta_fast", "beta_slow"):  # HF treats None as the default
        if params.get(key) is None:
            params.pop(key, None)
    known = {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast"}
    known |= {"beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}
    unknown = set(params) - known
    if unknown:
        raise UnsupportedModelError(f"rope_scaling keys {sorted(unknown)} are not supported for {rope_type!r}")
    if params.get("factor") is None:
        params.pop("factor", None)
    return _converter.structure({"rope_type": rope_type, "theta": float(theta), **params}, RopeConfig)


def _layer_types(d: dict[str, Any], family: str, window: int | None) -> tuple[str, ...] | None:
    if window is None:
        return None
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    if family in ("qwen2", "qwen3"):
        first = _or(d.get("max_window_layers"), 28)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(d["num_hidden_layers"]))
    return None


def _window(d: dict[str, Any], family: str) -> int | None:
    if family == "mistral":
        return d.get("sliding_window", _FAMILY_DEFAULTS["mistral"]["sliding_window"])
    if family == "mixtral":
        return d.get("sliding_window")
    if family in ("qwen2_moe", "qwen3_moe") and d.get("use_sliding_window"):
        raise UnsupportedModelError(f"use_sliding_window is not supported for {family}")
    if family in ("qwen2", "qwen3") and d.get("use_sliding_window"):
        return d.get("sliding_window", 4096)
    return None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (value,)


def _or(value: Any, default: Any) -> Any:
    """`value` unless it is None (transformers' `x if x is not None else default`; `x or default` would turn an
    invalid 0 into the default instead of reporting it)."""
    return default if value is None else value


def config_from_hf(d: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Convert a transformers `config.json` dict to a `ModelConfig`.

    Raises:
        UnsupportedModelError: unknown `model_type` or an option astrai does not implement (named).
        ValueError: a missing, ill-typed or out-of-range field (named, with `source`): `astrai.io.hf_checks`
            for the keys on their own, `check_config` for the converted whole (e.g. eos ids within the vocabulary).
    """
    family = d.get("model_type")
    if family not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: model_type {family!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    missing = [key for key in _REQUIRED if d.get(key) is None]
    if missing:
        raise ValueError(f"{source}: missing required field(s) {missing}")
    check_hf_fields(d, source)
    act = d.get("hidden_act", d.get("hidden_activation", "silu"))
    if act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    if d.get("pretraining_tp", 1) not in (1, None):
        raise UnsupportedModelError(f"{source}: pretraining_tp={d['pretraining_tp']} is not supported")
    quant = d.get("quantization_config")
    if quant:  # GPTQ/AWQ/fp8/bitsandbytes weights have other tensor names and layouts than a float checkpoint
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UnsupportedModelError(f"{source}: pre-quantized checkpoints (quantization_config: {method}) are "
                                    "not supported: load a float one, with quantize='int8' to quantize it")  # fmt: skip
    try:
        rope = _rope_from_hf(d)
    except (cattrs.BaseValidationError, TypeError, ValueError) as err:
        raise UnsupportedModelError(f"{source}: rope settings: {_describe(err)}") from None
    window = None if family in DEEPSEEK_FAMILIES else _window(d, family)
    bias = bool(d.get("qkv_bias", True) if family == "qwen2_moe" else d.get("attention_bias", False))
    moe = _moe_from_hf(d, family, source)
    flat = {
        "model_type": family,
        "vocab_size": d["vocab_size"],
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_hidden_layers": d["num_hidden_layers"],
        "num_attention_heads": d["num_attention_heads"],
        "num_key_value_heads": _or(d.get("num_key_value_heads"), d["num_attention_heads"]),
        "head_dim": _or(d.get("head_dim"), d["hidden_size"] // d["num_attention_heads"]),
        "max_position_embeddings": _or(
            d.get("max_position_embeddings"), _FAMILY_DEFAULTS[family]["max_position_embeddings"]
        ),
        "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
        "attention_bias": True if family == "qwen2" else bias,
        "attention_out_bias": False if family in ("qwen2", "mistral", "qwen2_moe", "mixtral") else bias,
        "mlp_bias": bool(d.get("mlp_bias", False)) if family == "llama" else False,
        "qk_norm": family in ("qwen3", "qwen3_moe"),
        "ffn_type": "mlp" if moe is None else "moe",
        "moe": None if moe is None else _converter.unstructure(moe),
        "sliding_window": window,
        "layer_types": _layer_types(d, family, window),
        "dtype": _dtype_name(d.get("dtype") or d.get("torch_dtype") or "float32", source),
        "initializer_range": d.get("initializer_range", 0.02),
        "bos_token_id": d.get("bos_token_id"),
        "eos_token_id": _ids(d.get("eos_token_id")),
        "pad_token_id": d.get("pad_token_id"),
        "rope": _converter.unstructure(rope),
    }
    if family in DEEPSEEK_FAMILIES:
        fields, interleaved = deepseek_from_hf(d, family, source)
        fields["mla"] = _converter.unstructure(fields["mla"])
        fields["moe"] = _converter.unstructure(fields["moe"])
        flat |= fields | {"rope": _converter.unstructure(attrs.evolve(rope, interleaved=interleaved))}
    try:
        cfg = _converter.structure(flat, ModelConfig)
    except cattrs.BaseValidationError as err:
        raise ValueError(f"{source}: {_describe(err)}") from None
    try:
        check_config(cfg)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    return cfg


def _moe_from_hf(d: dict[str, Any], family: str, source: str) -> MoEConfig | None:
    """The MoEConfig of a qwen2_moe / qwen3_moe / mixtral config.json (None for dense families)."""
    if family not in MOE_FAMILIES:
        return None  # dense, or DeepSeek (astrai.io.hf_deepseek)
    defaults = _FAMILY_DEFAULTS[family]
    k = d.get("num_experts_per_tok", defaults["num_experts_per_tok"])
    coef = d.get("router_aux_loss_coef", 0.001)
    if family == "mixtral":
        if d.get("router_jitter_noise"):
            raise UnsupportedModelError(f"{source}: router_jitter_noise={d['router_jitter_noise']} is not supported")
        experts = d.get("num_local_experts", defaults["num_local_experts"])
        return MoEConfig(
            num_experts=experts,
            num_experts_per_tok=k,
            moe_intermediate_size=d["intermediate_size"],
            norm_topk_prob=True,
            router_aux_loss_coef=coef,
        )
    experts = d.get("num_experts", d.get("num_local_experts", defaults["num_experts"]))
    if not experts:
        return None  # transformers builds dense MLPs everywhere when num_experts == 0
    shared = d.get("shared_expert_intermediate_size", defaults.get("shared_expert_intermediate_size", 0))
    return MoEConfig(
        num_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=d.get("moe_intermediate_size", defaults["moe_intermediate_size"]),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared if family == "qwen2_moe" else 0,
        shared_expert_gate=family == "qwen2_moe",
        decoder_sparse_step=d.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        router_aux_loss_coef=coef,
    )


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json MoE keys of `cfg`; raises UnsupportedModelError for settings the family cannot express."""
    moe = cfg.moe
    if moe is None or cfg.ffn_type != "moe":
        raise UnsupportedModelError(f"a {cfg.model_type} config.json needs ffn_type='moe' and a MoEConfig")
    family_shared = cfg.model_type == "qwen2_moe"
    fixed = {
        "scoring": "softmax",
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "e_score_correction_bias": False,
        "first_k_dense_replace": 0,
        "shared_expert_gate": family_shared,
    }
    if cfg.model_type == "mixtral":
        fixed |= {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": (), "shared_expert_gate": False}
        fixed["shared_expert_intermediate_size"] = 0
    elif not family_shared:
        fixed["shared_expert_intermediate_size"] = 0
    wrong = [f"{key}={getattr(moe, key)!r}" for key, value in fixed.items() if getattr(moe, key) != value]
    if cfg.model_type != "mixtral" and cfg.sliding_window is not None:
        wrong.append(f"sliding_window={cfg.sliding_window}")
    if family_shared and moe.shared_expert_intermediate_size <= 0:
        wrong.append("shared_expert_intermediate_size=0")
    if wrong:
        raise UnsupportedModelError(f"{cfg.model_type} cannot express MoE settings {', '.join(wrong)}")
    d: dict[str, Any] = {
        "num_experts_per_tok": moe.num_experts_per_tok,
        "router_aux_loss_coef": moe.router_aux_loss_coef,
        "output_router_logits": False,
    }
    if cfg.model_type != "mixtral":
        d["use_sliding_window"] = False
    if cfg.model_type == "mixtral":
        return d | {"num_local_experts": moe.num_experts, "intermediate_size": moe.moe_intermediate_size}
    d |= {
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": moe.decoder_sparse_step,
        "mlp_only_layers": list(moe.mlp_only_layers),
    }
    if family_shared:
        d |= {"shared_expert_intermediate_size": moe.shared_expert_intermediate_size, "qkv_bias": cfg.attention_bias}
    return d


def _dtype_name(value: str, source: str) -> str:
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise UnsupportedModelError(f"{source}: dtype {value!r} is not supported (supported: {sorted(DTYPES)})")
    return name


def _describe(err: BaseException) -> str:
    """One line per leaf error of a cattrs validation error, with the field path."""
    if isinstance(err, cattrs.BaseValidationError):
        notes = cattrs.transform_error(err)
        return "; ".join(notes)
    return str(err)


# The rope_scaling keys transformers validates per rope_type.
_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    + ("attention_factor", "truncate"),
}


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers `config.json` dict for `cfg` (loadable by transformers 4.4x and 5.x)."""
    rope = cfg.rope
    scaling: dict[str, Any] | None = None
    if rope.rope_type != "default":
        scaling = {"rope_type": rope.rope_type}
        for key in _ROPE_KEYS[rope.rope_type]:
            if getattr(rope, key) is not None:
                scaling[key] = getattr(rope, key)
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": rope.rope_type, "rope_theta": rope.theta, **(scaling or {})},
        "initializer_range": cfg.initializer_range,
        "dtype": cfg.dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else next(iter(cfg.eos_token_id), None),
        "pad_token_id": cfg.pad_token_id,
        "use_cache": True,
    }
    if cfg.model_type in ("llama", "qwen3", "qwen3_moe"):
        d["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "llama":
        d["mlp_bias"] = cfg.mlp_bias
    if cfg.model_type in ("mistral", "mixtral") or cfg.sliding_window is None:
        d["sliding_window"] = cfg.sliding_window
    if cfg.model_type in MOE_FAMILIES:
        d |= _moe_to_hf(cfg)
    if cfg.model_type in DEEPSEEK_FAMILIES:
        d |= deepseek_to_hf(cfg)
    elif cfg.attn_type != "gqa":
        raise UnsupportedModelError(f"{cfg.model_type} cannot express attn_type={cfg.attn_type!r}")
    if cfg.model_type in ("qwen2", "qwen3"):
        d["use_sliding_window"] = cfg.sliding_window is not None
        d["max_window_layers"] = cfg.num_hidden_layers
        if cfg.sliding_window is not None:
            d["sliding_window"] = cfg.sliding_window
            d["layer_types"] = list(cfg.layer_types or ["sliding_attention"] * cfg.num_hidden_layers)
            d["max_window_layers"] = d["layer_types"].index("sliding_attention")
    return d


# (HF regex, astrai template) pairs; layer index is group 1.
_NAME_RULES: tuple[tuple[str, str], ...] = (
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", "blocks.{0}.mlp.experts.{2}"),
    (r"model\.layers\.(\d+)\.mlp\.shared_experts?\.(\w+)\.(weight)", "blocks.{0}.mlp.shared_experts.{1}.{2}"),
    (r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", "blocks.{0}.mlp.e_score_correction_bias"),
    (r"model\.embed_tokens\.(weight)", "embed_tokens.{0}"),
    (r"model\.norm\.(weight)", "norm.{0}"),
    (r"lm_head\.(weight|bias)", "lm_head.{0}"),
    (r"model\.layers\.(\d+)\.input_layernorm\.(weight)", "blocks.{0}.attn_norm.{1}"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.(weight)", "blocks.{0}.mlp_norm.{1}"),
    (r"model\.layers\.(\d+)\.self_attn\.(\w+)\.(weight|bias)", "blocks.{0}.attn.{1}.{2}"),
    (r"model\.layers\.(\d+)\.mlp\.(\w+)\.(weight|bias)", "blocks.{0}.mlp.{1}.{2}"),
)
_REVERSE_RULES: tuple[tuple[str, str], ...] = (
    (r"blocks\.(\d+)\.mlp\.shared_experts\.(\w+)\.(weight)", "model.layers.{0}.mlp.shared_expert.{1}.{2}"),
    (r"blocks\.(\d+)\.mlp\.e_score_correction_bias", "model.layers.{0}.mlp.gate.e_score_correction_bias"),
    (r"embed_tokens\.(weight)", "model.embed_tokens.{0}"),
    (r"norm\.(weight)", "model.norm.{0}"),
    (r"lm_head\.(weight|bias)", "lm_head.{0}"),
    (r"blocks\.(\d+)\.attn_norm\.(weight)", "model.layers.{0}.input_layernorm.{1}"),
    (r"blocks\.(\d+)\.mlp_norm\.(weight)", "model.layers.{0}.post_attention_layernorm.{1}"),
    (r"blocks\.(\d+)\.attn\.(\w+)\.(weight|bias)", "model.layers.{0}.self_attn.{1}.{2}"),
    (r"blocks\.(\d+)\.mlp\.(\w+)\.(weight|bias)", "model.layers.{0}.mlp.{1}.{2}"),
)
# HF tensors that carry no parameters of ours (old checkpoints store RoPE tables).
IGNORED_HF_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")


def is_ignored_hf_tensor(name: str, cfg: ModelConfig) -> bool:
    """Whether HF tensor `name` is skipped on load: RoPE tables, DeepSeek MTP layers (model.layers.{>= L}.*)."""
    if IGNORED_HF_TENSORS.fullmatch(name):
        return True
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return cfg.model_type in DEEPSEEK_FAMILIES and layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers


def _apply_rules(name: str, rules: tuple[tuple[str, str], ...]) -> str | None:
    for pattern, template in rules:
        match = re.fullmatch(pattern, name)
        if match:
            return template.format(*match.groups())
    return None


# mixtral spells its MoE block `block_sparse_moe` and its expert projections w1 (gate), w3 (up), w2 (down).
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_HF = {v: k for k, v in _MIXTRAL_EXPERT.items()}


def hf_to_astrai_name(name: str) -> str | None:
    """The astrai tree name of an HF tensor name, or None when it is not a decoder parameter.

    Per-expert HF tensors map to the stacked astrai tensor they are part of (`blocks.0.mlp.experts.gate_proj`).
    """
    mixtral = re.fullmatch(r"(model\.layers\.\d+\.)block_sparse_moe\.(experts\.\d+\.)?(\w+)\.(weight)", name)
    if mixtral:
        layer, expert, proj, suffix = mixtral.groups()
        name = f"{layer}mlp.{expert or ''}{_MIXTRAL_EXPERT.get(proj, proj) if expert else proj}.{suffix}"
    return _apply_rules(name, _NAME_RULES)


def astrai_to_hf_name(name: str, model_type: str | None = None) -> str:
    """The HF tensor name of an astrai tree name (`model_type` picks family spellings such as mixtral's)."""
    out = _apply_rules(name, _REVERSE_RULES)
    if out is None:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    if model_type == "mixtral":
        out = re.sub(r"^(model\.layers\.\d+\.)mlp\.", r"\1block_sparse_moe.", out)
    if model_type in DEEPSEEK_FAMILIES:  # qwen2_moe says shared_expert, DeepSeek shared_experts
        out = re.sub(r"\.mlp\.shared_expert\.", ".mlp.shared_experts.", out)
    return out


def expert_hf_names(name: str, cfg: ModelConfig) -> list[str] | None:
    """The per-expert HF names stacked into astrai tensor `name` (expert order), or None if it is not stacked."""
    match = re.fullmatch(r"blocks\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)", name)
    if match is None or cfg.moe is None:
        return None
    layer, proj = match.groups()
    if cfg.model_type == "mixtral":
        return [
            f"model.layers.{layer}.block_sparse_moe.experts.{j}.{_MIXTRAL_HF[proj]}.weight"
            for j in range(cfg.moe.num_experts)
        ]
    return [f"model.layers.{layer}.mlp.experts.{j}.{proj}.weight" for j in range(cfg.moe.num_experts)]

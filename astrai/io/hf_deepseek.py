"""DeepSeek-V2/V3 `config.json` <-> `ModelConfig` fields (MLA attention + DeepSeek MoE); used by `astrai.io.hf`.

Mapping (transformers' DeepseekV2Config / DeepseekV3Config names):
- MLA: q_lora_rank (None: full-rank q_proj), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim ->
  `MLAConfig`; rope_interleave (V3; V2 always interleaves) -> `RopeConfig.interleaved`; `head_dim` is set to
  qk_rope_head_dim as transformers does. Yarn rope_scaling (mscale, mscale_all_dim) is read by `hf._rope_from_hf`.
- MoE: n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts (shared MLP width
  n_shared_experts * moe_intermediate_size, no gate), first_k_dense_replace, routed_scaling_factor, and
  - V3 (`topk_method: noaux_tc`, `scoring_func: sigmoid`): sigmoid scores + e_score_correction_bias, grouped
    top-k over n_group / topk_group, norm_topk_prob;
  - V2 (`topk_method: greedy`, softmax): plain top-k of softmax scores, never renormalised (transformers ignores
    norm_topk_prob for V2);
  - V2 `topk_method: group_limited_greedy` (DeepSeek-V2 / V2.5): grouped top-k whose group score is the group's
    best score (`MoEConfig.group_score = "max"`), not V3's top-2 sum.

Unsupported, raising `UnsupportedModelError` naming the setting: any other topk_method / scoring_func,
`moe_layer_freq` != 1 (transformers ignores it; DeepSeek's own code would skip layers), `mlp_bias`,
n_routed_experts = 0, `quantization_config` (the released V3 fp8 block-quantised weights: load a bf16 conversion).
MTP layers (`num_nextn_predict_layers`, stored as model.layers.{L}.*) are ignored on load, as transformers does.
"""

from __future__ import annotations

from typing import Any

from astrai.io.errors import UnsupportedModelError
from astrai.models.config import MLAConfig, ModelConfig, MoEConfig

DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3")
# transformers' defaults for keys a config.json may omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(max_position_embeddings=2048, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=None)
    | dict(moe_intermediate_size=1407, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128)
    | dict(qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=0, routed_scaling_factor=1.0)
    | dict(topk_method="greedy", scoring_func="softmax"),
    "deepseek_v3": dict(max_position_embeddings=4096, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8)
    | dict(moe_intermediate_size=2048, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128)
    | dict(qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3, routed_scaling_factor=2.5)
    | dict(topk_method="noaux_tc", scoring_func="sigmoid", n_group=8, topk_group=4, norm_topk_prob=True),
}
_MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _get(d: dict[str, Any], family: str, key: str) -> Any:
    value = d.get(key)
    return _DEFAULTS[family].get(key) if value is None and key != "q_lora_rank" else value


def deepseek_from_hf(d: dict[str, Any], family: str, source: str) -> tuple[dict[str, Any], bool]:
    """(ModelConfig fields to set, whether rope is interleaved) for a deepseek_v2/v3 config.json dict."""
    get = lambda key: _get(d, family, key)  # noqa: E731
    if "q_lora_rank" not in d:
        d = {**d, "q_lora_rank": _DEFAULTS[family]["q_lora_rank"]}
    method, scoring = get("topk_method"), get("scoring_func")
    expected = ("greedy", "softmax") if family == "deepseek_v2" else ("noaux_tc", "sigmoid")
    methods = ("greedy", "group_limited_greedy") if family == "deepseek_v2" else ("noaux_tc",)
    if method not in methods:
        raise UnsupportedModelError(
            f"{source}: {family} topk_method: {method} is not supported (only {' or '.join(methods)})"
        )
    v2_grouped = method == "group_limited_greedy"
    if scoring != expected[1]:
        raise UnsupportedModelError(f"{source}: {family} scoring_func: {scoring} is not supported (only {expected[1]})")
    if d.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModelError(f"{source}: moe_layer_freq={d['moe_layer_freq']} is not supported (only 1)")
    if d.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=True is not supported for {family}")
    if d.get("quantization_config"):
        quant = d["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(f"{source}: quantization_config ({quant}) is not supported: use a bf16 checkpoint")
    experts, inter = get("n_routed_experts"), get("moe_intermediate_size")
    if not experts:
        raise UnsupportedModelError(f"{source}: n_routed_experts={experts} is not supported (needs routed experts)")
    v3 = family == "deepseek_v3"
    moe = MoEConfig(
        num_experts=experts,
        num_experts_per_tok=get("num_experts_per_tok"),
        moe_intermediate_size=inter,
        scoring="sigmoid" if v3 else "softmax",
        norm_topk_prob=bool(get("norm_topk_prob")) if v3 else False,
        routed_scaling_factor=float(get("routed_scaling_factor")),
        n_group=(get("n_group") or 1) if v3 or v2_grouped else 1,
        topk_group=(get("topk_group") or 1) if v3 or v2_grouped else 1,
        group_score="max" if v2_grouped else "top2_sum",
        e_score_correction_bias=v3,
        shared_expert_intermediate_size=inter * (get("n_shared_experts") or 0),
        first_k_dense_replace=get("first_k_dense_replace") or 0,
        router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
    )
    heads = d["num_attention_heads"]
    interleaved = bool(d.get("rope_interleave", True)) if v3 else True
    mla = MLAConfig(num_heads=heads, **{key: get(key) for key in _MLA_KEYS}, interleaved_rope=interleaved)
    bias = bool(d.get("attention_bias", False))
    fields = {
        "attn_type": "mla",
        "mla": mla,
        "ffn_type": "moe",
        "moe": moe,
        "head_dim": mla.qk_rope_head_dim,
        "num_key_value_heads": heads,
        "attention_bias": bias,
        "attention_out_bias": bias,
        "mlp_bias": False,
        "qk_norm": False,
        "sliding_window": None,
        "layer_types": None,
        "max_position_embeddings": d.get("max_position_embeddings") or _DEFAULTS[family]["max_position_embeddings"],
    }
    return fields, interleaved


def deepseek_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys of a deepseek_v2/v3 `cfg`; raises UnsupportedModelError for what it cannot express."""
    mla, moe, family = cfg.mla, cfg.moe, cfg.model_type
    if cfg.attn_type != "mla" or mla is None or cfg.ffn_type != "moe" or moe is None:
        raise UnsupportedModelError(f"a {family} config.json needs attn_type='mla' and ffn_type='moe'")
    v3 = family == "deepseek_v3"
    fixed: dict[str, Any] = {
        "scoring": "sigmoid" if v3 else "softmax",
        "e_score_correction_bias": v3,
        "shared_expert_gate": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": (),
    }
    if not v3:
        fixed |= {"norm_topk_prob": False}
        if moe.n_group == 1:
            fixed |= {"topk_group": 1}
        else:
            fixed |= {"group_score": "max"}
    else:
        fixed |= {"group_score": "top2_sum"}
    wrong = [f"{key}={getattr(moe, key)!r}" for key, value in fixed.items() if getattr(moe, key) != value]
    if moe.shared_expert_intermediate_size % moe.moe_intermediate_size:
        wrong.append(f"shared_expert_intermediate_size={moe.shared_expert_intermediate_size}")
    for name, ok in (("mlp_bias", not cfg.mlp_bias), ("qk_norm", not cfg.qk_norm)):
        if not ok:
            wrong.append(f"{name}=True")
    if mla.interleaved_rope is False and not v3:
        wrong.append("interleaved_rope=False")
    if cfg.attention_out_bias != cfg.attention_bias:
        wrong.append(f"attention_out_bias={cfg.attention_out_bias}")
    if wrong:
        raise UnsupportedModelError(f"{family} cannot express settings {', '.join(wrong)}")
    d: dict[str, Any] = {key: getattr(mla, key) for key in _MLA_KEYS}
    d |= {
        "head_dim": mla.qk_rope_head_dim,
        "num_key_value_heads": cfg.num_attention_heads,
        "attention_bias": cfg.attention_bias,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "n_shared_experts": moe.shared_expert_intermediate_size // moe.moe_intermediate_size,
        "first_k_dense_replace": moe.first_k_dense_replace,
        "moe_layer_freq": 1,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "scoring_func": fixed["scoring"],
        "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if moe.n_group > 1 else "greedy"),
        "router_aux_loss_coef": moe.router_aux_loss_coef,
    }
    if v3:
        d["rope_interleave"] = mla.interleaved_rope
    return d

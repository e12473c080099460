"""Value checks on a transformers `config.json` dict before `astrai.io.hf.config_from_hf` converts it.

transformers validates almost nothing here: `rms_norm_eps: NaN`, `rope_theta: 0`, `hidden_size: "32"` or
`eos_token_id: 99999` load and then give NaN logits, crash deep inside torch, or never stop generating. These
checks name the config.json key and the value instead. The legal values follow transformers' semantics: sizes are
positive integers; counts that may be zero (`num_experts`: dense, `first_k_dense_replace`, shared experts) are
non-negative; `q_lora_rank`, `head_dim`, `num_key_value_heads`, `sliding_window` and the token ids may be null;
epsilons, RoPE bases and scaling factors are finite and positive; switches are JSON booleans. Integral values
stored as floats (`4096.0`) are refused like strings: transformers would build float-sized layers from them.

Range checks that need the whole config (token ids within the vocabulary, head counts dividing, the layer types)
are `astrai.models.config.check_config`'s, which `config_from_hf` runs last.
"""

from __future__ import annotations

import math
from typing import Any

_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts_per_tok", "moe_intermediate_size",
    "num_local_experts", "n_routed_experts", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "n_group", "topk_group",
)  # fmt: skip
_NON_NEGATIVE_INTS = ("num_experts", "shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                      "decoder_sparse_step", "max_window_layers", "sliding_window")  # fmt: skip
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
_NON_NEGATIVE_FLOATS = ("initializer_range",)
_FINITE_FLOATS = ("router_aux_loss_coef",)
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "norm_topk_prob", "qkv_bias",
          "rope_interleave")  # fmt: skip
_TOKEN_IDS = ("bos_token_id", "pad_token_id")
# rope_scaling / rope_parameters keys
_ROPE_POSITIVE = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor")
_ROPE_FINITE = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_hf_fields(d: dict[str, Any], source: str) -> None:
    """Raise ValueError naming the first top-level config.json key whose value is ill-typed or out of range.

    Absent and null keys are left to the defaults; keys a family does not use are still checked (a corrupt value
    is a corrupt file either way).
    """

    def bad(key: str, what: str) -> ValueError:
        return ValueError(f"{source}: {key} must be {what}, got {d[key]!r}")

    present = {key for key, value in d.items() if value is not None}
    for key in present.intersection(_POSITIVE_INTS):
        if not _is_int(d[key]) or d[key] <= 0:
            raise bad(key, "a positive integer")
    for key in present.intersection(_NON_NEGATIVE_INTS):
        if not _is_int(d[key]) or d[key] < 0:
            raise bad(key, "an integer >= 0" + (" or null" if key == "sliding_window" else ""))
    for key in present.intersection(_POSITIVE_FLOATS):
        if not _is_number(d[key]) or d[key] <= 0:
            raise bad(key, "a finite number > 0")
    for key in present.intersection(_NON_NEGATIVE_FLOATS):
        if not _is_number(d[key]) or d[key] < 0:
            raise bad(key, "a finite number >= 0")
    for key in present.intersection(_FINITE_FLOATS):
        if not _is_number(d[key]):
            raise bad(key, "a finite number")
    for key in present.intersection(_BOOLS):
        if not isinstance(d[key], bool):
            raise bad(key, "true or false")
    for key in present.intersection(_TOKEN_IDS):
        if not _is_int(d[key]):
            raise bad(key, "an integer or null")
    eos = d.get("eos_token_id")
    if eos is not None and not (_is_int(eos) or (isinstance(eos, list) and all(map(_is_int, eos)))):
        raise bad("eos_token_id", "an integer, a list of integers or null")
    for key in ("rope_scaling", "rope_parameters"):
        if d.get(key) is not None:
            if not isinstance(d[key], dict):
                raise bad(key, "an object or null")
            check_rope_fields(d[key], f"{source}: {key}")


def check_rope_fields(params: dict[str, Any], where: str) -> None:
    """Raise ValueError naming the rope_scaling / rope_parameters key whose value is not a valid number."""
    for key, value in params.items():
        if value is None:
            continue
        if key in _ROPE_POSITIVE and (not _is_number(value) or value <= 0):
            raise ValueError(f"{where}.{key} must be a finite number > 0, got {value!r}")
        if key in _ROPE_FINITE and not _is_number(value):
            raise ValueError(f"{where}.{key} must be a finite number, got {value!r}")
        if key == "original_max_position_embeddings" and (not _is_int(value) or value <= 0):
            raise ValueError(f"{where}.{key} must be a positive integer, got {value!r}")
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    if params.get("rope_type", params.get("type")) == "llama3" and _is_number(low) and _is_number(high) and high <= low:
        raise ValueError(f"{where}: high_freq_factor ({high}) must be greater than low_freq_factor ({low})")

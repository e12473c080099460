"""Static model hyperparameters: `ModelConfig` and `RopeConfig` (attrs frozen, hashable).

One config describes every decoder family astrai runs (llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe,
mixtral, deepseek_v3). Family quirks are plain switches (`attention_bias`, `qk_norm`, `sliding_window`, ...) so
the single decoder in `models/decoder.py` needs no per-family code. Attention and FFN kinds are explicit (`attn_type`,
`ffn_type`); MLA (`attn_type="mla"`) and MoE carry their own nested configs (`mla`, `moe`).

HF `config.json` <-> ModelConfig conversion lives in `astrai/io/hf.py`.
"""

from __future__ import annotations

import math
from typing import Literal

import attrs
import torch

from astrai.nn.mla import MLAConfig
from astrai.nn.moe import MoEConfig, check_moe_config
from astrai.nn.rope import ROPE_TYPES, RopeConfig

__all__ = ["DTYPES", "MLAConfig", "ModelConfig", "MoEConfig", "RopeConfig", "check_config"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_TYPES = ("full_attention", "sliding_attention")
"""The per-layer attention kinds astrai runs (transformers' `layer_types` names)."""


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Hyperparameters of a decoder-only language model."""

    model_type: str = "llama"
    """HF family name (llama, mistral, qwen2, qwen3); decides the config.json written on save."""
    vocab_size: int
    """Number of token ids (V)."""
    hidden_size: int
    """Residual stream width (E)."""
    intermediate_size: int
    """SwiGLU hidden width (F)."""
    num_hidden_layers: int
    """Number of decoder blocks (L)."""
    num_attention_heads: int
    """Query heads (H)."""
    num_key_value_heads: int
    """Key/value heads (K); H must be a multiple of K (GQA)."""
    head_dim: int
    """Per-head width (D); may differ from E / H (qwen3)."""
    max_position_embeddings: int = 4096
    """Longest context the model supports (also the dynamic-NTK threshold)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope: RopeConfig = RopeConfig()
    """Rotary embedding parameters."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the LM head."""
    attention_bias: bool = False
    """Bias on the q/k/v projections (qwen2: always; llama/qwen3: `attention_bias`)."""
    attention_out_bias: bool = False
    """Bias on the output projection (llama/qwen3 `attention_bias`; qwen2 never)."""
    mlp_bias: bool = False
    """Bias on the SwiGLU projections (llama `mlp_bias`)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (qwen3)."""
    sliding_window: int | None = None
    """Sliding-window size in tokens for layers of type "sliding_attention" (None: no window)."""
    layer_types: tuple[str, ...] | None = None
    """Per-layer "full_attention" / "sliding_attention"; None means every layer slides when a window is set."""
    attn_type: Literal["gqa", "mla"] = "gqa"
    """Attention kind: grouped-query attention, or DeepSeek's multi-head latent attention (settings in `mla`)."""
    mla: MLAConfig | None = None
    """MLA layer shape (required when attn_type is "mla"; its num_heads equals num_attention_heads)."""
    ffn_type: Literal["mlp", "moe"] = "mlp"
    """FFN kind: dense SwiGLU everywhere, or MoE on the layers `moe` makes sparse (`layer_is_moe`)."""
    moe: MoEConfig | None = None
    """Mixture-of-Experts settings (required when ffn_type is "moe")."""
    hidden_act: Literal["silu"] = "silu"
    """Gate activation of the SwiGLU MLP."""
    dtype: str = "float32"
    """Storage dtype of the parameters: float32, bfloat16 or float16."""
    initializer_range: float = 0.02
    """Std of the normal init for projections and embeddings."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id (kept for config.json round trips)."""
    eos_token_id: tuple[int, ...] = ()
    """End-of-sequence ids from config.json (generation_config.json may add more)."""
    pad_token_id: int | None = None
    """Padding id (kept for config.json round trips)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        return DTYPES[self.dtype]

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (the GQA group size G)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rope_dim(self) -> int:
        """Rotary width of the cos/sin tables: head_dim (GQA) or qk_rope_head_dim (MLA)."""
        return self.mla.qk_rope_head_dim if self.attn_type == "mla" and self.mla is not None else self.head_dim

    def layer_is_moe(self, layer: int) -> bool:
        """Whether `layer`'s FFN is the MoE block (else the dense MLP of width `intermediate_size`)."""
        return self.ffn_type == "moe" and self.moe is not None and self.moe.is_sparse(layer)

    def layer_window(self, layer: int) -> int:
        """Sliding window of `layer` in tokens, or 0 for full attention."""
        if self.sliding_window is None:
            return 0
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return 0


def check_config(cfg: ModelConfig) -> None:
    """Raise ValueError naming the field when hyperparameters are inconsistent."""
    positive = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"]
    positive += ["num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"]
    for name in positive:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({cfg.num_key_value_heads})"
        )
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {cfg.head_dim}")
    _check_number("ModelConfig.rms_norm_eps", cfg.rms_norm_eps, positive=True)
    _check_number("ModelConfig.initializer_range", cfg.initializer_range)
    _check_rope(cfg.rope)
    _check_token_ids(cfg)
    if cfg.dtype not in DTYPES:
        raise ValueError(f"ModelConfig.dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    if cfg.rope.rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {cfg.rope.rope_type!r}")
    if cfg.ffn_type not in ("mlp", "moe"):
        raise ValueError(f"ModelConfig.ffn_type must be 'mlp' or 'moe', got {cfg.ffn_type!r}")
    if cfg.ffn_type == "moe":
        if cfg.moe is None:
            raise ValueError("ModelConfig.ffn_type is 'moe' but ModelConfig.moe is None")
        check_moe_config(cfg.moe)
    _check_attn(cfg)
    if cfg.layer_types is not None and len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types has {len(cfg.layer_types)} entries for {cfg.num_hidden_layers} layers")
    unknown = sorted(set(cfg.layer_types or ()) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (supported: {LAYER_TYPES})")
    window = cfg.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"ModelConfig.sliding_window must be a positive integer or None, got {window!r}")


def _check_number(name: str, value: object, *, positive: bool = False) -> None:
    """Raise ValueError unless `value` is a finite number, > 0 when `positive` (else >= 0)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be a finite number {'>' if positive else '>='} 0, got {value!r}")


def _check_rope(rope: RopeConfig) -> None:
    """RoPE numbers that would give NaN or infinite frequencies (transformers only warns about some of them)."""
    _check_number("rope theta (rope_theta)", rope.theta, positive=True)
    _check_number("rope factor (rope_scaling.factor)", rope.factor, positive=True)
    for name in ("low_freq_factor", "high_freq_factor"):
        _check_number(f"rope_scaling.{name}", getattr(rope, name), positive=True)
    if rope.rope_type == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        raise ValueError(f"rope_scaling.high_freq_factor ({rope.high_freq_factor}) must be greater than "
                         f"low_freq_factor ({rope.low_freq_factor})")  # fmt: skip
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        value = getattr(rope, name)
        if value is not None and not (isinstance(value, int | float) and math.isfinite(value)):
            raise ValueError(f"rope_scaling.{name} must be a finite number, got {value!r}")
    if rope.attention_factor is not None:
        _check_number("rope_scaling.attention_factor", rope.attention_factor, positive=True)
    original = rope.original_max_position_embeddings
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original <= 0):
        raise ValueError(f"rope_scaling.original_max_position_embeddings must be a positive integer, got {original!r}")


def _check_token_ids(cfg: ModelConfig) -> None:
    """bos and eos ids within [0, vocab_size): an eos id the model cannot produce would never stop generation.

    pad_token_id is only carried for config.json round trips (old Llama conversions store -1), so it is not
    range-checked.
    """
    ids = [("bos_token_id", cfg.bos_token_id)] if cfg.bos_token_id is not None else []
    ids += [("eos_token_id", i) for i in cfg.eos_token_id]
    for name, value in ids:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < cfg.vocab_size:
            raise ValueError(f"{name} {value!r} is outside the vocabulary [0, {cfg.vocab_size}) (vocab_size)")


def _check_attn(cfg: ModelConfig) -> None:
    if cfg.attn_type not in ("gqa", "mla"):
        raise ValueError(f"ModelConfig.attn_type must be 'gqa' or 'mla', got {cfg.attn_type!r}")
    if cfg.attn_type == "gqa":
        if cfg.mla is not None:
            raise ValueError("ModelConfig.mla is set but attn_type is 'gqa' (set attn_type='mla')")
        return
    mla = cfg.mla
    if mla is None:
        raise ValueError("ModelConfig.attn_type is 'mla' but ModelConfig.mla is None")
    if mla.num_heads != cfg.num_attention_heads:
        raise ValueError(f"MLAConfig.num_heads ({mla.num_heads}) != num_attention_heads ({cfg.num_attention_heads})")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(mla, name) <= 0:
            raise ValueError(f"MLAConfig.{name} must be positive, got {getattr(mla, name)}")
    if mla.q_lora_rank is not None and mla.q_lora_rank <= 0:
        raise ValueError(f"MLAConfig.q_lora_rank must be positive or None, got {mla.q_lora_rank}")
    if mla.qk_rope_head_dim % 2:
        raise ValueError(f"MLAConfig.qk_rope_head_dim must be even for RoPE, got {mla.qk_rope_head_dim}")
    if mla.interleaved_rope != cfg.rope.interleaved:
        raise ValueError(
            f"MLAConfig.interleaved_rope ({mla.interleaved_rope}) != rope.interleaved ({cfg.rope.interleaved})"
        )
    if cfg.sliding_window is not None:
        raise ValueError("sliding_window is not supported with attn_type 'mla'")

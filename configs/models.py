"""Named model configs: the shapes of well-known checkpoints and tiny test/demo models.

Each function returns a `ModelConfig`; `astrai.init_params(cfg, seed=...)` gives random weights of that
shape (the benchmarks use these shapes), and loading a real checkpoint reads the same fields from its
config.json. Sizes are the published ones.
"""

from __future__ import annotations

from astrai.models.config import ModelConfig
from astrai.nn.rope import RopeConfig


def tiny(vocab_size: int = 512) -> ModelConfig:
    """A ~1M-parameter qwen3-shaped model for tests and demos (runs in milliseconds on a CPU)."""
    return ModelConfig(
        model_type="qwen3", vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, qk_norm=True, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip


def chat_small(vocab_size: int = 100) -> ModelConfig:
    """A ~0.9M-parameter llama-shaped model for the quickstart's character-level chat task.

    Sized for 2 CPU cores: it learns 2-digit addition to ~100% held-out accuracy in ~800 steps, where a 5M model
    runs 4.5x fewer tokens/s and is still on its loss plateau when the 5-minute budget is spent.
    """
    return ModelConfig(
        model_type="llama", vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=True,
    )  # fmt: skip


def smollm2_135m() -> ModelConfig:
    """HuggingFaceTB/SmolLM2-135M (llama family, tied embeddings)."""
    return ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=100000.0), tie_word_embeddings=True,
    )  # fmt: skip


def qwen2_5_0_5b() -> ModelConfig:
    """Qwen/Qwen2.5-0.5B (qwen2 family: q/k/v bias, tied embeddings)."""
    return ModelConfig(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0), tie_word_embeddings=True, attention_bias=True,
    )  # fmt: skip


def qwen3_0_6b() -> ModelConfig:
    """Qwen/Qwen3-0.6B (qwen3 family: per-head q/k RMSNorm, head_dim 128 != E/H)."""
    return ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0), tie_word_embeddings=True, qk_norm=True,
    )  # fmt: skip


def llama3_1_8b() -> ModelConfig:
    """meta-llama/Llama-3.1-8B (llama3 RoPE scaling, 128k context)."""
    rope = RopeConfig(
        rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )  # fmt: skip
    return ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope=rope, bos_token_id=128000, eos_token_id=(128001,),
    )  # fmt: skip


NAMED = {
    "tiny": tiny,
    "chat-small": chat_small,
    "smollm2-135m": smollm2_135m,
    "qwen2.5-0.5b": qwen2_5_0_5b,
    "qwen3-0.6b": qwen3_0_6b,
    "llama3.1-8b": llama3_1_8b,
}

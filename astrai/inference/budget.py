"""Memory budget of the KV pool: activation headroom and vLLM's `gpu_memory_utilization` arithmetic."""

from __future__ import annotations

import torch

from astrai.models.config import ModelConfig

ACTIVATION_FIXED_BYTES = 512 << 20
"""Part of the activation headroom that does not scale with the model: the CUDA context, cuBLAS workspaces,
CUDA-graph pools and compile scratch."""


def activation_headroom(cfg: ModelConfig, dtype: torch.dtype, *, max_step_tokens: int, max_running: int) -> int:
    """Bytes kept free beside the weights and the KV pool for one step's activations (an estimate, not a profile).

    A step of `max_step_tokens` tokens holds a few hidden-size rows and the MLP's gate/up/activation rows per
    token; the sampler holds a few float32 `[max_running, vocab]` logit copies; plus ACTIVATION_FIXED_BYTES.
    """
    item = torch.empty((), dtype=dtype).element_size()
    per_token = (8 * cfg.hidden_size + 4 * cfg.intermediate_size) * item
    logits = 4 * max_running * cfg.vocab_size * 4
    return max_step_tokens * per_token + logits + ACTIVATION_FIXED_BYTES


def kv_budget_for_utilization(utilization: float, *, total: int, free: int, in_use: int, headroom: int) -> int:
    """KV pool bytes under vLLM's `gpu_memory_utilization`: `min(utilization * total - in_use, free) - headroom`.

    Args:
        utilization: fraction of the device's total memory the process may use.
        total, free: the device's total and currently free bytes (`torch.cuda.mem_get_info`).
        in_use: bytes this process already holds (torch's reserved memory: the weights).
        headroom: bytes left for activations (`activation_headroom`).

    Raises:
        ValueError: nothing is left for the KV pool (the message gives the numbers and what to change).
    """
    budget = min(int(utilization * total) - in_use, free) - headroom
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no memory left for the KV cache: gpu_memory_utilization {utilization} of {total / gib:.1f} GiB is "
            f"{utilization * total / gib:.1f} GiB, the weights already hold {in_use / gib:.1f} GiB, "
            f"{free / gib:.1f} GiB is free and activations need about {headroom / gib:.1f} GiB; raise "
            "gpu_memory_utilization, or lower max_num_batched_tokens / max_num_seqs"
        )
    return budget

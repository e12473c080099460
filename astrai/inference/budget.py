"""Memory budget of the KV pool: its size in pages, activation headroom and vLLM's `gpu_memory_utilization`
arithmetic."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from astrai.models.config import ModelConfig

if TYPE_CHECKING:
    from astrai.inference.engine_config import EngineConfig
    from astrai.io.model import Model

logger = logging.getLogger(__name__)

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


def kv_pool_pages(cfg: EngineConfig, model: Model, device: torch.device, per_token: int, max_model_len: int) -> int:
    """Pages of the KV pool on `device` (one rank's, under tensor parallel) at `per_token` bytes per token.

    `cfg.kv_budget_tokens` when set; on CUDA `gpu_memory_utilization` (vLLM's arithmetic) or a fraction of the free
    memory; on CPU `kv_budget_bytes`. Never more than every running sequence at full length can use, never fewer
    than 2 (one usable page and the null page).
    """
    tokens = cfg.kv_budget_tokens
    if tokens is None:
        if device.type == "cuda" and cfg.gpu_memory_utilization is not None:
            free, total = torch.cuda.mem_get_info(device)
            steps = {"max_step_tokens": cfg.max_step_tokens, "max_running": cfg.max_running}
            headroom = activation_headroom(model.config, model.dtype, **steps)
            in_use = torch.cuda.memory_reserved(device)
            util = cfg.gpu_memory_utilization
            budget = kv_budget_for_utilization(util, total=total, free=free, in_use=in_use, headroom=headroom)
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * cfg.kv_memory_fraction)
        else:
            budget = cfg.kv_budget_bytes
        tokens = min(budget // per_token, cfg.max_running * max_model_len)
    return max(2, tokens // cfg.page_size + 1)  # + the null page


def pool_max_model_len(max_model_len: int, num_pages: int, page_size: int, *, explicit: bool) -> int:
    """The context length the engine enforces: `max_model_len`, capped by what the KV pool holds when it was not set
    explicitly (it came from config.json's `max_position_embeddings`).

    A checkpoint may claim any context (10**12): no sequence can outgrow the pool's usable pages, so a longer limit
    only lets requests in that wait for pages forever. Nothing is sized by the claimed length (the pool by the
    budget, rotary angles from positions), so capping the number is all it takes; a warning says so.
    """
    capacity = (num_pages - 1) * page_size  # less the null page
    if explicit or max_model_len <= capacity:
        return max_model_len
    msg = "max_position_embeddings %d exceeds the KV pool's %d tokens; capping the context length at %d"
    logger.warning(msg + " (set --max-model-len, or give the KV cache more memory)", max_model_len, capacity, capacity)
    return capacity

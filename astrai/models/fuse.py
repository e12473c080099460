"""Serving layout: q/k/v and gate/up of every decoder block as one projection each (vLLM's QKVParallelLinear and
MergedColumnParallelLinear).

A decode step multiplies each block's input by q, k and v, and the MLP input by gate and up: five small GEMMs
where two do the same work. On a GPU every GEMM is a kernel launch (replayed from a CUDA graph, but still a
launch, ~2-4 us each at batch 1 against ~1 us of work for a 135M model's projection), so fusing them takes 90 of
a 30-layer model's launches out of every step (issue 16 item 1). The checkpoint layout (HF names, one tensor per
projection) stays the model's own: training, LoRA, tensor-parallel sharding and saving all read it. The fused tree
is a copy the engine keeps for serving (`EngineConfig.fuse_projections`), with its own storage, so:

- it costs the q/k/v and gate/up weights' memory once more (~2/3 of a dense model's weights);
- weights changed in place (an RL optimizer step, `Engine.update_params()`) or swapped reach it only through
  `fuse_projections(params, into=served)`, which writes into the served storage (CUDA graphs and compiled steps
  keep reading it).

Left as they are: projections with a LoRA adapter, a mix of float and int8 weights, MLA attention, MoE routed
experts (already one grouped GEMM), the embedding and the LM head. MoE shared experts are fused like an MLP.
On CPU the engine does not fuse by default: compiled decode steps of SmolLM2-135M measured -17% to +9% fused,
with no consistent sign (docs/benchmarks.md, "CPU engine step layout").
"""

from __future__ import annotations

from typing import Any

import torch

from astrai.models.decoder import BlockParams, DecoderParams
from astrai.nn.attention import AttentionParams, FusedAttentionParams
from astrai.nn.linear import LinearParams, concat_linears, copy_concat_, stackable
from astrai.nn.mlp import FusedMLPParams, MLPParams
from astrai.nn.moe import MoEParams
from astrai.tree import leaves, replace


def fuse_projections(params: DecoderParams, *, into: DecoderParams | None = None) -> DecoderParams:
    """`params` with each block's q/k/v and gate/up fused where they stack (`concat_linears`); every other leaf is
    the same tensor as in `params`.

    Without `into` the fused weights are new tensors (a copy). With `into` (an earlier result for a tree of the
    same structure and shapes) they are `into`'s own tensors, overwritten in place with `params`' values: what the
    engine does after an optimizer step or a weight swap, so no second copy is ever allocated and anything holding
    the served tensors (CUDA graphs, compiled steps) reads the new values.

    Raises:
        ValueError: `into` is not the fused layout of a tree shaped like `params`.
    """
    if into is not None and len(into.blocks) != len(params.blocks):
        raise ValueError(f"fuse_projections: into has {len(into.blocks)} blocks, params {len(params.blocks)}")
    old = into.blocks if into is not None else (None,) * len(params.blocks)
    # a serving copy: never part of a trainer's autograd graph, and a normal tensor even when made under
    # inference_mode, so a later in-place refresh (`into=`) outside it is allowed
    with torch.inference_mode(False), torch.no_grad():
        blocks = tuple(_fuse_block(block, was) for block, was in zip(params.blocks, old, strict=True))
    return replace(params, blocks=blocks)


def fused_bytes(params: DecoderParams) -> int:
    """Bytes `fuse_projections(params)` allocates: the weights (and biases, scales) it concatenates."""
    total = 0
    for block in params.blocks:
        for group in (_attention_group(block.attn), _mlp_group(block.mlp)):
            if group is not None and stackable(group):
                total += sum(t.numel() * t.element_size() for p in group for t in leaves(p))
    return total


def _attention_group(attn: Any) -> tuple | None:
    return (attn.q_proj, attn.k_proj, attn.v_proj) if isinstance(attn, AttentionParams) else None


def _mlp_group(ffn: Any) -> tuple | None:
    if isinstance(ffn, MoEParams):
        ffn = ffn.shared_experts
    return (ffn.gate_proj, ffn.up_proj) if isinstance(ffn, MLPParams) else None


def _stacked(ps: tuple, was: Any) -> Any:
    """The fused projection of `ps`: a new one, or `was` (a fused projection from before) with their values."""
    if was is None:
        return concat_linears(ps)
    rows = sum(p.weight.shape[0] for p in ps)
    if not stackable(ps) or not isinstance(was, LinearParams) or was.weight.shape[0] != rows:
        raise ValueError("fuse_projections: into's fused projection does not match the tree's")
    copy_concat_(was, ps)
    return was


def _fuse_mlp(p: MLPParams, was: Any) -> MLPParams | FusedMLPParams:
    if was is not None and not isinstance(was, FusedMLPParams):
        return _unfused(p, was)
    gate_up = _stacked((p.gate_proj, p.up_proj), None if was is None else was.gate_up_proj)
    return p if gate_up is None else FusedMLPParams(gate_up_proj=gate_up, down_proj=p.down_proj)


def _fuse_attention(p: Any, was: Any) -> Any:
    if not isinstance(p, AttentionParams) or (was is not None and not isinstance(was, FusedAttentionParams)):
        return p if was is None else _unfused(p, was)
    qkv = _stacked(_attention_group(p), None if was is None else was.qkv_proj)
    return p if qkv is None else FusedAttentionParams(qkv_proj=qkv, o_proj=p.o_proj, q_norm=p.q_norm, k_norm=p.k_norm)


def _unfused(p: Any, was: Any) -> Any:
    """A layer `into` left unfused: it must be unfused here too (it serves `params`' own tensors)."""
    if type(was) is not type(p):
        raise ValueError(f"fuse_projections: into has a {type(was).__name__} where params has a {type(p).__name__}")
    return p


def _fuse_block(block: BlockParams, was: BlockParams | None) -> BlockParams:
    ffn, was_ffn = block.mlp, None if was is None else was.mlp
    if isinstance(ffn, MLPParams):
        ffn = _fuse_mlp(ffn, was_ffn)
    elif isinstance(ffn, MoEParams) and ffn.shared_experts is not None:
        was_shared = None if was_ffn is None else getattr(was_ffn, "shared_experts", None)
        ffn = replace(ffn, shared_experts=_fuse_mlp(ffn.shared_experts, was_shared))
    return replace(block, attn=_fuse_attention(block.attn, None if was is None else was.attn), mlp=ffn)

"""One functional decoder LM for every family (llama, mistral, qwen2, qwen3, MoE kin, deepseek) via `ModelConfig`.

Notable features:
- Pre-norm blocks: x += attn(norm(x)); x += mlp(norm(x)); final norm; LM head (tied or untied).
- One `forward` serves training (dense [B, T], causal), prefill/extend and decode (flattened ragged tokens
  over a paged `KVCache` described by `AttnMeta`); only the metadata differs.
- `logits_positions` runs the final norm and LM head only on the rows that will be sampled.
- Each block reads one `BlockContext` (rope tables, metadata, its own cache view, layer index, dense-mode masks)
  built per layer, never a long positional tuple.
- Logits are float32 whatever the parameter dtype (sampling and losses want fp32).
- MoE: a block's FFN is `MoEParams` where `cfg.layer_is_moe(layer)` (else the dense MLP); `hidden_states`
  can return the summed MoE aux tree for the load-balancing loss.
- `hidden_states(run_unit=...)`: an optional runner that owns each unit's call (the embedding lookup and every
  block), e.g. `astrai.train.fsdp.BlockGather`, which all-gathers the unit's sharded parameters just for it.
- MLA (`cfg.attn_type == "mla"`, DeepSeek): a block's attention is `MLAParams` run by `astrai.nn.mla.mla`; the
  rope tables have width qk_rope_head_dim and the paged pool is a `LatentCache` (one latent tensor per layer).

Not here: the embedding encoder (`models/encoder.py`); bidirectional MLA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import torch
import torch.utils.checkpoint
from torch import Tensor

from astrai.models.config import ModelConfig, check_config
from astrai.nn.attention import AttentionParams, AttentionShape, attention, init_attention
from astrai.nn.embedding import EmbeddingParams, embed, init_embedding
from astrai.nn.linear import LinearParams, init_linear, plain
from astrai.nn.mla import MLAParams, init_mla, mla, mla_softmax_scale
from astrai.nn.mlp import MLPParams, init_mlp, mlp
from astrai.nn.moe import MoEAux, MoEParams, add_aux, init_moe, moe
from astrai.nn.norm import RMSNormParams, init_rms_norm, rms_norm
from astrai.nn.rope import rope_cos_sin
from astrai.ops.attention import AttnMeta, KVCache, LatentCache
from astrai.ops.collectives import TensorParallel, tp_copy, tp_gather, tp_reduce
from astrai.ops.linear import linear as linear_op
from astrai.tree import named_tensors, pytree, to_device


@pytree
@attrs.frozen(eq=False)
class BlockParams:
    """One pre-norm decoder block."""

    attn_norm: RMSNormParams
    attn: AttentionParams | MLAParams  # MLAParams when cfg.attn_type == "mla"
    mlp_norm: RMSNormParams
    mlp: MLPParams | MoEParams  # MoEParams on the layers where cfg.layer_is_moe(layer)


@pytree
@attrs.frozen(eq=False)
class DecoderParams:
    """All learnable tensors of a decoder LM; `lm_head` is None when tied to the embedding."""

    embed_tokens: EmbeddingParams
    blocks: tuple[BlockParams, ...]
    norm: RMSNormParams
    lm_head: LinearParams | None = None


def attention_shape(cfg: ModelConfig, layer: int) -> AttentionShape:
    """Static attention settings of `layer`."""
    return AttentionShape(
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        norm_eps=cfg.rms_norm_eps,
        window=cfg.layer_window(layer),
        interleaved_rope=cfg.rope.interleaved,
    )


def _init_ffn(
    cfg: ModelConfig, layer: int, std: float, out_std: float, generator: torch.Generator | None
) -> MLPParams | MoEParams:
    kw = dict(std=std, out_std=out_std, generator=generator, dtype=cfg.torch_dtype)
    if cfg.layer_is_moe(layer):
        return init_moe(cfg.hidden_size, cfg.moe, **kw)
    return init_mlp(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, **kw)


def _init_attn(
    cfg: ModelConfig, layer: int, std: float, out_std: float, generator: torch.Generator | None
) -> AttentionParams | MLAParams:
    kw = dict(std=std, out_std=out_std, generator=generator, dtype=cfg.torch_dtype)
    if cfg.attn_type == "mla":
        return init_mla(cfg.hidden_size, cfg.mla, attention_bias=cfg.attention_bias, **kw)
    return init_attention(
        cfg.hidden_size,
        attention_shape(cfg, layer),
        qkv_bias=cfg.attention_bias,
        out_bias=cfg.attention_out_bias,
        qk_norm=cfg.qk_norm,
        **kw,
    )


def _build(cfg: ModelConfig, generator: torch.Generator | None) -> DecoderParams:
    dtype, std = cfg.torch_dtype, cfg.initializer_range
    out_std = std / (2 * cfg.num_hidden_layers) ** 0.5  # residual-output projections (GPT-2 scheme)
    blocks = tuple(
        BlockParams(
            attn_norm=init_rms_norm(cfg.hidden_size, dtype=dtype),
            attn=_init_attn(cfg, layer, std, out_std, generator),
            mlp_norm=init_rms_norm(cfg.hidden_size, dtype=dtype),
            mlp=_init_ffn(cfg, layer, std, out_std, generator),
        )
        for layer in range(cfg.num_hidden_layers)
    )
    lm_head = None
    if not cfg.tie_word_embeddings:
        lm_head = init_linear(cfg.hidden_size, cfg.vocab_size, std=std, generator=generator, dtype=dtype)
    return DecoderParams(
        embed_tokens=init_embedding(cfg.vocab_size, cfg.hidden_size, std=std, generator=generator, dtype=dtype),
        blocks=blocks,
        norm=init_rms_norm(cfg.hidden_size, dtype=dtype),
        lm_head=lm_head,
    )


def init_params(cfg: ModelConfig, *, seed: int = 0, device: torch.device | str | None = None) -> DecoderParams:
    """Random parameters: normal(0, initializer_range), residual outputs scaled by 1/sqrt(2L), unit norms.

    Deterministic for a given seed (built on the CPU with one generator, then moved to `device`).
    """
    check_config(cfg)
    params = _build(cfg, torch.Generator().manual_seed(seed))
    return params if device is None else to_device(params, device)


def init_params_meta(cfg: ModelConfig) -> DecoderParams:
    """A tree of the right structure and shapes on the meta device (no memory, no randomness)."""
    check_config(cfg)
    with torch.device("meta"):
        return _build(cfg, None)


def _positions(tokens: Tensor, positions: Tensor | None, meta: AttnMeta | None) -> Tensor:
    # Flat [N] positions of every input token, row-major.
    if meta is not None:
        return meta.positions
    if positions is not None:
        return positions.reshape(-1)
    batch, seq = tokens.shape
    return torch.arange(seq, device=tokens.device).repeat(batch)


class BlockContext(NamedTuple):
    """What one decoder block reads besides its parameters and the residual stream: built per layer in Python.

    A NamedTuple rather than an attrs tree, so compiled code can build it (fact F2) and activation checkpointing
    passes it through as one argument.

    Attributes:
        layer: index of the block (selects its window and FFN kind on the config).
        cos, sin: [N, rope_dim/2] float32 rotation tables of the N input tokens, row-major.
        meta: paged-step metadata, or None in dense mode.
        cache: this layer's pool view: (k, v) [S, K, D] each, the MLA latent pool [S, R + Dr], or None (dense).
        doc_ids: dense mode only, [B, T] document index per token (packed rows).
        causal: dense mode only; False attends to every (unpadded) key (the embedding encoder).
        key_padding_mask: dense mode only, [B, T] bool, True for real tokens.
        with_aux: return the MoE aux tree of the block.
        tp: tensor parallel group when the block's parameters are this rank's shard (`astrai.models.tp`).
    """

    layer: int
    cos: Tensor
    sin: Tensor
    meta: AttnMeta | None = None
    cache: tuple[Tensor, Tensor] | Tensor | None = None
    doc_ids: Tensor | None = None
    causal: bool = True
    key_padding_mask: Tensor | None = None
    with_aux: bool = False
    tp: TensorParallel | None = None


def layer_cache(cache: KVCache | LatentCache | None, layer: int) -> tuple[Tensor, Tensor] | Tensor | None:
    """The view of `cache` that block `layer` reads and writes (see `BlockContext.cache`)."""
    if cache is None:
        return None
    if isinstance(cache, LatentCache):
        return cache.latent[layer]
    return cache.k[layer], cache.v[layer]


def _block(block: BlockParams, x: Tensor, ctx: BlockContext, *, cfg: ModelConfig) -> tuple[Tensor, MoEAux | None]:
    """One pre-norm block: x + attn(norm(x)), then + ffn(norm(x)); also the MoE aux tree (None for a dense FFN)."""
    eps, tp = cfg.rms_norm_eps, ctx.tp
    # under tensor parallelism each sub-layer is one parallel region: tp_copy in, tp_reduce out (identity else)
    h = tp_copy(rms_norm(block.attn_norm, x, eps=eps), tp)
    if isinstance(block.attn, MLAParams):
        scale = mla_softmax_scale(cfg.mla, cfg.rope)
        y = mla(block.attn, h, ctx.cos, ctx.sin, cfg=cfg.mla, scale=scale, meta=ctx.meta, cache=ctx.cache,
                doc_ids=ctx.doc_ids)  # fmt: skip
    else:
        y = attention(block.attn, h, ctx.cos, ctx.sin, shape=attention_shape(cfg, ctx.layer), meta=ctx.meta,
                      kv=ctx.cache, doc_ids=ctx.doc_ids, causal=ctx.causal,
                      key_padding_mask=ctx.key_padding_mask)  # fmt: skip
    x = x + tp_reduce(y, tp)
    h = tp_copy(rms_norm(block.mlp_norm, x, eps=eps), tp)
    if isinstance(block.mlp, MoEParams):
        y, aux = moe(block.mlp, h, cfg=cfg.moe, with_aux=ctx.with_aux, tp=tp)
        return x + tp_reduce(y, tp), aux
    return x + tp_reduce(mlp(block.mlp, h), tp), None


def _next_unit(params: DecoderParams, layer: int, checkpoint_blocks: bool) -> BlockParams | None:
    # the unit a `run_unit` may prefetch after block `layer` (-1: the embedding); none under checkpointing
    if checkpoint_blocks or layer + 1 >= len(params.blocks):
        return None
    return params.blocks[layer + 1]


def hidden_states(
    params: DecoderParams,
    cfg: ModelConfig,
    tokens: Tensor,
    *,
    meta: AttnMeta | None = None,
    cache: KVCache | LatentCache | None = None,
    positions: Tensor | None = None,
    doc_ids: Tensor | None = None,
    embeds: Tensor | None = None,
    checkpoint_blocks: bool = False,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    return_aux: bool = False,
    run_unit: Callable[..., Any] | None = None,
    tp: TensorParallel | None = None,
) -> Tensor | tuple[Tensor, MoEAux | None]:
    """The residual stream after the last block (before the final norm); same leading shape as `tokens`.

    `return_aux=True` returns `(x, aux)`: the MoE layers' load-balancing sums and router statistics
    (`astrai.nn.moe.MoEAux`, summed over layers), or None for a model without MoE layers.

    Training extras (dense mode): `doc_ids` keeps attention inside each packed document, `embeds` replaces the
    embedding lookup (NEFTune adds noise to it), `checkpoint_blocks` recomputes each block in backward
    (activation checkpointing: stores only the block inputs). Encoder extras (dense mode): `causal=False` runs
    the blocks bidirectionally and `key_padding_mask` ([B, T] bool, True for real tokens) hides padded keys.

    `run_unit(fn, unit_params, *args, checkpoint=bool, next_params=..., **kwargs)`, when given, makes each call of
    the embedding lookup and of every block (`fn(unit_params', *args, **kwargs)`), and owns activation
    checkpointing of the blocks (FSDP per block: `astrai.train.fsdp.BlockGather` gathers each unit's shards for
    that call only); `next_params` is the block that runs next (None for the last, and under checkpointing), so
    the runner can prefetch it.

    `tp`: `params` is this rank's tensor-parallel shard and `cfg` its local config (`astrai.models.tp`); the
    result is the full residual stream, the same on every rank.
    """
    if (meta is None) != (cache is None):
        raise ValueError("pass meta and cache together (paged mode) or neither (dense mode)")
    if cache is None and tokens.dim() != 2:
        raise ValueError(f"dense mode expects tokens [B, T], got shape {tuple(tokens.shape)}")
    if cache is not None and tokens.dim() != 1:
        raise ValueError(f"paged mode expects flattened tokens [T], got shape {tuple(tokens.shape)}")
    if cache is not None and doc_ids is not None:
        raise ValueError("doc_ids is for dense (training) mode; paged requests are already separate")
    if cache is not None and (not causal or key_padding_mask is not None):
        raise ValueError("causal=False and key_padding_mask are for dense mode (no KV cache)")
    if cfg.attn_type == "mla" and (not causal or key_padding_mask is not None):
        raise ValueError("MLA models run causally only (causal=False / key_padding_mask are not supported)")
    if cache is not None and isinstance(cache, LatentCache) != (cfg.attn_type == "mla"):
        raise ValueError(
            f"attn_type {cfg.attn_type!r} needs a {'LatentCache' if cfg.attn_type == 'mla' else 'KVCache'}"
        )
    cos, sin = rope_cos_sin(
        _positions(tokens, positions, meta),
        rope=cfg.rope,
        head_dim=cfg.rope_dim,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    if embeds is not None:
        x = embeds
    else:
        x = (
            embed(params.embed_tokens, tokens, tp)
            if run_unit is None
            else run_unit(embed, params.embed_tokens, tokens, next_params=_next_unit(params, -1, checkpoint_blocks))
        )
    aux = None
    for layer, block in enumerate(params.blocks):
        ctx = BlockContext(layer=layer, cos=cos, sin=sin, meta=meta, cache=layer_cache(cache, layer), doc_ids=doc_ids,
                           causal=causal, key_padding_mask=key_padding_mask, with_aux=return_aux, tp=tp)  # fmt: skip
        if run_unit is not None:
            x, layer_aux = run_unit(_block, block, x, ctx, checkpoint=checkpoint_blocks, cfg=cfg,
                                    next_params=_next_unit(params, layer, checkpoint_blocks))  # fmt: skip
        elif checkpoint_blocks:
            x, layer_aux = torch.utils.checkpoint.checkpoint(_block, block, x, ctx, cfg=cfg, use_reentrant=False)
        else:
            x, layer_aux = _block(block, x, ctx, cfg=cfg)
        aux = add_aux(aux, layer_aux)
    return (x, aux) if return_aux else x


def lm_head_weight(params: DecoderParams) -> Tensor:
    """[V, E] output projection (the embedding when tied)."""
    return params.embed_tokens.weight if params.lm_head is None else params.lm_head.weight


def head_logits(params: DecoderParams, x: Tensor) -> Tensor:
    """[..., E] final-normed hidden rows -> [..., V] fp32 logits (tied or not, int8 weight-only or not)."""
    head = params.embed_tokens if params.lm_head is None else params.lm_head
    bias = None if params.lm_head is None else params.lm_head.bias
    return linear_op(x, head.weight, bias, head.scale).float()


def projection_groups(params: DecoderParams) -> list[tuple[Tensor, ...]]:
    """The 2-D float weights `linear` multiplies by, grouped as the model multiplies them: q/k/v and gate/up
    of each block together (when plain: `nn.linear.linear_group`), every other projection alone, and the
    embedding when it is the tied head. What the CPU engine packs for oneDNN (`astrai.ops.packed_linear`);
    int8 weights are left out."""
    groups: list[tuple[Tensor, ...]] = []

    def walk(node: Any) -> None:
        if isinstance(node, AttentionParams | MLPParams):
            fused = (node.q_proj, node.k_proj, node.v_proj) if isinstance(node, AttentionParams) else (
                node.gate_proj, node.up_proj)  # fmt: skip
            if all(plain(p) for p in fused):
                groups.append(tuple(p.weight for p in fused))
                walk(node.o_proj if isinstance(node, AttentionParams) else node.down_proj)
                return
        if isinstance(node, LinearParams):
            if node.weight.is_floating_point() and node.weight.dim() == 2:
                groups.append((node.weight,))
        elif type(node) is tuple:
            for child in node:
                walk(child)
        elif attrs.has(type(node)):
            for field in attrs.fields(type(node)):
                walk(getattr(node, field.name))

    walk(params.blocks)
    head = params.embed_tokens if params.lm_head is None else params.lm_head
    if head.weight.is_floating_point():
        groups.append((head.weight,))
    return groups


def projection_weights(params: DecoderParams) -> list[Tensor]:
    """Every weight of `projection_groups`, flat."""
    return [w for group in projection_groups(params) for w in group]


def forward(
    params: DecoderParams,
    cfg: ModelConfig,
    tokens: Tensor,
    *,
    positions: Tensor | None = None,
    meta: AttnMeta | None = None,
    cache: KVCache | LatentCache | None = None,
    logits_positions: Tensor | None = None,
    tp: TensorParallel | None = None,
) -> Tensor:
    """Next-token logits.

    Args:
        params: parameter tree.
        cfg: model config.
        tokens: [B, T] (dense: causal over each row, no cache) or [T] (paged: flattened new tokens).
        positions: dense mode only, [B, T] position ids (default 0..T-1 per row).
        meta: paged-step metadata (with `cache`).
        cache: KV pool; new K/V are written in place.
        logits_positions: [M] int rows of the flattened tokens to compute logits for.
        tp: tensor parallel group when `params` is this rank's shard and `cfg` its local config
            (`astrai.models.tp`); the vocab-parallel logits are gathered, so every rank returns the full row.

    Returns:
        float32 logits: [B, T, V] (dense), [T, V] (paged) or [M, V] with `logits_positions`.
    """
    x = hidden_states(params, cfg, tokens, positions=positions, meta=meta, cache=cache, tp=tp)
    if logits_positions is not None:
        x = x.reshape(-1, x.shape[-1])[logits_positions]  # [M, E]
    x = tp_copy(rms_norm(params.norm, x, eps=cfg.rms_norm_eps), tp)
    logits = head_logits(params, x)
    if tp is not None and tp.size > 1:  # vocab-parallel head: gather the slices, drop the padding rows
        logits = tp_gather(logits, tp)[..., : cfg.vocab_size]
    return logits


def check_params(params: DecoderParams, cfg: ModelConfig) -> None:
    """Raise ValueError naming the first tensor whose shape disagrees with `cfg` (init and load validate)."""
    expected = named_tensors(init_params_meta(cfg))
    actual = named_tensors(params)
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            raise ValueError(f"parameter {name!r} is missing")
        if name not in expected:
            raise ValueError(f"unexpected parameter {name!r} for this config")
        if tuple(actual[name].shape) != tuple(expected[name].shape):
            raise ValueError(
                f"parameter {name!r} has shape {tuple(actual[name].shape)}, expected {tuple(expected[name].shape)}"
            )

"""Tensor-parallel layout: `tp_config`, `shard_params`, `shard_lora`, `unshard_params`, `region_replicated`.

A rank runs the ordinary decoder functions on its shard with its *local* config (heads, MLP width and shared
expert width divided by the group size), plus three collectives (`astrai.ops.collectives`) at known places:
the block's two sub-layers are parallel regions (`tp_copy` on the normed input, `tp_reduce` on the output),
the embedding and LM head are vocab-parallel. Layout per leaf (Megatron-style):

| leaf | split |
|---|---|
| q/k/v, gate/up, MLA q_proj/q_b_proj/kv_b_proj | column-parallel: output rows, by head (rows of this rank's heads) |
| o_proj, down_proj | row-parallel: input columns; their bias lives on rank 0 only (added once before the sum) |
| k/v with fewer KV heads than ranks | each rank keeps the one KV head its query heads read (replicated) |
| MoE routed experts | expert parallel: experts [r E/N, (r+1) E/N) on rank r; shared expert as an MLP |
| embedding, LM head | vocab rows [r V_r, (r+1) V_r), V_r = ceil(V / N); the last shard is zero-padded |
| norms, router, MLA down-projections, qk-norm | replicated |

Replicated leaves *inside* a region (`region_replicated`: qk-norm, the router and its bias, the shared expert
gate, MLA's q_a/kv_a projections and norms) only see this rank's heads or experts, so their gradient is a
partial sum: training sums them over the ranks (`reduce_partial_grads`, which also sums a KV head replicated
over several ranks); every other replicated leaf already gets the full gradient.
The MLA latent cache is replicated (each rank writes the same latent), as in vLLM.

LoRA adapters (multi-LoRA serving, `shard_lora`) split like their base linear, so a rank's update touches only its
own rows or columns: a column-parallel projection's B [out, r] is cut by output rows exactly as the weight (k/v by
the KV-head rule) and its A is replicated; a row-parallel projection's A [r, in] is cut by input columns and its B
is replicated. A row-parallel rank then adds the partial update x_r A_r^T B^T to its partial product before the
sub-layer's `tp_reduce`, which sums both once: sum_r x_r A_r^T = x A^T.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from astrai.models.config import ModelConfig
from astrai.models.decoder import BlockParams, DecoderParams
from astrai.nn.attention import AttentionParams
from astrai.nn.linear import LinearParams, LoRALinearParams
from astrai.nn.lora import LoRAAdapter, LoRAParams
from astrai.nn.mla import MLAParams
from astrai.nn.mlp import MLPParams
from astrai.nn.moe import MoEParams
from astrai.ops.collectives import TensorParallel, all_reduce_
from astrai.tree import leaves, tree_map

__all__ = [
    "check_tp",
    "reduce_partial_grads",
    "region_replicated",
    "shard_lora",
    "shard_params",
    "tp_config",
    "unshard_params",
    "vocab_rows",
]


def check_tp(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError naming the dimension that `size` ranks cannot split."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    needs = [("num_attention_heads", heads), ("intermediate_size", cfg.intermediate_size)]
    if cfg.moe is not None:
        needs.append(("moe.num_experts", cfg.moe.num_experts))
        if cfg.moe.shared_expert_intermediate_size:
            needs.append(("moe.shared_expert_intermediate_size", cfg.moe.shared_expert_intermediate_size))
    for name, value in needs:
        if value % size:
            raise ValueError(f"tensor-parallel size {size} must divide {name} ({value})")
    if cfg.attn_type == "gqa" and kv % size and size % kv:
        raise ValueError(
            f"tensor-parallel size {size} and num_key_value_heads ({kv}) must divide one another "
            "(KV heads are split, or replicated when there are fewer than ranks)"
        )


def tp_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's shard runs with: heads, KV heads, MLP and shared-expert widths divided by `size`."""
    check_tp(cfg, size)
    if size == 1:
        return cfg
    changes: dict = {
        "num_attention_heads": cfg.num_attention_heads // size,
        "num_key_value_heads": max(cfg.num_key_value_heads // size, 1),
        "intermediate_size": cfg.intermediate_size // size,
    }
    if cfg.mla is not None:
        changes["mla"] = attrs.evolve(cfg.mla, num_heads=cfg.mla.num_heads // size)
    if cfg.moe is not None and cfg.moe.shared_expert_intermediate_size:
        shared = cfg.moe.shared_expert_intermediate_size // size
        changes["moe"] = attrs.evolve(cfg.moe, shared_expert_intermediate_size=shared)
    return attrs.evolve(cfg, **changes)


def vocab_rows(cfg: ModelConfig, size: int) -> int:
    """Vocab rows per rank of the embedding and LM head: ceil(V / size)."""
    return -(-cfg.vocab_size // size)


def _chunk(t: Tensor | None, dim: int, rank: int, size: int) -> Tensor | None:
    return None if t is None else t.chunk(size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


def _column(p: LinearParams, rank: int, size: int) -> LinearParams:
    return LinearParams(weight=_chunk(p.weight, 0, rank, size), bias=_chunk(p.bias, 0, rank, size),
                        scale=_chunk(p.scale, 0, rank, size))  # fmt: skip


def _row(p: LinearParams, rank: int, size: int) -> LinearParams:
    # an int8 weight's per-output-row scale applies to every rank's partial product: each rank keeps all of it
    return LinearParams(weight=_chunk(p.weight, 1, rank, size), bias=p.bias if rank == 0 else None, scale=p.scale)


def _kv_pick(t: Tensor | None, cfg: ModelConfig, rank: int, size: int) -> Tensor | None:
    """The rows of a K/V output tensor this rank keeps: its KV heads, or (fewer KV heads than ranks) the one head
    its query heads read."""
    if t is None or cfg.num_key_value_heads >= size:
        return _chunk(t, 0, rank, size)
    head = rank * (cfg.num_attention_heads // size) // cfg.q_per_kv
    return t[head * cfg.head_dim : (head + 1) * cfg.head_dim].clone()


def _kv_rows(p: LinearParams, cfg: ModelConfig, rank: int, size: int) -> LinearParams:
    pick = lambda t: _kv_pick(t, cfg, rank, size)  # noqa: E731
    return LinearParams(weight=pick(p.weight), bias=pick(p.bias), scale=pick(p.scale))


def _vocab(t: Tensor | None, cfg: ModelConfig, rank: int, size: int) -> Tensor | None:
    if t is None:
        return None
    rows = vocab_rows(cfg, size)
    padded = torch.zeros(rows * size, *t.shape[1:], dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    return padded[rank * rows : (rank + 1) * rows].clone()


def _shard_attn(p: AttentionParams | MLAParams, cfg: ModelConfig, rank: int, size: int):
    if isinstance(p, MLAParams):
        return attrs.evolve(
            p,
            q_proj=None if p.q_proj is None else _column(p.q_proj, rank, size),
            q_b_proj=None if p.q_b_proj is None else _column(p.q_b_proj, rank, size),
            kv_b_proj=_column(p.kv_b_proj, rank, size),
            o_proj=_row(p.o_proj, rank, size),
        )
    return attrs.evolve(
        p,
        q_proj=_column(p.q_proj, rank, size),
        k_proj=_kv_rows(p.k_proj, cfg, rank, size),
        v_proj=_kv_rows(p.v_proj, cfg, rank, size),
        o_proj=_row(p.o_proj, rank, size),
    )


def _shard_mlp(p: MLPParams, rank: int, size: int) -> MLPParams:
    return MLPParams(
        gate_proj=_column(p.gate_proj, rank, size),
        up_proj=_column(p.up_proj, rank, size),
        down_proj=_row(p.down_proj, rank, size),
    )


def _shard_ffn(p: MLPParams | MoEParams, rank: int, size: int) -> MLPParams | MoEParams:
    if isinstance(p, MLPParams):
        return _shard_mlp(p, rank, size)
    e = p.experts
    return attrs.evolve(
        p,
        experts=tree_map(lambda t: _chunk(t, 0, rank, size), e),  # experts (and their int8 scales) by rank
        shared_experts=None if p.shared_experts is None else _shard_mlp(p.shared_experts, rank, size),
    )


def shard_params(params: DecoderParams, cfg: ModelConfig, tp: TensorParallel) -> DecoderParams:
    """This rank's shard of a full parameter tree (new tensors; `params` is left as it is).

    Refuses LoRA trees (serving splits adapters on their own: `shard_lora`). Run it with `tp_config(cfg, tp.size)`
    as the config.
    """
    check_tp(cfg, tp.size)
    if any(isinstance(leaf, LoRALinearParams) for leaf in _linears(params)):
        raise ValueError("tensor parallelism does not split LoRA adapters yet: merge them first (astrai.io.lora)")
    rank, size = tp.rank, tp.size
    if size == 1:
        return params
    blocks = tuple(
        BlockParams(
            attn_norm=b.attn_norm,
            attn=_shard_attn(b.attn, cfg, rank, size),
            mlp_norm=b.mlp_norm,
            mlp=_shard_ffn(b.mlp, rank, size),
        )
        for b in params.blocks
    )
    head = params.lm_head
    if head is not None:
        head = tree_map(lambda t: _vocab(t, cfg, rank, size), head)  # weight, bias and int8 scale by vocab row
    return DecoderParams(
        embed_tokens=tree_map(lambda t: _vocab(t, cfg, rank, size), params.embed_tokens),
        blocks=blocks,
        norm=params.norm,
        lm_head=head,
    )


_LORA_SPLIT = {"q_proj": "column", "gate_proj": "column", "up_proj": "column", "k_proj": "kv", "v_proj": "kv",
               "o_proj": "row", "down_proj": "row"}  # fmt: skip


def shard_lora(lora: LoRAParams, cfg: ModelConfig, tp: TensorParallel) -> LoRAParams:
    """This rank's part of adapter `lora` (key path -> factors, as `astrai.io.lora.load_lora` reads it against the
    full tree): split like the projection it adapts (module docstring); new tensors, on `lora`'s devices.

    Raises:
        ValueError: the adapter targets a projection that tensor parallel does not split by name.
    """
    if tp.size == 1:
        return lora
    rank, size, out = tp.rank, tp.size, {}
    for path, ad in lora.items():
        split = _LORA_SPLIT.get(path.rpartition(".")[2])
        if split is None:
            raise ValueError(f"tensor parallelism does not know how to split a LoRA adapter on {path}")
        a, b = ad.lora_a, ad.lora_b
        if split == "column":
            b = _chunk(b, 0, rank, size)
        elif split == "kv":
            b = _kv_pick(b, cfg, rank, size)
        else:
            a = _chunk(a, 1, rank, size)
        out[path] = LoRAAdapter(lora_a=a, lora_b=b, scaling=ad.scaling)
    return out


def _linears(tree: object) -> list[LinearParams]:
    found: list[LinearParams] = []

    def walk(node: object) -> None:
        if isinstance(node, LinearParams):
            found.append(node)
        elif attrs.has(type(node)):
            for field in attrs.fields(type(node)):
                walk(getattr(node, field.name))
        elif isinstance(node, tuple):
            for item in node:
                walk(item)

    walk(tree)
    return found


def reduce_partial_grads(grads: DecoderParams, cfg: ModelConfig, tp: TensorParallel) -> None:
    """Finish the gradients of replicated leaves inside a parallel region, in place (`grads` mirrors the shard).

    `region_replicated` leaves are summed over all ranks; a KV projection replicated over the ranks that share
    its head (fewer KV heads than ranks) is summed over those ranks only.
    """
    if tp.size == 1:
        return
    all_reduce_(region_replicated(grads), tp)
    share = tp.size // cfg.num_key_value_heads if cfg.attn_type == "gqa" else 1
    if share <= 1:
        return
    first = tp.rank // share * share  # the ranks [first, first + share) hold the same KV head
    for b in grads.blocks:
        for t in leaves((b.attn.k_proj, b.attn.v_proj)):
            if isinstance(t, Tensor):
                parts = [torch.empty_like(t) for _ in range(tp.size)]
                dist.all_gather(parts, t.contiguous(), group=tp.group)
                t.copy_(torch.stack(parts[first : first + share]).sum(0))


def region_replicated(shard: DecoderParams) -> list[Tensor]:
    """Replicated leaves that sit inside a parallel region: their gradients are partial sums over the ranks."""
    out: list[Tensor] = []
    for b in shard.blocks:
        a = b.attn
        if isinstance(a, MLAParams):
            out += leaves((a.q_a_proj, a.q_a_layernorm, a.kv_a_proj_with_mqa, a.kv_a_layernorm))
        else:
            out += leaves((a.q_norm, a.k_norm))
        if isinstance(b.mlp, MoEParams):
            out += leaves((b.mlp.gate, b.mlp.e_score_correction_bias, b.mlp.shared_expert_gate))
    return [t for t in out if isinstance(t, Tensor)]


def _gather(t: Tensor, dim: int, tp: TensorParallel) -> Tensor:
    parts = [torch.empty_like(t) for _ in range(tp.size)]
    dist.all_gather(parts, t.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


def _gather_linear(p: LinearParams, dim: int, tp: TensorParallel) -> LinearParams:
    if dim == 1:  # row-parallel: the bias lives on rank 0 only
        box = [p.bias]
        dist.broadcast_object_list(box, group=tp.group, group_src=0)  # the group's rank 0, not the world's
        bias = box[0]
    else:
        bias = None if p.bias is None else _gather(p.bias, 0, tp)
    scale = p.scale if dim == 1 or p.scale is None else _gather(p.scale, 0, tp)
    return LinearParams(weight=_gather(p.weight, dim, tp), bias=bias, scale=scale)


def unshard_params(shard: DecoderParams, cfg: ModelConfig, tp: TensorParallel) -> DecoderParams:
    """The full tree rebuilt from every rank's shard (a collective: all ranks call it; all get the tree).

    Row-parallel biases are broadcast from rank 0. KV projections replicated over ranks are taken once per KV head.
    """
    if tp.size == 1:
        return shard
    v, size = cfg.vocab_size, tp.size
    kv_step = max(size // cfg.num_key_value_heads, 1)  # ranks that share one KV head

    def kv(p: LinearParams) -> LinearParams:
        full = _gather_linear(p, 0, tp)
        if kv_step == 1:
            return full
        pick = lambda t: None if t is None else torch.cat(t.chunk(size, 0)[::kv_step])  # noqa: E731
        return LinearParams(weight=pick(full.weight), bias=pick(full.bias), scale=pick(full.scale))

    def mlp_full(p: MLPParams) -> MLPParams:
        return MLPParams(*(_gather_linear(x, d, tp) for x, d in ((p.gate_proj, 0), (p.up_proj, 0), (p.down_proj, 1))))

    blocks = []
    for b in shard.blocks:
        a = b.attn
        if isinstance(a, MLAParams):
            attn = attrs.evolve(
                a,
                q_proj=None if a.q_proj is None else _gather_linear(a.q_proj, 0, tp),
                q_b_proj=None if a.q_b_proj is None else _gather_linear(a.q_b_proj, 0, tp),
                kv_b_proj=_gather_linear(a.kv_b_proj, 0, tp),
                o_proj=_gather_linear(a.o_proj, 1, tp),
            )
        else:
            attn = attrs.evolve(a, q_proj=_gather_linear(a.q_proj, 0, tp), k_proj=kv(a.k_proj),
                                v_proj=kv(a.v_proj), o_proj=_gather_linear(a.o_proj, 1, tp))  # fmt: skip
        ffn = b.mlp
        if isinstance(ffn, MLPParams):
            ffn = mlp_full(ffn)
        else:
            e = ffn.experts
            ffn = attrs.evolve(
                ffn,
                experts=tree_map(lambda t: _gather(t, 0, tp), e),
                shared_experts=None if ffn.shared_experts is None else mlp_full(ffn.shared_experts),
            )
        blocks.append(BlockParams(attn_norm=b.attn_norm, attn=attn, mlp_norm=b.mlp_norm, mlp=ffn))
    head = shard.lm_head
    if head is not None:
        head = tree_map(lambda t: _gather(t, 0, tp)[:v], head)
    embed = tree_map(lambda t: _gather(t, 0, tp)[:v], shard.embed_tokens)
    return DecoderParams(embed_tokens=embed, blocks=tuple(blocks), norm=shard.norm, lm_head=head)

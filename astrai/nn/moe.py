"""Mixture-of-Experts feed-forward: `MoEConfig`, `MoEParams`, `moe()` and its aux tree `MoEAux`.

Routing (per token, over E experts, choosing k; `logits = x @ gate.T`), as transformers does it:
- softmax (qwen2_moe, qwen3_moe, mixtral): p = softmax(logits) in fp32; experts = top-k(p);
  w = p[experts] (/ sum when `norm_topk_prob`) * routed_scaling_factor.
- sigmoid (DeepSeek-V3 "noaux_tc"): s = sigmoid(logits) in fp32; the choice uses s + e_score_correction_bias;
  with `n_group` > 1 only the `topk_group` groups with the largest sum of their top-2 choice scores are eligible;
  w = s[experts] (/ (sum + 1e-20) when `norm_topk_prob`) * routed_scaling_factor.
Output: sum_j w_j * expert_j(x) (SwiGLU experts) + shared experts (qwen2_moe: times sigmoid(shared_expert_gate x)).

Dispatch is grouped: the N*k (token, slot) pairs are sorted by expert, each expert runs once on its contiguous
segment (a loop over experts, never over tokens) and results are combined with `index_add`. Segment sizes are
data-dependent, so under `torch.compile` the expert part is the custom op `astrai::moe_experts` (static output
shape; its backward op `grouped_experts_backward` recomputes each expert's activations, as activation
checkpointing does, and applies the SwiGLU chain rule by hand). Inference on the Triton backend (CUDA) skips all
that: `astrai.ops.moe.fused_experts` keeps the bookkeeping on the device, so MoE decode steps can be graphed.

Load-balancing loss (switch-transformer, exactly transformers' `load_balancing_loss_func` over all MoE layers):
f_i = (top-k slots given to expert i, summed over layers) / (tokens summed over layers), P_i = (p_i summed over
tokens and layers) / (the same token count); loss = E * sum_i f_i * P_i, which is k under perfect balance.
The sums live in `MoEAux`; `load_balancing_loss` finishes the formula.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.nn.linear import LinearParams, init_linear, linear
from astrai.nn.mlp import MLPParams, init_mlp, mlp
from astrai.ops.collectives import TensorParallel
from astrai.ops.linear import linear as linear_op
from astrai.ops.moe import fused_experts, use_fused_experts
from astrai.tree import pytree, tree_map


@attrs.frozen(kw_only=True)
class MoEConfig:
    """Static MoE hyperparameters (routing, expert sizes, which layers are sparse)."""

    num_experts: int
    """Routed experts per MoE layer (E)."""
    num_experts_per_tok: int
    """Experts each token is sent to (k)."""
    moe_intermediate_size: int
    """SwiGLU hidden width of one routed expert."""
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    """Router score function: softmax (qwen/mixtral) or sigmoid (DeepSeek-V3)."""
    norm_topk_prob: bool = False
    """Renormalise the k chosen weights to sum to 1 (mixtral: always)."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the routed weights (DeepSeek)."""
    n_group: int = 1
    """Expert groups for grouped top-k (DeepSeek); 1 disables grouping."""
    topk_group: int = 1
    """Groups a token may pick experts from (grouped top-k)."""
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    """How a group is ranked: the sum of its two best scores (DeepSeek-V3 noaux_tc) or its best score (V2
    group_limited_greedy)."""
    e_score_correction_bias: bool = False
    """Learned per-expert bias added to the scores only for the choice (DeepSeek-V3 noaux_tc)."""
    shared_expert_intermediate_size: int = 0
    """Hidden width of the always-on shared expert MLP (0: none)."""
    shared_expert_gate: bool = False
    """Scale the shared expert by sigmoid(x @ shared_expert_gate.T) (qwen2_moe)."""
    first_k_dense_replace: int = 0
    """The first k layers use the dense MLP (DeepSeek)."""
    decoder_sparse_step: int = 1
    """Layer l is sparse when (l + 1) % step == 0 (qwen2_moe/qwen3_moe)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers forced to the dense MLP (qwen2_moe/qwen3_moe)."""
    router_aux_loss_coef: float = 0.001
    """transformers' weight of the load-balancing loss (kept for config.json round trips)."""

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer` uses the MoE block (else the dense MLP)."""
        if layer in self.mlp_only_layers or layer < self.first_k_dense_replace:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0


def check_moe_config(cfg: MoEConfig) -> None:
    """Raise ValueError naming the MoEConfig field that is inconsistent."""
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"MoEConfig.{name} must be positive, got {getattr(cfg, name)}")
    if cfg.decoder_sparse_step <= 0:
        raise ValueError(f"MoEConfig.decoder_sparse_step must be positive, got {cfg.decoder_sparse_step}")
    if cfg.scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"MoEConfig.scoring must be 'softmax' or 'sigmoid', got {cfg.scoring!r}")
    if cfg.num_experts % cfg.n_group:
        raise ValueError(f"MoEConfig.n_group ({cfg.n_group}) must divide num_experts ({cfg.num_experts})")
    if cfg.topk_group > cfg.n_group:
        raise ValueError(f"MoEConfig.topk_group ({cfg.topk_group}) must be <= n_group ({cfg.n_group})")
    eligible = cfg.topk_group * (cfg.num_experts // cfg.n_group) if cfg.n_group > 1 else cfg.num_experts
    if cfg.num_experts_per_tok > eligible:
        raise ValueError(
            f"MoEConfig.num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds the {eligible} eligible experts"
        )
    if cfg.n_group > 1 and cfg.num_experts // cfg.n_group < 2:
        raise ValueError("grouped top-k scores each group by its top-2 experts: need >= 2 experts per group")
    if cfg.shared_expert_gate and cfg.shared_expert_intermediate_size <= 0:
        raise ValueError("MoEConfig.shared_expert_gate needs shared_expert_intermediate_size > 0")


@pytree
@attrs.frozen(eq=False)
class ExpertsParams:
    """Routed SwiGLU experts stacked on a leading expert axis (so dispatch is one gather and E segments)."""

    gate_proj: Tensor  # [E, F, D]; int8 when the scales are set
    up_proj: Tensor  # [E, F, D]
    down_proj: Tensor  # [E, D, F]
    # int8 weight-only quantization (`astrai.models.quantize`): per-expert, per-output-row scales
    gate_scale: Tensor | None = None  # [E, F]
    up_scale: Tensor | None = None  # [E, F]
    down_scale: Tensor | None = None  # [E, D]


@pytree
@attrs.frozen(eq=False)
class MoEParams:
    """Router, optional routing bias, stacked experts, optional shared expert and its gate."""

    gate: LinearParams  # router weight [E, D]
    experts: ExpertsParams
    e_score_correction_bias: Tensor | None = None  # [E]
    shared_experts: MLPParams | None = None
    shared_expert_gate: LinearParams | None = None  # [1, D]


@pytree
@attrs.frozen(eq=False)
class MoEAux:
    """Per-model sums over MoE layers: load-balancing terms and router statistics (fp32 tensors, no syncs)."""

    tokens_per_expert: Tensor  # [E] top-k assignments per expert, summed over layers
    router_prob: Tensor  # [E] routing probabilities summed over tokens and layers
    rows: Tensor  # [] tokens summed over layers
    entropy: Tensor  # [] sum over layers of the mean routing entropy (nats)
    load_max: Tensor  # [] sum over layers of max_i count_i / (N k / E)
    dead_fraction: Tensor  # [] sum over layers of the fraction of experts that got no token
    layers: Tensor  # [] number of MoE layers summed


def add_aux(a: MoEAux | None, b: MoEAux | None) -> MoEAux | None:
    """Field-wise sum of two aux trees (None is the empty sum); safe inside compiled code."""
    if a is None or b is None:
        return b if a is None else a
    return tree_map(torch.add, a, b)


def load_balancing_loss(aux: MoEAux) -> Tensor:
    """transformers' switch-transformer loss E * sum_i f_i P_i with f, P pooled over layers and tokens."""
    rows = aux.rows.clamp(min=1.0)
    return aux.tokens_per_expert.numel() * torch.sum((aux.tokens_per_expert / rows) * (aux.router_prob / rows))


def router_stats(aux: MoEAux) -> dict[str, Tensor]:
    """Layer-averaged router statistics: entropy (nats), load max (1 = balanced), dead-expert fraction."""
    layers = aux.layers.clamp(min=1.0)
    return {
        "moe_aux_loss": load_balancing_loss(aux),
        "moe_entropy": aux.entropy / layers,
        "moe_load_max": aux.load_max / layers,
        "moe_dead_fraction": aux.dead_fraction / layers,
    }


def init_moe(
    dim: int,
    cfg: MoEConfig,
    *,
    std: float = 0.02,
    out_std: float | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> MoEParams:
    """Normal init (router and experts `std`, expert/shared down projections `out_std`), zero routing bias."""
    check_moe_config(cfg)
    out_std = std if out_std is None else out_std
    e, f = cfg.num_experts, cfg.moe_intermediate_size

    def normal(*shape: int, s: float) -> Tensor:
        return torch.empty(*shape, dtype=torch.float32).normal_(0.0, s, generator=generator).to(dtype)

    shared = shared_gate = None
    if cfg.shared_expert_intermediate_size > 0:
        shared = init_mlp(
            dim, cfg.shared_expert_intermediate_size, std=std, out_std=out_std, generator=generator, dtype=dtype
        )
    if cfg.shared_expert_gate:
        shared_gate = init_linear(dim, 1, std=std, generator=generator, dtype=dtype)
    return MoEParams(
        gate=init_linear(dim, e, std=std, generator=generator, dtype=dtype),
        experts=ExpertsParams(
            gate_proj=normal(e, f, dim, s=std), up_proj=normal(e, f, dim, s=std), down_proj=normal(e, dim, f, s=out_std)
        ),
        e_score_correction_bias=torch.zeros(e, dtype=dtype) if cfg.e_score_correction_bias else None,
        shared_experts=shared,
        shared_expert_gate=shared_gate,
    )


def route(logits: Tensor, cfg: MoEConfig, bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Router logits [N, E] -> (weights [N, k] fp32, expert ids [N, k], routing probabilities [N, E] fp32)."""
    k = cfg.num_experts_per_tok
    if cfg.scoring == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    else:
        scores = torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias.float()
    if cfg.n_group > 1:
        n = choice.shape[0]
        grouped = choice.view(n, cfg.n_group, -1)
        if cfg.group_score == "max":
            group_scores = grouped.max(dim=-1).values  # [N, G]
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_idx, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, -1)
    idx = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, idx)
    if cfg.norm_topk_prob:
        eps = 1e-20 if cfg.scoring == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    weights = weights * cfg.routed_scaling_factor
    probs = scores if cfg.scoring == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return weights, idx, probs


def _dispatch(idx: Tensor, num_experts: int) -> tuple[Tensor, list[int]]:
    """(pair order sorted by expert, pairs per expert); pairs with id `num_experts` (not ours) are left out."""
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    sizes = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    return order[: sum(sizes)], sizes


def grouped_experts(
    x: Tensor,
    idx: Tensor,
    weights: Tensor,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
    scales: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """sum_j weights[:, j] * expert_{idx[:, j]}(x) for x [N, D]: sort pairs by expert, one GEMM pair per expert.

    An id equal to the number of experts (`gate_proj.shape[0]`) marks a pair this rank does not own (expert
    parallel: the expert lives on another rank); such pairs contribute nothing here.

    `scales` (gate, up, down), when given, are the per-row scales of int8 expert weights (`astrai.ops.quant`).

    Eager only (segment sizes go to the host); `experts()` picks the compile-safe custom op when tracing.
    """
    n, k = idx.shape
    order, sizes = _dispatch(idx, gate_proj.shape[0])
    token = order // k
    xs = x[token]
    outs = []
    for e, seg in enumerate(torch.split(xs, sizes)):
        if seg.shape[0] == 0:
            continue
        gs, us, ds = (None, None, None) if scales is None else (s[e] for s in scales)
        h = F.silu(linear_op(seg, gate_proj[e], None, gs)) * linear_op(seg, up_proj[e], None, us)
        outs.append(linear_op(h, down_proj[e], None, ds))
    if not outs:
        return torch.zeros_like(x)
    ys = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
    return torch.zeros_like(x).index_add(0, token, ys)


@torch.library.custom_op("astrai::moe_experts", mutates_args=())
def _experts_op(
    x: Tensor, idx: Tensor, weights: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor
) -> Tensor:
    return grouped_experts(x, idx, weights, gate_proj, up_proj, down_proj)


@_experts_op.register_fake
def _(x: Tensor, idx: Tensor, weights: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> Tensor:
    return torch.empty_like(x)


def grouped_experts_backward(
    grad: Tensor, x: Tensor, idx: Tensor, weights: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `grouped_experts` w.r.t. (x, weights, gate_proj, up_proj, down_proj), written out by hand.

    Recomputes each expert's activations on its segment (nothing is saved between forward and backward).
    """
    n, k = idx.shape
    order, sizes = _dispatch(idx, gate_proj.shape[0])
    token = order // k
    xs, gos, ws = x[token], grad[token], weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
    gx_pairs, gw_pairs = torch.zeros_like(xs), torch.zeros(order.shape[0], dtype=x.dtype, device=x.device)
    g_gate, g_up, g_down = torch.zeros_like(gate_proj), torch.zeros_like(up_proj), torch.zeros_like(down_proj)
    start = 0
    for e, size in enumerate(sizes):
        if size == 0:
            continue
        sl = slice(start, start + size)
        seg, go, w = xs[sl], gos[sl], ws[sl]
        g, u = F.linear(seg, gate_proj[e]), F.linear(seg, up_proj[e])
        sig = torch.sigmoid(g)
        a = g * sig
        h = a * u
        gw_pairs[sl] = (go * F.linear(h, down_proj[e])).sum(-1)
        gy = go * w
        g_down[e] = gy.T @ h
        gh = gy @ down_proj[e]
        dg = gh * u * (sig * (1 + g * (1 - sig)))
        du = gh * a
        g_gate[e], g_up[e] = dg.T @ seg, du.T @ seg
        gx_pairs[sl] = dg @ gate_proj[e] + du @ up_proj[e]
        start += size
    gx = torch.zeros_like(x).index_add(0, token, gx_pairs)
    gw = torch.zeros(n * k, dtype=weights.dtype, device=x.device).index_copy(0, order, gw_pairs.to(weights.dtype))
    return gx, gw.view(n, k), g_gate, g_up, g_down


@torch.library.custom_op("astrai::moe_experts_backward", mutates_args=())
def _experts_backward_op(
    grad: Tensor, x: Tensor, idx: Tensor, weights: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return grouped_experts_backward(grad, x, idx, weights, gate_proj, up_proj, down_proj)


@_experts_backward_op.register_fake
def _(grad: Tensor, x: Tensor, idx: Tensor, weights: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor):
    return tuple(torch.empty_like(t) for t in (x, weights, gate_proj, up_proj, down_proj))


def _setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    x, idx, weights, gate_proj, up_proj, down_proj = ctx.saved_tensors
    gx, gw, gg, gu, gd = _experts_backward_op(grad.contiguous(), x, idx, weights, gate_proj, up_proj, down_proj)
    return gx, None, gw, gg, gu, gd


_experts_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("astrai::moe_experts_int8", mutates_args=())
def _int8_experts_op(
    x: Tensor,
    idx: Tensor,
    weights: Tensor,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
    gate_scale: Tensor,
    up_scale: Tensor,
    down_scale: Tensor,
) -> Tensor:
    """`grouped_experts` over int8 expert weights (inference only: quantized trees are not trained)."""
    return grouped_experts(x, idx, weights, gate_proj, up_proj, down_proj, (gate_scale, up_scale, down_scale))


@_int8_experts_op.register_fake
def _(x: Tensor, idx: Tensor, weights: Tensor, *rest: Tensor) -> Tensor:
    return torch.empty_like(x)


def experts(p: ExpertsParams, x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
    """Routed expert output [N, D]. Without gradients on the Triton backend (inference on CUDA): the sync-free
    fused kernel (`astrai.ops.moe`; graphable). Otherwise the grouped loop: plain autograd eagerly, the
    `astrai::moe_experts` op under torch.compile."""
    weights = weights.to(x.dtype)
    if not torch.is_grad_enabled() and use_fused_experts(x):
        scales = None if p.gate_scale is None else (p.gate_scale, p.up_scale, p.down_scale)
        return fused_experts(x, idx, weights, p.gate_proj, p.up_proj, p.down_proj, scales)
    if p.gate_scale is not None:
        stacks = (p.gate_proj, p.up_proj, p.down_proj, p.gate_scale, p.up_scale, p.down_scale)
        if torch.compiler.is_compiling():
            return _int8_experts_op(x, idx, weights, *stacks)
        return grouped_experts(x, idx, weights, *stacks[:3], stacks[3:])
    if torch.compiler.is_compiling():
        return _experts_op(x, idx, weights, p.gate_proj, p.up_proj, p.down_proj)
    return grouped_experts(x, idx, weights, p.gate_proj, p.up_proj, p.down_proj)


def _aux_tree(**fields: Tensor) -> MoEAux:
    # built without attrs' __init__, which Dynamo cannot run (DESIGN fact F2)
    obj = object.__new__(MoEAux)
    for field in attrs.fields(MoEAux):
        object.__setattr__(obj, field.name, fields[field.name])
    return obj


def router_aux(idx: Tensor, probs: Tensor, num_experts: int) -> MoEAux:
    """One layer's aux tree from its chosen experts [N, k] and routing probabilities [N, E]."""
    n, k = idx.shape
    counts = torch.zeros(num_experts, device=idx.device, dtype=torch.float32)
    counts = counts.scatter_add(0, idx.reshape(-1), torch.ones(n * k, device=idx.device, dtype=torch.float32))
    ideal = max(n * k, 1) / num_experts
    entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1).mean()
    one = torch.ones((), device=idx.device, dtype=torch.float32)
    return _aux_tree(
        tokens_per_expert=counts,
        router_prob=probs.sum(0),
        rows=one * n,
        entropy=entropy,
        load_max=counts.max() / ideal,
        dead_fraction=(counts == 0).float().mean(),
        layers=one,
    )


def local_expert_ids(idx: Tensor, num_local: int, tp: TensorParallel | None) -> Tensor:
    """Global expert ids [N, k] -> ids into this rank's experts [rank * num_local, (rank + 1) * num_local);
    experts held by other ranks map to `num_local` (skipped by `grouped_experts`)."""
    local = idx - (tp.rank if tp is not None else 0) * num_local
    return torch.where((local >= 0) & (local < num_local), local, num_local)


def moe(
    p: MoEParams, x: Tensor, *, cfg: MoEConfig, with_aux: bool = True, tp: TensorParallel | None = None
) -> tuple[Tensor, MoEAux | None]:
    """x: [..., D] -> ([..., D], aux or None); token-wise, so dense [B, T, D] and paged [T, D] are the same.

    Expert parallel (`tp` given, `p.experts` holding E / size experts): the router runs on every rank, each
    rank runs its own experts and its slice of the shared expert, and the output is this rank's partial sum
    (the decoder block sums the ranks' partials with one all-reduce).
    """
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if cfg.scoring == "sigmoid":  # DeepSeek-V3 routes in fp32
        logits = F.linear(flat.float(), p.gate.weight.float())
    else:
        logits = linear(p.gate, flat)
    weights, idx, probs = route(logits, cfg, p.e_score_correction_bias)
    num_local = p.experts.gate_proj.shape[0]
    local_idx = idx if num_local == cfg.num_experts else local_expert_ids(idx, num_local, tp)
    out = experts(p.experts, flat, local_idx, weights)
    if p.shared_experts is not None:
        shared = mlp(p.shared_experts, flat)
        if p.shared_expert_gate is not None:
            shared = torch.sigmoid(linear(p.shared_expert_gate, flat)) * shared
        out = out + shared
    aux = router_aux(idx, probs, cfg.num_experts) if with_aux else None
    return out.reshape(shape), aux

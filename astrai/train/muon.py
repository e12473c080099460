"""Muon over parameter trees: torch.optim's Muon (Newton-Schulz orthogonalised momentum) on the blocks' matrices.

The reference system's default optimizer (`muon_adamw`) splits the parameters by name: Muon takes every leaf with
>= 2 dims whose dotted name contains none of "norm", "bias", "embed", "lm_head" (in astrai's decoder: the attention
and MLP projections and the MoE router of every block), AdamW takes the rest (embeddings, a tied LM head, which is
the embedding, an untied LM head, norm gains, biases). `astrai.train.optim` composes the two (`OptimConfig.name =
"muon"`); this module is the Muon half only.

The update calls torch's functional Muon (`torch.optim._muon.muon`), so it is `torch.optim.Muon` step for step
(same momentum lerp, Nesterov blend, bf16 Newton-Schulz, decoupled weight decay, `adjust_lr_fn`). The state is a
tree (`MuonState`) shaped like the parameters, with None on the leaves Muon does not update, so checkpoints store
the momentum buffers under the parameters' own names (`momentum_buffer.blocks.0.attn.q_proj.weight`).

Notable choices:
- 3-D MoE expert stacks (`[E, F, D]`) are E matrices: each expert's slice gets its own Newton-Schulz and its own
  `adjust_lr_fn` scale (what torch's Muon would do with one 2-D parameter per expert; it rejects 3-D ones).
- FSDP (`Shard(0)` DTensor leaves): the momentum lives in the shards; Newton-Schulz needs the whole matrix, so
  each leaf's momentum-blended update is all-gathered, orthogonalised identically on every rank, and every rank
  keeps its own rows. Communication per step: one all-gather of every Muon matrix (the size of the weights).

Not here: a distributed Newton-Schulz that assigns each matrix to one rank (less compute, same traffic), the
tensor-lr / capturable forms (the train step calls this eagerly with a Python float lr).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz
from torch.optim._muon import muon as _torch_muon

from astrai.tree import leaves, named_leaves, pytree, tree_map

MUON_EXCLUDE_KEYWORDS = ("norm", "bias", "embed", "lm_head")
NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)


@attrs.frozen(kw_only=True)
class MuonConfig:
    """Muon hyperparameters (torch.optim.Muon's, with the reference system's defaults)."""

    lr: float | None = None
    """Peak learning rate of the Muon matrices (the schedule multiplies it); None: the AdamW lr (`optim.lr`),
    which is what `match_rms_adamw` is for (the update's RMS matches AdamW's); with `original` use ~0.02."""
    momentum: float = 0.95
    """Momentum coefficient (an EMA: buf = lerp(buf, grad, 1 - momentum))."""
    nesterov: bool = True
    """Nesterov momentum: orthogonalise lerp(grad, buf, momentum) instead of buf."""
    ns_steps: int = 5
    """Newton-Schulz iterations (quintic, Keller Jordan's coefficients)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the Muon matrices (p *= 1 - lr * weight_decay)."""
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """Per-matrix lr scale for an A x B matrix: original = sqrt(max(1, A / B)) (Keller Jordan), match_rms_adamw =
    0.2 * sqrt(max(A, B)) (Moonshot: reuse AdamW's lr and weight decay)."""

    def __attrs_post_init__(self) -> None:
        if self.lr is not None and not self.lr >= 0.0:
            raise ValueError(f"MuonConfig.lr must be >= 0, got {self.lr}")
        if not self.momentum >= 0.0:
            raise ValueError(f"MuonConfig.momentum must be >= 0, got {self.momentum}")
        if not 1 <= self.ns_steps < 100:
            raise ValueError(f"MuonConfig.ns_steps must be in [1, 100), got {self.ns_steps}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"MuonConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.adjust_lr_fn not in ("original", "match_rms_adamw"):
            raise ValueError(f"MuonConfig.adjust_lr_fn must be original or match_rms_adamw, got {self.adjust_lr_fn!r}")


@pytree
@attrs.frozen(eq=False)
class MuonState:
    """Per-leaf Muon state.

    Attributes:
        momentum_buffer: tree with the parameters' structure: the momentum (same shape and dtype as the
            parameter) on Muon leaves, None elsewhere.
    """

    momentum_buffer: Any


def muon_mask(params: Any) -> list[bool]:
    """Per leaf of `params` (flatten order): True where Muon applies (>= 2-D, not norm/bias/embed/lm_head)."""
    return [
        isinstance(leaf, Tensor) and leaf.dim() >= 2 and not any(k in name.lower() for k in MUON_EXCLUDE_KEYWORDS)
        for name, leaf in named_leaves(params)
    ]


def select(tree: Any, mask: list[bool]) -> Any:
    """`tree` with the leaves where `mask` is False replaced by None (the same tensors elsewhere, not copies)."""
    flags = iter(mask)
    return tree_map(lambda leaf: leaf if next(flags) else None, tree)


def init_muon(params: Any, mask: list[bool] | None = None) -> MuonState:
    """Zero momentum buffers for the leaves of `params` that `mask` (default `muon_mask(params)`) selects."""
    mask = muon_mask(params) if mask is None else list(mask)
    for (name, leaf), on in zip(named_leaves(params), mask, strict=True):
        if on and (not isinstance(leaf, Tensor) or leaf.dim() not in (2, 3) or not leaf.is_floating_point()):
            raise ValueError(f"Muon updates 2-D (or stacked 3-D) floating-point matrices; {name!r} is not one")
    zeros = tree_map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), select(params, mask))
    return MuonState(momentum_buffer=zeros)


def _matrices(x: Tensor) -> list[Tensor]:
    """A 2-D tensor, or the 2-D views of a stack of matrices `[E, A, B]` (in-place ops write the stack)."""
    return [x] if x.dim() == 2 else [x[e] for e in range(x.shape[0])]  # [E, A, B] -> E x [A, B] views


def muon_update_(
    params: Any, grads: Any, state: MuonState, *, lr: float, cfg: MuonConfig, mask: list[bool] | None = None
) -> None:
    """One Muon step in place on the selected leaves of `params` and on `state` (torch.optim.Muon's math).

    Args:
        params: tree of parameter tensors (the selected leaves are updated in place; the rest are not touched).
        grads: tree with the same structure, or a list of tensors in `leaves(params)` order.
        state: from `init_muon(params, mask)` (updated in place).
        lr: this step's Muon learning rate (`cfg.lr` is not read here; the caller passes the scheduled value).
        cfg: hyperparameters.
        mask: per-leaf Muon flags; default `muon_mask(params)`.
    """
    p, g = leaves(params), leaves(grads)
    mask = muon_mask(params) if mask is None else list(mask)
    bufs = leaves(state.momentum_buffer)
    if len(g) != len(p) or len(mask) != len(p):
        raise ValueError(f"grads ({len(g)}) and mask ({len(mask)}) must have one entry per leaf ({len(p)})")
    if len(bufs) != sum(mask):
        raise ValueError(f"state has {len(bufs)} momentum buffers but the mask selects {sum(mask)} leaves")
    chosen = [(p[i], g[i]) for i, on in enumerate(mask) if on]
    local: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
    with torch.no_grad():
        for (param, grad), buf in zip(chosen, bufs, strict=True):
            if param.shape != grad.shape or param.shape != buf.shape:
                raise ValueError(f"Muon: param {tuple(param.shape)}, grad {tuple(grad.shape)} and momentum "
                                 f"{tuple(buf.shape)} differ")  # fmt: skip
            if isinstance(param, DTensor):
                _sharded_muon_(param, grad, buf, lr=lr, cfg=cfg)
            else:
                for part, xs in zip((param, grad, buf), local, strict=True):
                    xs.extend(_matrices(part))
        if local[0]:
            _torch_muon(
                *local,
                lr=lr,
                weight_decay=cfg.weight_decay,
                momentum=cfg.momentum,
                nesterov=cfg.nesterov,
                ns_coefficients=NS_COEFFICIENTS,
                ns_steps=cfg.ns_steps,
                eps=EPS,
                adjust_lr_fn=cfg.adjust_lr_fn,
                has_complex=False,
            )


def _sharded_muon_(param: DTensor, grad: DTensor, buf: DTensor, *, lr: float, cfg: MuonConfig) -> None:
    """torch's `_single_tensor_muon` on a sharded leaf: momentum on the shards, Newton-Schulz on the gathered whole.

    Every rank orthogonalises the same gathered matrix (deterministic), then keeps its own rows of the result.
    """
    buf.lerp_(grad, 1 - cfg.momentum)
    update = grad.lerp(buf, cfg.momentum) if cfg.nesterov else buf
    full = update.full_tensor()  # all-gather: Newton-Schulz needs the whole matrix
    ortho = [_zeropower_via_newtonschulz(m, NS_COEFFICIENTS, cfg.ns_steps, EPS) for m in _matrices(full)]
    ortho_full = ortho[0] if full.dim() == 2 else torch.stack(ortho)
    # every rank holds the same full result, so slicing locally (no scatter) gives the other ranks' rows too
    mine = distribute_tensor(ortho_full, param.device_mesh, param.placements, src_data_rank=None)
    adjusted_lr = _adjust_lr(lr, cfg.adjust_lr_fn, param.shape[-2:])
    param.mul_(1 - lr * cfg.weight_decay)
    param.add_(mine, alpha=-adjusted_lr)

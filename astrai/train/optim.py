"""AdamW over parameter trees, with torch.optim's exact math, plus global-norm gradient clipping.

The optimizer state is a tree (`AdamWState`) shaped like the parameters, so checkpoints store it as safetensors
under the parameters' own names (`exp_avg.blocks.0.attn.q_proj.weight`). The update calls torch.optim's
functional AdamW (`torch.optim.adamw.adamw`) twice, once for the weight-decay group and once for the rest, so it
is bit-for-bit `torch.optim.AdamW` with those two param groups, including its fused (CUDA, CPU), foreach and
single-tensor implementations.

Weight decay follows the nanoGPT / torchtitan convention: every matrix (>= 2-D leaf) decays, including the LM
head, except embeddings; vectors (norm gains, biases) never decay. The test is by name on the tree's key paths:
a leaf decays iff it has >= 2 dims and its dotted name contains none of "norm", "bias", "embed". A tied LM head is
the embedding (`embed_tokens.weight`) and therefore does not decay.

`OptimConfig` (the run's `--optim.*`) adds the choice of optimizer: `name="muon"` runs Muon
(`astrai.train.muon`, torch.optim.Muon's math) on the blocks' matrices and this AdamW on everything else, the
reference system's `muon_adamw` split; `init_optimizer` / `optimizer_update_` / `load_optimizer_state` serve both.
Under FSDP the leaves are `Shard(0)` DTensors, which torch's functional AdamW accepts as they are.

Not here: Nora/Mano (the reference system's other matrix optimizers), AMSGrad.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch
from torch import Tensor
from torch.optim.adamw import adamw as _torch_adamw

from astrai.train.muon import MuonConfig, MuonState, init_muon, muon_mask, muon_update_, select
from astrai.tree import from_named_tensors, leaves, named_leaves, named_tensors, pytree, tree_map

NO_DECAY_KEYWORDS = ("norm", "bias", "embed")


@attrs.frozen(kw_only=True)
class AdamWConfig:
    """AdamW hyperparameters and implementation choice."""

    lr: float = 3e-4
    """Peak learning rate (the schedule multiplies it)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """EMA coefficients of the first and second moments."""
    eps: float = 1e-8
    """Added to sqrt(second moment) in the denominator."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied only to the leaves `decay_mask` selects."""
    fused: bool | None = None
    """Use torch's fused kernel; None = fused when the parameters are on CUDA."""
    foreach: bool | None = None
    """When not fused: multi-tensor (True) or per-tensor loop (False); None = multi-tensor, except that a tensor
    lr without `capturable` falls back to the per-tensor loop (as torch.optim's own auto choice does)."""
    capturable: bool = False
    """Keep step counters on the parameters' device and avoid host syncs (CUDA graphs); torch allows it on CUDA."""

    def __attrs_post_init__(self) -> None:
        if not self.lr >= 0.0:
            raise ValueError(f"AdamWConfig.lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamWConfig.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps >= 0.0:
            raise ValueError(f"AdamWConfig.eps must be >= 0, got {self.eps}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"AdamWConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.fused and self.foreach:
            raise ValueError("AdamWConfig.fused and AdamWConfig.foreach cannot both be True")


@pytree
@attrs.frozen(eq=False)
class AdamWState:
    """Per-leaf AdamW state, each field a tree with the parameters' structure.

    Attributes:
        exp_avg: first-moment EMA, same shape and dtype as each parameter.
        exp_avg_sq: second-moment EMA, same shape and dtype as each parameter.
        step: 0-d fp32 step counter per parameter (torch.optim keeps one per tensor); on the CPU unless the
            update is fused or capturable, then on the parameter's device (torch.optim's placement).
    """

    exp_avg: Any
    exp_avg_sq: Any
    step: Any


def _use_fused(cfg: AdamWConfig, params: list[Tensor]) -> bool:
    """Resolve `cfg.fused` (None = fused iff every parameter is on CUDA)."""
    if cfg.fused is not None:
        return cfg.fused
    return bool(params) and all(p.device.type == "cuda" for p in params)


def _check_params(params: list[tuple[str, Any]]) -> None:
    for name, leaf in params:
        if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
            raise ValueError(f"AdamW expects floating-point tensor leaves; {name!r} is {type(leaf).__name__}")


def init_adamw(params: Any, cfg: AdamWConfig | None = None) -> AdamWState:
    """Zero moments and step counters for every leaf of `params` (`cfg` decides where steps live)."""
    named = list(named_leaves(params))
    _check_params(named)
    cfg = cfg or AdamWConfig()
    on_device = cfg.capturable or _use_fused(cfg, [p for _, p in named])

    def step(p: Tensor) -> Tensor:
        return torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")

    return AdamWState(
        exp_avg=tree_map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params),
        exp_avg_sq=tree_map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params),
        step=tree_map(step, params),
    )


def decay_mask(params: Any) -> list[bool]:
    """Per leaf of `params` (flatten order): True where weight decay applies (>= 2-D, not norm/bias/embed)."""
    return [
        isinstance(leaf, Tensor) and leaf.dim() >= 2 and not any(k in name.lower() for k in NO_DECAY_KEYWORDS)
        for name, leaf in named_leaves(params)
    ]


def _flat_inputs(params: Any, grads: Any, state: AdamWState, decay: list[bool] | None) -> tuple[list[Any], ...]:
    """Leaf lists of params, grads, moments and steps, checked to line up (host-side, no device sync)."""
    named = list(named_leaves(params))
    p = [leaf for _, leaf in named]
    g, m, v, s = leaves(grads), leaves(state.exp_avg), leaves(state.exp_avg_sq), leaves(state.step)
    for what, xs in (("grads", g), ("state.exp_avg", m), ("state.exp_avg_sq", v), ("state.step", s)):
        if len(xs) != len(p):
            raise ValueError(f"{what} has {len(xs)} leaves but params has {len(p)}")
    for (name, leaf), gi, mi in zip(named, g, m, strict=True):
        if not isinstance(gi, Tensor) or gi.shape != leaf.shape:
            shape = tuple(gi.shape) if isinstance(gi, Tensor) else type(gi).__name__
            raise ValueError(f"grad of {name!r} is {shape}, expected shape {tuple(leaf.shape)}")
        if mi.shape != leaf.shape:
            raise ValueError(f"state.exp_avg of {name!r} has shape {tuple(mi.shape)}, expected {tuple(leaf.shape)}")
    decay = decay_mask(params) if decay is None else list(decay)
    if len(decay) != len(p):
        raise ValueError(f"decay has {len(decay)} entries but params has {len(p)} leaves")
    return p, g, m, v, s, decay


def _implementation(cfg: AdamWConfig, p: list[Tensor], s: list[Tensor], lr: float | Tensor) -> tuple[bool, ...]:
    """(fused, foreach, capturable) for this call, following torch.optim's own rules and constraints."""
    fused = _use_fused(cfg, p)
    foreach = cfg.foreach
    tensor_lr = isinstance(lr, Tensor) and not cfg.capturable
    if fused:
        foreach = False
    elif foreach is None:
        foreach = not tensor_lr  # torch's auto choice: its foreach path rejects a tensor lr unless capturable
    elif foreach and tensor_lr:
        raise ValueError("a Tensor lr needs fused=True, capturable=True or foreach=False (torch's foreach rejects it)")
    same_device = all(x.device == y.device for x, y in zip(s, p, strict=True))
    if (fused or cfg.capturable) and not same_device:
        raise ValueError(
            "fused/capturable AdamW needs the step counters on the parameters' device: build the state with "
            "init_adamw(params, cfg) using the same AdamWConfig"
        )
    # traced foreach AdamW with host-scalar bias corrections fails fake-tensor propagation (torch 2.13, CPU);
    # torch's own compiled optimizers switch to the capturable form while tracing, and so do we
    capturable = cfg.capturable or (torch.compiler.is_compiling() and foreach and same_device)
    return fused, foreach, capturable


def adamw_update_(
    params: Any,
    grads: Any,
    state: AdamWState,
    *,
    lr: float | Tensor,
    cfg: AdamWConfig,
    decay: list[bool] | None = None,
) -> None:
    """One AdamW step in place on `params` and `state` (torch.optim.AdamW with a decay and a no-decay group).

    Args:
        params: tree of parameter tensors (updated in place).
        grads: tree with the same structure, or a list of tensors in `leaves(params)` order.
        state: from `init_adamw(params, cfg)` or `load_adamw_state` (updated in place).
        lr: this step's learning rate (the schedule's `lr_at`); a 0-d tensor avoids recompiles, and needs the
            fused or capturable path unless `cfg.foreach` is left to choose.
        cfg: hyperparameters; `cfg.lr` is not read here, the caller passes the scheduled value.
        decay: per-leaf weight-decay flags; default `decay_mask(params)`.
    """
    p, g, m, v, s, decay = _flat_inputs(params, grads, state, decay)
    fused, foreach, capturable = _implementation(cfg, p, s, lr)
    for wants_decay, weight_decay in ((True, cfg.weight_decay), (False, 0.0)):
        idx = [i for i, d in enumerate(decay) if bool(d) == wants_decay]
        if not idx:
            continue
        with torch.no_grad():
            _torch_adamw(
                [p[i] for i in idx],
                [g[i] for i in idx],
                [m[i] for i in idx],
                [v[i] for i in idx],
                [],
                [s[i] for i in idx],
                foreach=foreach,
                capturable=capturable,
                differentiable=False,
                fused=fused,
                amsgrad=False,
                beta1=cfg.betas[0],
                beta2=cfg.betas[1],
                lr=lr,
                weight_decay=weight_decay,
                eps=cfg.eps,
                maximize=False,
            )


@attrs.frozen(kw_only=True)
class OptimConfig(AdamWConfig):
    """The run's optimizer: AdamW alone, or Muon for the blocks' matrices + AdamW (the fields above) for the rest."""

    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW on every leaf; muon: Muon on the >= 2-D leaves named without norm/bias/embed/lm_head (the
    blocks' projections), AdamW with its own lr on embeddings, LM head, norms and biases."""
    muon: MuonConfig = MuonConfig()
    """Muon hyperparameters (read only when name is muon)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.name not in ("adamw", "muon"):
            raise ValueError(f"OptimConfig.name must be adamw or muon, got {self.name!r}")


def as_optim_config(cfg: AdamWConfig) -> OptimConfig:
    """`cfg` as an `OptimConfig` (a plain `AdamWConfig` means name="adamw")."""
    if isinstance(cfg, OptimConfig):
        return cfg
    return OptimConfig(**attrs.asdict(cfg, recurse=False))


def uses_muon(cfg: AdamWConfig) -> bool:
    """Whether `cfg` asks for the Muon + AdamW split."""
    return isinstance(cfg, OptimConfig) and cfg.name == "muon"


@pytree
@attrs.frozen(eq=False)
class MuonAdamWState:
    """State of the Muon + AdamW split (checkpoint names `muon.momentum_buffer.<param>`, `adamw.exp_avg.<param>`).

    Attributes:
        muon: momentum buffers of the Muon leaves (None on the others).
        adamw: AdamW moments and steps of the other leaves (None on the Muon leaves).
    """

    muon: MuonState
    adamw: AdamWState


def init_optimizer(params: Any, cfg: AdamWConfig | None = None) -> AdamWState | MuonAdamWState:
    """Fresh optimizer state for `params`: `init_adamw`, or the Muon + AdamW pair when `uses_muon(cfg)`."""
    if cfg is None or not uses_muon(cfg):
        return init_adamw(params, cfg)
    mask = muon_mask(params)
    rest = select(params, [not m for m in mask])
    return MuonAdamWState(muon=init_muon(params, mask), adamw=init_adamw(rest, cfg))


def optimizer_update_(
    params: Any,
    grads: Any,
    state: AdamWState | MuonAdamWState,
    *,
    lr: float | Tensor,
    cfg: AdamWConfig,
    muon_lr: float | None = None,
    decay: list[bool] | None = None,
    muon: list[bool] | None = None,
) -> None:
    """One optimizer step in place: `adamw_update_`, or Muon on the `muon` leaves and AdamW on the rest.

    Args:
        params, grads, state, lr, cfg, decay: as `adamw_update_` (`lr` is AdamW's scheduled lr).
        muon_lr: Muon's scheduled lr (default `lr`); only read when `state` is a `MuonAdamWState`.
        muon: per-leaf Muon flags (default `muon_mask(params)`), as `init_optimizer` split them.
    """
    if not isinstance(state, MuonAdamWState):
        adamw_update_(params, grads, state, lr=lr, cfg=cfg, decay=decay)
        return
    if not isinstance(cfg, OptimConfig):
        raise ValueError("a Muon + AdamW state needs an OptimConfig (name='muon') for its hyperparameters")
    if isinstance(lr, Tensor) or isinstance(muon_lr, Tensor):
        raise ValueError("the Muon + AdamW update takes Python float learning rates")
    g = leaves(grads)
    muon = muon_mask(params) if muon is None else list(muon)
    decay = decay_mask(params) if decay is None else list(decay)
    if len(g) != len(muon) or len(decay) != len(muon):
        raise ValueError(f"grads ({len(g)}), decay ({len(decay)}) and muon ({len(muon)}) must line up with params")
    muon_update_(params, g, state.muon, lr=lr if muon_lr is None else muon_lr, cfg=cfg.muon, mask=muon)
    rest = [i for i, m in enumerate(muon) if not m]
    adamw_update_(
        select(params, [not m for m in muon]), [g[i] for i in rest], state.adamw, lr=lr, cfg=cfg,
        decay=[decay[i] for i in rest],
    )  # fmt: skip


def load_optimizer_state(
    template: AdamWState | MuonAdamWState, tensors: dict[str, Tensor]
) -> AdamWState | MuonAdamWState:
    """`load_adamw_state` for either kind of state; a checkpoint of the other optimizer is a clear ValueError."""
    saved_muon = any(name.startswith("muon.") for name in tensors)
    if saved_muon != isinstance(template, MuonAdamWState):
        saved, wanted = ("muon", "adamw") if saved_muon else ("adamw", "muon")
        raise ValueError(
            f"the checkpoint's optimizer state is {saved}'s, not compatible with --optim.name {wanted}: "
            f"resume with --optim.name {saved}"
        )
    return load_adamw_state(template, tensors)


def adamw_state_dict(state: AdamWState) -> dict[str, Tensor]:
    """`{name: tensor}` view of the state (`exp_avg.<param name>`, `exp_avg_sq.…`, `step.…`; a `MuonAdamWState`
    gives `muon.momentum_buffer.…` and `adamw.exp_avg.…`) for safetensors."""
    return named_tensors(state)


def load_adamw_state(template: AdamWState, tensors: dict[str, Tensor]) -> AdamWState:
    """A new state shaped like `template` (device, dtype) with values copied from `tensors` (by name).

    Raises:
        ValueError: when names are missing or unexpected (e.g. a checkpoint of another model or optimizer), or a
            shape differs.
    """
    expected = named_tensors(template)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"optimizer state does not match the parameters: {len(missing)} missing (e.g. {missing[:3]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    loaded = {}
    for name, ref in expected.items():
        value = tensors[name]
        if value.shape != ref.shape:
            raise ValueError(f"optimizer state {name!r} has shape {tuple(value.shape)}, expected {tuple(ref.shape)}")
        loaded[name] = value.to(device=ref.device, dtype=ref.dtype, copy=True)
    return from_named_tensors(template, loaded)


def clip_grad_norm_(grads: Any, max_norm: float | None) -> Tensor:
    """Scale `grads` in place so their global L2 norm is at most `max_norm`; return the pre-clip norm.

    Same math as `torch.nn.utils.clip_grad_norm_` (coefficient min(1, max_norm / (norm + 1e-6)), always
    multiplied, so there is no host sync), but the norm is accumulated and returned in fp32 whatever the
    gradient dtype. `max_norm` None or <= 0 disables clipping and still returns the norm.

    Args:
        grads: list (or tree) of gradient tensors.
        max_norm: the clipping threshold.

    Returns:
        fp32 0-d tensor on the first gradient's device (0.0 on the CPU when there are no gradients).
    """
    gs = [x for x in leaves(grads) if x is not None]
    if not gs:
        return torch.zeros((), dtype=torch.float32)
    first = gs[0].device
    by_device: dict[torch.device, list[Tensor]] = {}
    for x in gs:
        by_device.setdefault(x.device, []).append(x)
    norms = [n.to(first) for group in by_device.values() for n in torch._foreach_norm(group, 2.0, dtype=torch.float32)]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm is not None and max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for device, group in by_device.items():
                torch._foreach_mul_(group, coef.to(device))
    return total

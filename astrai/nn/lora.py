"""LoRA (Hu et al. 2021, arXiv:2106.09685) as its own parameter tree, kept apart from the frozen base model.

A LoRA adapter on a projection W [out, in] adds a rank-r update: y = x W^T + b + scaling * (x A^T) B^T with
A [r, in], B [out, r] and scaling = alpha / r. Here the adapters are a separate tree, `LoRAParams`: a dict from
the key path of the adapted linear (`blocks.3.attn.q_proj`, the same names as `named_tensors(params)`) to a
`LoRAAdapter`. So `named_tensors(lora)` gives `blocks.3.attn.q_proj.lora_a` and training differentiates only
that tree:

    lora = init_lora(params, LoRAConfig(r=16, alpha=32))
    logits = forward(apply_lora(params, lora), cfg, tokens)   # grads flow to `lora` only

Notable choices:
- `apply_lora` swaps each targeted `LinearParams` for a `LoRALinearParams` (defined in `astrai.nn.linear`,
  whose `linear()` adds the update through the rank-r bottleneck, never materialising B @ A). It is built
  with `tree.replace`-style construction (no attrs `__init__`), so it runs inside `torch.compile` (DESIGN F2).
  Every base tensor is detached (shared, not copied), so only the adapters can receive gradients, even
  when the base tree requires grad.
- Initialisation follows PEFT rather than the reference system's randn/r: A ~ kaiming-uniform(a=sqrt(5)),
  i.e. U(-1/sqrt(in), 1/sqrt(in)), so x A^T has the same scale whatever the input width; B = 0, so a fresh
  adapter leaves the model's outputs unchanged.
- Targets match the last component of a linear's key path: the attention q/k/v/o_proj, the MLP gate/up/
  down_proj, or "all-linear" for all of them. The LM head is never a target.

Not here: the PEFT adapter folders (`save_lora`/`load_lora` in `astrai.io.lora`: file I/O sits above the layers);
dropout on the adapter input (training regularisation, out of scope), rsLoRA, DoRA, per-module ranks
(`rank_pattern`), adapters on embeddings or the LM head.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import attrs
import torch
from torch import Tensor

from astrai.nn.linear import LinearParams, LoRALinearParams
from astrai.tree import pytree, replace, static, tree_map

T = TypeVar("T")

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # every attention and MLP projection (PEFT's spelling); never the LM head
TARGETABLE = ATTN_TARGETS + MLP_TARGETS

__all__ = [
    "ALL_LINEAR",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRALinearParams",
    "LoRAParams",
    "apply_lora",
    "init_lora",
    "merge_lora",
    "targeted_linears",
    "unmerge_lora",
]


def _targets(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    # a bare "all-linear" must not become a tuple of its characters; canonical order (unknown names last, for
    # the error) so that configs compare equal whatever order the targets were listed in
    names = (value,) if isinstance(value, str) else tuple(dict.fromkeys(value))
    order = (*TARGETABLE, ALL_LINEAR)
    return tuple(sorted(names, key=lambda n: order.index(n) if n in order else len(order)))


@attrs.frozen(kw_only=True)
class LoRAConfig:
    """LoRA hyperparameters (the train CLI exposes them as `--lora.r`, `--lora.alpha`, `--lora.targets`)."""

    r: int = 16  # rank of the update (>= 1)
    alpha: float = 32  # the update is scaled by alpha / r
    targets: tuple[str, ...] = attrs.field(default=("q_proj", "v_proj"), converter=_targets)
    """Projections to adapt, matched against the last component of their key path: any of q_proj, k_proj,
    v_proj, o_proj, gate_proj, up_proj, down_proj, or "all-linear" for all of them."""

    def __attrs_post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRA rank r must be an integer >= 1, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0 < self.alpha < math.inf:
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not self.targets:
            raise ValueError(f"LoRA targets are empty; available: {', '.join((*TARGETABLE, ALL_LINEAR))}")
        for name in self.targets:
            if name == "lm_head":
                raise ValueError("the LM head is never a LoRA target (it is tied to the embedding in many models)")
            if name not in TARGETABLE and name != ALL_LINEAR:
                raise ValueError(f"unknown LoRA target {name!r}; available: {', '.join((*TARGETABLE, ALL_LINEAR))}")

    @property
    def scaling(self) -> float:
        """alpha / r, the factor on the low-rank update."""
        return self.alpha / self.r

    @property
    def target_names(self) -> tuple[str, ...]:
        """The targeted projection names with "all-linear" expanded, in a fixed order."""
        return TARGETABLE if ALL_LINEAR in self.targets else tuple(n for n in TARGETABLE if n in self.targets)


@pytree
@attrs.frozen(eq=False)
class LoRAAdapter:
    """The trainable low-rank factors of one projection."""

    lora_a: Tensor  # [r, in]
    lora_b: Tensor  # [out, r]
    scaling: float = static()  # alpha / r


# key path of the adapted linear (`blocks.3.attn.q_proj`) -> its adapter; treat as immutable
LoRAParams: TypeAlias = dict[str, LoRAAdapter]


# ---- walking linears in a parameter tree ---------------------------------------------------------------------


def _map_linears(node: Any, fn: Callable[[str, LinearParams], Any], path: str = "") -> Any:
    """Rebuild `node` with every LinearParams replaced by `fn(key_path, linear)`; safe inside torch.compile."""
    if isinstance(node, LinearParams):
        return fn(path, node)
    prefix = f"{path}." if path else ""
    if type(node) is tuple:
        return tuple(_map_linears(child, fn, f"{prefix}{i}") for i, child in enumerate(node))
    if attrs.has(type(node)):
        names = [f.name for f in attrs.fields(type(node))]
        return replace(node, **{n: _map_linears(getattr(node, n), fn, f"{prefix}{n}") for n in names})
    return node


def _linears(tree: Any) -> list[tuple[str, LinearParams]]:
    """(key path, linear) for every LinearParams in `tree`, in tree order (host only)."""
    found: list[tuple[str, LinearParams]] = []

    def collect(path: str, lin: LinearParams) -> LinearParams:
        found.append((path, lin))
        return lin

    _map_linears(tree, collect)
    return found


def targeted_linears(params: Any, cfg: LoRAConfig) -> list[tuple[str, LinearParams]]:
    """(key path, linear) for each linear of `params` that `cfg` adapts, in tree order (host only).

    Raises:
        ValueError: `params` already carries adapters, or no linear matches (the message lists the available
            names).
    """
    found = _linears(params)
    for path, lin in found:
        _check_base(path, lin)
    chosen = [(path, lin) for path, lin in found if path.rpartition(".")[2] in cfg.target_names]
    if not chosen:
        present = sorted({path.rpartition(".")[2] for path, _ in found} & set(TARGETABLE))
        raise ValueError(
            f"no linear in this tree matches LoRA targets {list(cfg.targets)}; "
            f"available: {', '.join(present) or 'none'} (or {ALL_LINEAR!r})"
        )
    return chosen


def _check_base(path: str, lin: LinearParams) -> None:
    if isinstance(lin, LoRALinearParams):
        raise ValueError(f"{path} already carries a LoRA adapter: pass the base tree, not an applied one")
    if lin.scale is not None:
        raise ValueError(f"{path} is int8-quantized: LoRA over quantized weights (QLoRA) is not supported; "
                         "load the model without quantize")  # fmt: skip


def _check_adapter(path: str, lin: LinearParams, ad: LoRAAdapter) -> None:
    out_f, in_f = lin.weight.shape
    r = ad.lora_a.shape[0]
    if ad.lora_a.dim() != 2 or ad.lora_a.shape[1] != in_f or tuple(ad.lora_b.shape) != (out_f, r):
        raise ValueError(
            f"LoRA adapter {path}: lora_a {tuple(ad.lora_a.shape)} and lora_b {tuple(ad.lora_b.shape)} do not fit "
            f"weight {tuple(lin.weight.shape)} (expected lora_a [r, {in_f}], lora_b [{out_f}, r])"
        )


# ---- init / apply / merge -----------------------------------------------------------------------------------


def init_lora(params: Any, cfg: LoRAConfig, *, seed: int = 0, dtype: torch.dtype | None = None) -> LoRAParams:
    """Fresh adapters for the linears of `params` that `cfg` targets: A kaiming-uniform, B zero.

    Args:
        params: a base parameter tree (e.g. `DecoderParams`), not one returned by `apply_lora`.
        cfg: rank, alpha and targets.
        seed: seeds a CPU generator, so adapters are identical on every device.
        dtype: adapter dtype (default: each base weight's dtype; fp32 adapters on a bf16 base also work).

    Returns:
        `{key path: LoRAAdapter}` in tree order, on the device of each base weight.
    """
    generator = torch.Generator().manual_seed(seed)
    lora: LoRAParams = {}
    for path, lin in targeted_linears(params, cfg):
        out_f, in_f = lin.weight.shape
        bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)) as in nn.Linear and PEFT
        a = torch.empty(cfg.r, in_f).uniform_(-bound, bound, generator=generator)
        kw = dict(device=lin.weight.device, dtype=dtype or lin.weight.dtype)
        lora[path] = LoRAAdapter(lora_a=a.to(**kw), lora_b=torch.zeros(out_f, cfg.r, **kw), scaling=cfg.scaling)
    return lora


def _lora_linear(lin: LinearParams, ad: LoRAAdapter) -> LoRALinearParams:
    # object.__new__ + object.__setattr__ rather than the attrs __init__, which Dynamo cannot run (DESIGN F2)
    out = object.__new__(LoRALinearParams)
    values = dict(weight=lin.weight, bias=lin.bias, scale=lin.scale, lora_a=ad.lora_a, lora_b=ad.lora_b,
                  scaling=ad.scaling)  # fmt: skip
    for name, value in values.items():
        object.__setattr__(out, name, value)
    return out


def _with_adapters(params: T, lora: LoRAParams, fn: Callable[[str, LinearParams, LoRAAdapter], Any]) -> T:
    """Rebuild `params` with `fn(path, linear, adapter)` at every adapted linear; checks paths and shapes."""
    seen: set[str] = set()

    def visit(path: str, lin: LinearParams) -> Any:
        ad = lora.get(path)
        if ad is None:
            return lin
        _check_base(path, lin)
        _check_adapter(path, lin, ad)
        seen.add(path)
        return fn(path, lin, ad)

    out = _map_linears(params, visit)
    unknown = [path for path in lora if path not in seen]
    if unknown:
        raise ValueError(f"LoRA adapters {unknown} name no linear of this parameter tree")
    return out


def apply_lora(params: T, lora: LoRAParams) -> T:
    """`params` with each adapted linear turned into a `LoRALinearParams`; every base tensor is detached.

    The base tensors are shared (detach does not copy), so the whole base is frozen and gradients reach only
    `lora`. Works inside `torch.compile(fullgraph=True)`.
    """
    frozen = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, params)
    return _with_adapters(frozen, lora, lambda path, lin, ad: _lora_linear(lin, ad))


def _delta(ad: LoRAAdapter) -> Tensor:
    # scaling * B @ A in fp32: [out, r] @ [r, in] -> [out, in]
    return (ad.lora_b.float() @ ad.lora_a.float()) * ad.scaling


def merge_lora(params: T, lora: LoRAParams) -> T:
    """Plain params with W + scaling * B @ A folded in (new weight tensors; `params` is untouched).

    The sum is formed in fp32 and rounded once to the weight dtype, so merged bf16 weights carry one rounding.
    """
    return _with_adapters(
        params, lora, lambda path, lin, ad: replace(lin, weight=(lin.weight.float() + _delta(ad)).to(lin.weight.dtype))
    )


def unmerge_lora(merged: T, lora: LoRAParams) -> T:
    """The inverse of `merge_lora`: W - scaling * B @ A (exact up to rounding; bf16 weights do not round-trip)."""
    return _with_adapters(
        merged, lora, lambda path, lin, ad: replace(lin, weight=(lin.weight.float() - _delta(ad)).to(lin.weight.dtype))
    )

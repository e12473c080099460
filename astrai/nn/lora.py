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
- `save_lora`/`load_lora` use PEFT's file format (`adapter_model.safetensors` + `adapter_config.json`, names
  `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`), so adapters move both ways.

Not here: dropout on the adapter input (training regularisation, out of scope), rsLoRA, DoRA, per-module
ranks (`rank_pattern`), adapters on embeddings or the LM head; PEFT files using them are refused by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import attrs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from astrai.io.checkpoint import atomic_dir, read_json, write_json
from astrai.io.errors import CheckpointError, UnsupportedModelError
from astrai.io.hf import astrai_to_hf_name, hf_to_astrai_name
from astrai.nn.linear import LinearParams, LoRALinearParams
from astrai.tree import pytree, replace, static, tree_map

T = TypeVar("T")

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # every attention and MLP projection (PEFT's spelling); never the LM head
TARGETABLE = ATTN_TARGETS + MLP_TARGETS
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_PEFT_NAME = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")

__all__ = [
    "ALL_LINEAR",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRALinearParams",
    "LoRAParams",
    "apply_lora",
    "init_lora",
    "load_lora",
    "merge_lora",
    "save_lora",
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


def _targeted(params: Any, cfg: LoRAConfig) -> list[tuple[str, LinearParams]]:
    """The linears of `params` that `cfg` adapts; ValueError listing the available names when none match."""
    found = _linears(params)
    for path, lin in found:
        if isinstance(lin, LoRALinearParams):
            raise ValueError(f"{path} already carries a LoRA adapter: pass the base tree, not an applied one")
    chosen = [(path, lin) for path, lin in found if path.rpartition(".")[2] in cfg.target_names]
    if not chosen:
        present = sorted({path.rpartition(".")[2] for path, _ in found} & set(TARGETABLE))
        raise ValueError(
            f"no linear in this tree matches LoRA targets {list(cfg.targets)}; "
            f"available: {', '.join(present) or 'none'} (or {ALL_LINEAR!r})"
        )
    return chosen


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
    for path, lin in _targeted(params, cfg):
        out_f, in_f = lin.weight.shape
        bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)) as in nn.Linear and PEFT
        a = torch.empty(cfg.r, in_f).uniform_(-bound, bound, generator=generator)
        kw = dict(device=lin.weight.device, dtype=dtype or lin.weight.dtype)
        lora[path] = LoRAAdapter(lora_a=a.to(**kw), lora_b=torch.zeros(out_f, cfg.r, **kw), scaling=cfg.scaling)
    return lora


def _lora_linear(lin: LinearParams, ad: LoRAAdapter) -> LoRALinearParams:
    # object.__new__ + object.__setattr__ rather than the attrs __init__, which Dynamo cannot run (DESIGN F2)
    out = object.__new__(LoRALinearParams)
    values = dict(weight=lin.weight, bias=lin.bias, lora_a=ad.lora_a, lora_b=ad.lora_b, scaling=ad.scaling)
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
        if isinstance(lin, LoRALinearParams):
            raise ValueError(f"{path} already carries a LoRA adapter: pass the base tree, not an applied one")
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


# ---- PEFT-format files ----------------------------------------------------------------------------------------


def _peft_name(path: str, factor: str) -> str:
    """`blocks.0.attn.q_proj`, "A" -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    try:
        module = astrai_to_hf_name(f"{path}.weight").removesuffix(".weight")
    except KeyError:
        raise ValueError(f"LoRA adapter {path!r} has no Hugging Face module name") from None
    return f"{_PEFT_PREFIX}{module}.lora_{factor}.weight"


def _peft_config(cfg: LoRAConfig, base_model: str | None) -> dict[str, Any]:
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.r,
        "lora_alpha": alpha,
        "target_modules": sorted(cfg.target_names),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_lora(lora: LoRAParams, cfg: LoRAConfig, out_dir: str | Path, *, base_model: str | None = None) -> Path:
    """Write `adapter_model.safetensors` + `adapter_config.json` (PEFT format) atomically into `out_dir`.

    Args:
        lora: the adapters; their rank and scaling must agree with `cfg`.
        cfg: written as PEFT's `r`, `lora_alpha` and `target_modules`.
        out_dir: folder to create or replace.
        base_model: optional `base_model_name_or_path` for PEFT.

    Returns:
        The resolved folder.
    """
    if not lora:
        raise ValueError("no LoRA adapters to save")
    tensors: dict[str, Tensor] = {}
    for path, ad in lora.items():
        if path.rpartition(".")[2] not in cfg.target_names:
            raise ValueError(f"LoRA adapter {path} is not among the config's targets {list(cfg.target_names)}")
        if ad.lora_a.shape[0] != cfg.r or not math.isclose(ad.scaling, cfg.scaling):
            raise ValueError(
                f"LoRA adapter {path} has rank {ad.lora_a.shape[0]} and scaling {ad.scaling}, "
                f"the config says r={cfg.r}, scaling={cfg.scaling}"
            )
        tensors[_peft_name(path, "A")] = ad.lora_a.detach().contiguous().cpu()
        tensors[_peft_name(path, "B")] = ad.lora_b.detach().contiguous().cpu()

    def write(folder: Path) -> None:
        save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        write_json(folder / ADAPTER_CONFIG, _peft_config(cfg, base_model))

    return atomic_dir(out_dir, write)


# PEFT options that change the math; any non-default value is refused rather than silently ignored
_UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "modules_to_save": None,
    "layer_replication": None,
}


def _config_from_peft(d: dict[str, Any], source: Path) -> LoRAConfig:
    if d.get("peft_type") != "LORA":
        raise UnsupportedModelError(f"{source}: peft_type {d.get('peft_type')!r} is not supported (only 'LORA')")
    for key, default in _UNSUPPORTED.items():
        value = d.get(key, default)
        unset = value == default or (default in (None, {}) and value in (None, [], {}))
        if not unset:
            raise UnsupportedModelError(f"{source}: {key!r} = {value!r} is not supported (expected {default!r})")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in d:
            raise CheckpointError(f"{source}: missing {key!r}")
    targets = d["target_modules"]
    if isinstance(targets, str) and targets != ALL_LINEAR:
        raise UnsupportedModelError(f"{source}: regex target_modules {targets!r} are not supported")
    try:
        return LoRAConfig(r=d["r"], alpha=d["lora_alpha"], targets=targets)
    except (TypeError, ValueError) as err:
        raise UnsupportedModelError(f"{source}: {err}") from None


def _read_tensors(path: Path) -> dict[str, Tensor]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as err:
        raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({err})") from None


def _adapter_path(name: str) -> str | None:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> `blocks.0.attn.q_proj`."""
    match = _PEFT_NAME.fullmatch(name)
    astrai_name = hf_to_astrai_name(f"{match.group(1)}.weight") if match else None
    return None if astrai_name is None else astrai_name.removesuffix(".weight")


def load_lora(folder: str | Path, params: Any, *, dtype: torch.dtype | None = None) -> tuple[LoRAParams, LoRAConfig]:
    """Read a PEFT LoRA adapter folder for the base tree `params`.

    Args:
        folder: holds `adapter_config.json` and `adapter_model.safetensors`.
        params: the base parameter tree the adapter was trained on (gives shapes and devices).
        dtype: adapter dtype (default: as stored).

    Returns:
        (adapters, config). CheckpointError names the file and tensor on missing files, missing or unexpected
        tensors and shape mismatches; UnsupportedModelError on PEFT options astrai does not implement.
    """
    folder = Path(folder)
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found (expected a PEFT LoRA adapter folder)")
    cfg = _config_from_peft(read_json(config_path), config_path)
    tensors = _read_tensors(weights_path)
    try:
        targeted = _targeted(params, cfg)
    except ValueError as err:
        raise CheckpointError(f"{config_path}: {err}") from None
    expected = {_peft_name(path, f): path for path, _ in targeted for f in "AB"}
    for name in tensors:
        if name not in expected:
            where = _adapter_path(name)
            detail = f" (adapter for {where})" if where else ""
            raise CheckpointError(f"{weights_path}: unexpected tensor {name!r}{detail} for targets {list(cfg.targets)}")
    lora: LoRAParams = {}
    for path, lin in targeted:
        out_f, in_f = lin.weight.shape
        factors = []
        for factor, shape in (("A", (cfg.r, in_f)), ("B", (out_f, cfg.r))):
            name = _peft_name(path, factor)
            if name not in tensors:
                raise CheckpointError(f"{weights_path}: tensor {name!r} is missing")
            tensor = tensors[name]
            if tuple(tensor.shape) != shape:
                raise CheckpointError(
                    f"{weights_path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} "
                    f"for r={cfg.r} and weight {tuple(lin.weight.shape)}"
                )
            factors.append(tensor.to(device=lin.weight.device, dtype=dtype or tensor.dtype))
        lora[path] = LoRAAdapter(lora_a=factors[0], lora_b=factors[1], scaling=cfg.scaling)
    return lora, cfg

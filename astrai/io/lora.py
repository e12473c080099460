"""LoRA adapter folders in PEFT's format: `adapter_model.safetensors` + `adapter_config.json`.

`save_lora` / `load_lora` move the adapter tree of `astrai.nn.lora` (`{key path: LoRAAdapter}`) to and from
the files PEFT writes, so adapters travel both ways. Tensor names are PEFT's
(`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`), built from `astrai.io.hf`'s weight-name
map; the config holds PEFT's `r`, `lora_alpha` and `target_modules` plus its defaults for everything else.

Not here: the math (config, init, apply, merge: `astrai.nn.lora`); PEFT options that change it (DoRA, rsLoRA,
per-module ranks, adapters on embeddings or the LM head), which `load_lora` refuses by name.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from astrai.io.checkpoint import atomic_dir, read_json, write_json
from astrai.io.errors import CheckpointError, UnsupportedModelError
from astrai.io.hf import astrai_to_hf_name, hf_to_astrai_name
from astrai.nn.lora import ALL_LINEAR, LoRAAdapter, LoRAConfig, LoRAParams, targeted_linears

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FOLDER_ENTRIES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, "adapter_model.bin")
"""What PEFT adapter folders hold (README.md aside, a user file as likely): `save_lora` replaces only these."""
_PEFT_PREFIX = "base_model.model."
_PEFT_NAME = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "load_lora", "read_adapter_config", "save_lora"]


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
        out_dir: folder to create, or a previous adapter folder to replace (one holding only adapter files:
            anything else is refused, as the save replaces the whole folder).
        base_model: optional `base_model_name_or_path` for PEFT.

    Returns:
        The resolved folder.

    Raises:
        FileExistsError: `out_dir` is a file, or a folder holding entries an adapter folder does not (named).
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

    return atomic_dir(out_dir, write, replaces=ADAPTER_FOLDER_ENTRIES, kind="LoRA adapter folder")


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
    if not isinstance(targets, str) and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise CheckpointError(f"{source}: target_modules must be a list of module names or a regex, got {targets!r}")
    # a list entry matches by its last name components (PEFT writes `model.layers.0.mlp.down_proj` as readily as
    # `down_proj`): the projection names are the last components; a regex names them only once matched
    names = ALL_LINEAR if isinstance(targets, str) else [t.rsplit(".", 1)[-1] for t in targets]
    try:
        return LoRAConfig(r=d["r"], alpha=d["lora_alpha"], targets=names)
    except (TypeError, ValueError) as err:
        raise UnsupportedModelError(f"{source}: {err}") from None


def read_adapter_config(folder: str | Path) -> LoRAConfig:
    """The rank, alpha and targets of a PEFT adapter folder, from its `adapter_config.json` alone (no tensors
    read). CheckpointError / UnsupportedModelError as `load_lora`."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (expected a PEFT LoRA adapter folder)")
    return _config_from_peft(read_json(path), path)


def _peft_targeted(targeted: list[tuple[str, Any]], targets: str | list[str], source: Path) -> list[tuple[str, Any]]:
    """The linears of `targeted` that PEFT's `target_modules` adapt, by PEFT's rule on the HF module names.

    As `peft.tuners.tuners_utils.check_target_module_exists`: "all-linear" takes every projection; another string
    is a regex the whole module name (`model.layers.0.self_attn.q_proj`) must match; a list entry matches a name
    equal to it or ending in `.` + it (so `q_proj` takes every layer's, `model.layers.0.mlp.down_proj` one).
    """
    if targets == ALL_LINEAR:
        return targeted
    module = {path: _peft_name(path, "A").removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
              for path, _ in targeted}  # fmt: skip
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as err:
            raise CheckpointError(f"{source}: target_modules {targets!r} is not a valid regex ({err})") from None

        def matches(name: str) -> bool:
            return pattern.fullmatch(name) is not None
    else:

        def matches(name: str) -> bool:
            return any(name == t or name.endswith(f".{t}") for t in targets)

    chosen = [(p, lin) for p, lin in targeted if matches(module[p])]
    if not chosen:
        raise CheckpointError(f"{source}: target_modules {targets!r} match no projection of this model "
                              f"(module names such as {next(iter(module.values()), '-')!r})")  # fmt: skip
    return chosen


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
    peft_config = read_json(config_path)
    cfg = _config_from_peft(peft_config, config_path)
    tensors = _read_tensors(weights_path)
    try:
        targeted = _peft_targeted(targeted_linears(params, cfg), peft_config["target_modules"], config_path)
    except ValueError as err:
        raise CheckpointError(f"{config_path}: {err}") from None
    if isinstance(peft_config["target_modules"], str) and peft_config["target_modules"] != ALL_LINEAR:
        cfg = attrs.evolve(cfg, targets=tuple({path.rsplit(".", 1)[-1] for path, _ in targeted}))
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

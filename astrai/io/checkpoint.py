"""Safetensors checkpoints in the Hugging Face folder layout <-> (ModelConfig, DecoderParams).

Loading reads `config.json`, then tensors from `model.safetensors` or the shards named by
`model.safetensors.index.json`, one tensor at a time (memory-mapped; each is cast and moved before the next is
read, so peak memory is the final model plus one tensor; MoE experts stored one tensor per expert are stacked
into one [E, ...] tensor per layer, see `hf_parts`). Every problem raises `CheckpointError` naming the
file and tensor: missing config, unsupported family, missing/unexpected/mis-shaped tensors, corrupt files.

Saving writes `config.json`, `model.safetensors` (HF names, loadable by transformers) and
`generation_config.json` into a temporary folder that is fsynced and renamed into place, so an interrupted
save never leaves a half-written model where a good one was.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from astrai.io.errors import CheckpointError
from astrai.io.hf import astrai_to_hf_name, config_from_hf, config_to_hf, expert_hf_names, is_ignored_hf_tensor
from astrai.models.config import DTYPES, ModelConfig
from astrai.models.decoder import DecoderParams, init_params_meta
from astrai.tree import from_named_tensors, named_tensors

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file, raising CheckpointError naming the file when it is unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(folder: str | Path) -> ModelConfig:
    """The ModelConfig of a HF-format model folder."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model folder)")
    try:
        return config_from_hf(read_json(path), source=str(path))
    except CheckpointError:
        raise
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def _weight_map(folder: Path) -> dict[str, Path]:
    # HF tensor name -> file holding it
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing 'weight_map'")
        files = {name: folder / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise CheckpointError(f"{index}: shard {file.name} is missing")
        return files
    single = folder / WEIGHTS_FILE
    shards = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder}: no *.safetensors weights (pytorch_model.bin is not supported)")
    files: dict[str, Path] = {}
    for shard in shards:
        with _open(shard) as f:
            files.update({name: shard for name in f.keys()})
    return files


@contextmanager
def _open(path: Path) -> Iterator[Any]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as err:
        raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({err})") from None


def _expected_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in named_tensors(init_params_meta(cfg)).items()}


def hf_parts(name: str, cfg: ModelConfig) -> tuple[list[str], bool]:
    """(HF tensor names making up parameter `name`, whether they are stacked on a new leading expert axis)."""
    experts = expert_hf_names(name, cfg)
    return ([astrai_to_hf_name(name, cfg.model_type)], False) if experts is None else (experts, True)


def _check_unexpected(files: dict[str, Path], expected: dict[str, tuple[int, ...]], cfg: ModelConfig) -> None:
    known = {part for name in expected for part in hf_parts(name, cfg)[0]}
    for hf_name, file in files.items():
        if is_ignored_hf_tensor(hf_name, cfg) or (cfg.tie_word_embeddings and hf_name == "lm_head.weight"):
            continue
        if hf_name not in known:
            raise CheckpointError(
                f"{file}: unexpected tensor {hf_name!r} for a {cfg.model_type} model with this config"
            )


def load_params(
    folder: str | Path,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> DecoderParams:
    """Read the parameter tree of `cfg` from a HF-format folder.

    Args:
        folder: model folder.
        cfg: its config (see `read_config`).
        dtype: target dtype of floating tensors (default: `cfg.dtype`).
        device: target device (default: CPU).

    Returns:
        The parameter tree, tensors cast and moved one at a time.
    """
    folder = Path(folder)
    dtype = dtype or cfg.torch_dtype
    files = _weight_map(folder)
    expected = _expected_names(cfg)
    _check_unexpected(files, expected, cfg)
    tensors: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(hf_name: str, name: str) -> tuple[torch.Tensor, Path]:
            file = files.get(hf_name)
            if file is None:
                raise CheckpointError(f"{folder}: tensor {hf_name!r} (parameter {name}) is missing")
            if file not in handles:
                handles[file] = stack.enter_context(_open(file))
            try:
                return handles[file].get_tensor(hf_name), file
            except SafetensorError as err:
                raise CheckpointError(f"{file}: cannot read tensor {hf_name!r} ({err})") from None

        for name, shape in expected.items():
            parts, stacked = hf_parts(name, cfg)
            read_parts = [read(part, name) for part in parts]
            hf_name, file = parts[0], read_parts[0][1]
            if stacked:  # per-expert HF tensors -> one [E, ...] tensor (MoE)
                shapes = {tuple(t.shape) for t, _ in read_parts}
                if len(shapes) > 1:
                    raise CheckpointError(f"{file}: experts of {name} have different shapes {sorted(shapes)}")
                tensor = torch.stack([t for t, _ in read_parts])
                hf_name = re.sub(r"experts\.0\.", "experts.*.", hf_name)
            else:
                tensor = read_parts[0][0]
            if tuple(tensor.shape) != shape:
                raise CheckpointError(
                    f"{file}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, the config expects {shape}"
                )
            tensors[name] = tensor.to(device=device or "cpu", dtype=dtype)
    return from_named_tensors(init_params_meta(cfg), tensors)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as indented UTF-8 JSON and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def atomic_dir(out_dir: str | Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp_dir)` then move tmp_dir to `out_dir`, replacing any previous folder only once complete."""
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
        os.replace(tmp, out)
        _fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def save_params(folder: Path, cfg: ModelConfig, params: DecoderParams) -> None:
    """Write `config.json` and `model.safetensors` (HF names) into an existing folder."""
    dtype_name = next((n for n, d in DTYPES.items() if d == params.embed_tokens.weight.dtype), cfg.dtype)
    write_json(folder / "config.json", config_to_hf(attrs.evolve(cfg, dtype=dtype_name)))
    tensors = {}
    for name, tensor in named_tensors(params).items():
        parts, stacked = hf_parts(name, cfg)
        pieces = tensor.unbind(0) if stacked else (tensor,)  # MoE: one HF tensor per expert
        tensors.update({part: t.detach().contiguous().cpu() for part, t in zip(parts, pieces, strict=True)})
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})

"""Safetensors checkpoints in the Hugging Face folder layout <-> (ModelConfig, DecoderParams).

Loading reads `config.json`, then tensors from `model.safetensors` or the shards named by
`model.safetensors.index.json`, one tensor at a time (memory-mapped; each is cast and moved before the next is
read, so peak memory is the final model plus one tensor; MoE experts stored one tensor per expert are stacked
into one [E, ...] tensor per layer, see `hf_parts`). Every problem raises `CheckpointError` naming the
file and tensor: missing config, unsupported family, missing/unexpected/mis-shaped tensors, corrupt files, a
config claiming more layers or experts than the weights hold (checked before the parameter tree is built),
tensors stored in an integer dtype, and NaN or infinite weights (one float32 sum per tensor, whenever the load
casts or moves the tensor: see `_check_finite`).

Saving writes `config.json`, `model.safetensors` (HF names, loadable by transformers) and
`generation_config.json` into a temporary folder that is fsynced and renamed into place, so an interrupted
save never leaves a half-written model where a good one was.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
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
    except RecursionError:  # json's recursive parser on `[[[[...` thousands deep
        raise CheckpointError(f"{path}: JSON nested too deeply") from None
    except OSError as err:  # permissions, a directory, a dangling link
        raise CheckpointError(f"{path}: cannot read ({err.strerror or err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(folder: str | Path) -> ModelConfig:
    """The ModelConfig of a HF-format model folder."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model folder)")
    data = read_json(path)
    _check_layer_count(Path(folder), data.get("num_hidden_layers"), path)
    try:
        return config_from_hf(data, source=str(path))
    except CheckpointError:
        raise
    except ValueError as err:
        raise CheckpointError(str(err)) from None


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# the config.json key holding the routed-expert count, by family (qwen2_moe / qwen3_moe: num_experts)
_EXPERTS_KEY = {"mixtral": "num_local_experts", "deepseek_v2": "n_routed_experts", "deepseek_v3": "n_routed_experts"}


def _stored_count(names: Iterable[str], pattern: re.Pattern[str]) -> int:
    """1 + the largest index `pattern` finds in the tensor names (0 when it finds none)."""
    return max((int(m.group(1)) for name in names if (m := pattern.search(name))), default=-1) + 1


def _check_layer_count(folder: Path, layers: Any, config: Path) -> None:
    """Refuse a config.json claiming more decoder layers than the weights hold, before anything is built.

    Building the (meta) parameter tree costs time and memory per layer, so `num_hidden_layers: 1000000000` would
    otherwise hang the load long before the tensor-by-tensor comparison. Fewer layers than stored is left to the
    unexpected-tensor check (DeepSeek checkpoints store their MTP layers past the last decoder layer). A folder
    without readable weights is skipped here: `load_params` reports that.
    """
    if isinstance(layers, bool) or not isinstance(layers, int):
        return  # config_from_hf names the ill-typed field
    try:
        files = _weight_map(folder)
    except CheckpointError:
        return
    stored = _stored_count(files, _LAYER)
    if layers > stored:
        raise CheckpointError(f"{config}: num_hidden_layers is {layers} but the weights hold {stored} decoder "
                              f"layers (model.layers.0 to model.layers.{stored - 1})")  # fmt: skip


def _check_counts(folder: Path, files: dict[str, Path], cfg: ModelConfig) -> None:
    """The layer and routed-expert counts of `cfg` against the tensor names, before the parameter tree is built
    (per layer and per expert work: a huge count in config.json must fail here, not hang)."""
    _check_layer_count(folder, cfg.num_hidden_layers, folder / "config.json")
    if cfg.moe is not None:
        stored = _stored_count(files, _EXPERT)
        if cfg.moe.num_experts > stored:
            key = _EXPERTS_KEY.get(cfg.model_type, "num_experts")
            raise CheckpointError(f"{folder / 'config.json'}: {key} is {cfg.moe.num_experts} but the weights hold "
                                  f"{stored} experts per layer")  # fmt: skip


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
    _check_counts(folder, files, cfg)
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
                tensor = handles[file].get_tensor(hf_name)
            except SafetensorError as err:
                raise CheckpointError(f"{file}: cannot read tensor {hf_name!r} ({err})") from None
            if not tensor.dtype.is_floating_point:  # an integer tensor would be cast: silently wrong weights
                kind = str(tensor.dtype).removeprefix("torch.")
                raise CheckpointError(f"{file}: tensor {hf_name!r} is stored as {kind}; parameters must be stored "
                                      "in a floating dtype (float32, bfloat16, float16)")  # fmt: skip
            return tensor, file

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
            tensors[name] = _check_finite(tensor, tensor.to(device=device or "cpu", dtype=dtype), hf_name, file)
    return from_named_tensors(init_params_meta(cfg), tensors)


def _check_finite(stored: torch.Tensor, loaded: torch.Tensor, hf_name: str, file: Path) -> torch.Tensor:
    """`loaded` (`stored` cast and moved), or a CheckpointError when it holds NaN or infinity.

    Non-finite weights mean a corrupt or diverged checkpoint: every logit would be NaN. The check is one float32
    sum per tensor on the target device (NaN and infinity propagate through it, so a finite sum means finite
    values); only a non-finite sum, which finite values summing past float32's range also give, pays for the exact
    elementwise count. It runs when the load copies the tensor anyway (a dtype cast or a move to another device),
    where it adds ~6% on CPU and next to nothing on a GPU. A CPU load in the checkpoint's own dtype keeps the
    memory-mapped tensors unread; there the check would be the load's only full read of the weights (2-4x its
    time, and `astrai info` would read a whole 100 GB model), so it is skipped (docs/models.md, "Load-time checks").
    """
    if loaded is stored:
        return loaded
    if bool(torch.isfinite(loaded.sum(dtype=torch.float32))):
        return loaded
    bad = loaded.numel() - int(torch.isfinite(loaded).sum())
    if not bad:
        return loaded
    where = f"{file}: tensor {hf_name!r}"
    if loaded.dtype != stored.dtype and bool(torch.isfinite(stored).all()):
        peak = float(stored.abs().max())
        raise CheckpointError(f"{where} has values up to {peak:.3g}, beyond {str(loaded.dtype).removeprefix('torch.')}"
                              "'s range: load it in a wider dtype (dtype='bfloat16' or 'float32')")  # fmt: skip
    raise CheckpointError(f"{where} holds {bad} NaN or infinite values (of {loaded.numel()})")


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


MODEL_FOLDER_ENTRIES = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
    "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
    "chat_template.json", "additional_chat_templates",
)  # fmt: skip
"""Top-level entries of a HF model folder (what `astrai.save` writes, plus the weight, tokenizer and template
files other HF writers put there): `astrai.save` replaces a folder holding only these, and refuses any other."""


def _refuse_unless_replaceable(out: Path, replaces: Collection[str] | None, kind: str) -> None:
    """Raise unless `out` is absent, an empty folder, or a folder of only `replaces` entries (None: any folder)."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise FileExistsError(f"refusing to write a {kind} to {out}: it exists and is a file, not a folder")
    cwd = Path.cwd().resolve()
    if out.resolve() == cwd or out.resolve() in cwd.parents:  # swapped out, the shell would sit in a deleted folder
        raise FileExistsError(f"refusing to replace {out} with a {kind}: it is (or holds) the current working "
                              "directory; write to a subfolder, e.g. ./model")  # fmt: skip
    if replaces is None:
        return
    foreign = sorted(p.name for p in out.iterdir() if not any(fnmatch.fnmatchcase(p.name, pat) for pat in replaces))
    if foreign:
        shown = ", ".join(foreign[:10]) + (f" and {len(foreign) - 10} more" if len(foreign) > 10 else "")
        raise FileExistsError(
            f"refusing to replace {out} with a {kind}: it holds {shown}, which a {kind} does not and which would "
            "be deleted (the whole folder is replaced); use a new or empty folder, or move those away first"
        )


def atomic_dir(
    out_dir: str | Path,
    write: Callable[[Path], None],
    *,
    replaces: Collection[str] | None = None,
    kind: str = "folder",
) -> Path:
    """Run `write(tmp_dir)` in a hidden sibling temp folder, fsync it, then rename it to `out_dir`.

    A previous folder at `out_dir` is swapped out only once the new one is complete, so an interrupted save keeps
    it; on any failure the temp folder is removed and the previous folder is put back. Because the swap replaces
    the whole folder, it is refused (before anything is written or moved) when `out_dir` is a file, the working
    directory or one above it, or a folder holding an entry that no pattern of `replaces` matches: a save must
    never delete unrelated user files.

    Args:
        out_dir: the folder to create or replace.
        write: fills the temp folder.
        replaces: glob patterns (`fnmatch`, case-sensitive) of the top-level entries a previous save of this kind
            holds. None allows replacing any folder: only for folders the library names itself (training
            checkpoints' `step_N`).
        kind: what the folder is, for error messages ("model folder", "LoRA adapter folder", ...).

    Raises:
        FileExistsError: `out_dir` is a file, the working directory (or above it), or a folder holding entries
            `replaces` does not allow.
    """
    out = Path(out_dir).resolve()
    _refuse_unless_replaceable(out, replaces, kind)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(f"cannot write a {kind} to {out}: part of {out.parent} is a file") from None
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    old = None
    try:
        write(tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(tmp)
        _refuse_unless_replaceable(out, replaces, kind)  # again: the folder may have changed during the write
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old, out)  # the new folder never arrived: put the previous one back
        raise
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
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

"""Training checkpoints: atomic `step_NNNNNNNN/` folders under `RUN/checkpoints/`, keeping the last K.

A checkpoint holds everything a resumed run needs to continue the exact loss trajectory:
- `model/`: the weights in HF layout (a full model, or LoRA adapter files);
- `optimizer.safetensors`: the AdamW moments and step counters;
- `rng.safetensors`: torch CPU (and CUDA) generator states;
- `state.json`: step, tokens seen, sampler position, and the run's config;
- `manifest.json`: the size and SHA-256 of every other file, written last.
A sharded checkpoint (`--fsdp`, `astrai.train.sharded_checkpoint`) holds `shards/` (one safetensors file of local
shards per rank and `shards/index.json`) instead of `model/` and `optimizer.safetensors`; its manifest lists them.
Each is written into a temp folder that is fsynced and renamed into place (`astrai.io.checkpoint.atomic_dir`),
so a crash or kill at any moment leaves either the previous checkpoint set or the new one, never half a folder.
Temp folders (`.step_*.tmp-*`) are never mistaken for checkpoints and are swept on the next save.

`verify_checkpoint` checks a folder against its manifest (a truncated file, flipped bytes, a missing file all
raise `CheckpointError` naming the file); `load_checkpoint` turns an unreadable file into the same error.
A folder saved before manifests existed is accepted with only a structural check (every safetensors header
parses and covers its file, so truncation is caught; flipped bytes are not). Choosing *which* checkpoint to
resume from (newest valid one, falling back past corrupt ones) is the loop's job.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from astrai.io.checkpoint import atomic_dir, read_json, write_json
from astrai.io.errors import CheckpointError

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_FILES = ("state.json", "optimizer.safetensors", "rng.safetensors")  # listed in every manifest
_REQUIRED = (*_FILES, "model")
SHARD_INDEX = "shards/index.json"  # marks a sharded checkpoint: every rank's shard file is named in it
_SHARDED_FILES = ("state.json", "rng.safetensors", SHARD_INDEX)
STATE_FIELDS = ("step", "tokens_seen", "sampler")  # what the train loop's state.json must hold


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def checkpoint_step(path: str | Path) -> int:
    """The step a `step_NNNNNNNN` folder is named for."""
    m = _STEP_DIR.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint folder (expected a name like step_00000500)")
    return int(m.group(1))


def set_aside(path: Path, reason: str) -> Path:
    """Rename checkpoint `path` to `step_NNNNNNNN.<reason>-<id>`: kept on disk, never resumed or counted."""
    target = path.with_name(f"{path.name}.{reason}-{uuid.uuid4().hex[:8]}")
    path.rename(target)
    return target


def rng_state() -> dict[str, torch.Tensor]:
    """Generator states of this process (CPU, and CUDA when available)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_state(states: dict[str, torch.Tensor]) -> None:
    """Restore `rng_state()` output."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _digests(folder: Path, names: list[str]) -> dict[str, str]:
    # hashlib releases the GIL on large updates: a few threads hash the weight and optimizer files in parallel
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda name: _sha256(folder / name), names), strict=True))


def write_manifest(folder: Path) -> None:
    """Write `folder/manifest.json`: size and SHA-256 of every file under `folder` (paths relative, `/`-separated)."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    digests = _digests(folder, names)
    files = {name: {"bytes": (folder / name).stat().st_size, "sha256": digests[name]} for name in names}
    write_json(folder / MANIFEST, {"format": MANIFEST_FORMAT, "files": files})


def write_checkpoint(run_dir: str | Path, step: int, write: Callable[[Path], None], *, keep_last: int) -> Path:
    """Run `write(tmp)` (it writes every file, the manifest last) in a temp folder renamed to `step_NNNNNNNN`
    (`atomic_dir`), after sweeping temp folders of killed saves; then delete all but the newest `keep_last`."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step_*.tmp-*"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)
    path = atomic_dir(root / f"step_{step:08d}", write)
    for old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    write_model: Callable[[Path], None],
    optimizer: dict[str, torch.Tensor],
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Atomically write checkpoint `step` with its manifest, then delete all but the newest `keep_last` (>= 1)."""

    def write(tmp: Path) -> None:
        (tmp / "model").mkdir()
        write_model(tmp / "model")
        save_file({k: v.detach().contiguous().cpu() for k, v in optimizer.items()}, str(tmp / "optimizer.safetensors"))
        save_file(rng_state(), str(tmp / "rng.safetensors"))
        write_json(tmp / "state.json", {"step": step, **state})
        write_manifest(tmp)

    return write_checkpoint(run_dir, step, write, keep_last=keep_last)


def is_sharded(path: str | Path) -> bool:
    """Whether checkpoint folder `path` is a sharded (`--fsdp`) one: per-rank shard files, no `model/`."""
    return (Path(path) / SHARD_INDEX).is_file()


def shard_files(path: str | Path) -> list[str]:
    """The per-rank shard files a sharded checkpoint's index names (relative to `path`)."""
    index = read_json(Path(path) / SHARD_INDEX)
    world = index.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{Path(path) / SHARD_INDEX}: no valid world_size")
    return [shard_file(rank, world) for rank in range(world)]


def shard_file(rank: int, world_size: int) -> str:
    """Rank `rank`'s shard file in a sharded checkpoint of `world_size` ranks."""
    return f"shards/rank{rank:05d}-of-{world_size:05d}.safetensors"


def _required(path: Path) -> tuple[str, ...]:
    return _SHARDED_FILES if is_sharded(path) else _REQUIRED


def _check_file(path: Path, name: str, entry: Any) -> None:
    file = path / name
    if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
        raise CheckpointError(f"{path / MANIFEST}: malformed entry for {name}")
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (listed in {MANIFEST})")
    size = file.stat().st_size
    if size != entry["bytes"]:
        kind = "truncated" if size < entry["bytes"] else "wrong size"
        raise CheckpointError(f"{file}: {kind} ({size} bytes, the manifest says {entry['bytes']})")
    if _sha256(file) != entry["sha256"]:
        raise CheckpointError(f"{file}: corrupt (SHA-256 differs from the manifest)")


def verify_checkpoint(path: str | Path) -> bool:
    """Check checkpoint folder `path` against its manifest; False when it has none (saved before manifests).

    Without a manifest only the structure is checked: the required files exist and every `*.safetensors` header
    parses and covers its file (a truncated file fails; changed bytes inside a file go unnoticed).

    Raises:
        CheckpointError: naming the first file that is missing, truncated or whose SHA-256 differs.
    """
    path = Path(path)
    for name in _required(path):
        if not (path / name).exists():
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
    listed = (*_SHARDED_FILES, *shard_files(path)) if is_sharded(path) else _FILES
    if not (path / MANIFEST).is_file():
        for file in sorted(path.rglob("*.safetensors")):
            try:
                with safe_open(str(file), framework="pt"):
                    pass
            except SafetensorError as err:
                raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({err})") from None
        return False
    manifest = read_json(path / MANIFEST)
    files = manifest.get("files")
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"{path / MANIFEST}: not a format-{MANIFEST_FORMAT} checkpoint manifest")
    for name in listed:
        if name not in files:
            raise CheckpointError(f"{path / MANIFEST}: does not list {name}")
    for name, entry in files.items():
        _check_file(path, name, entry)
    return True


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except SafetensorError as err:
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({err})") from None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_state(path: Path, state: dict[str, Any]) -> None:
    """Raise `CheckpointError` unless state.json holds what resume trusts: a step that is the folder's own (a
    garbage step would set every newer, valid checkpoint aside as abandoned, or call an unfinished run finished),
    non-negative counts and a sampler position."""
    file = path / "state.json"
    for key in STATE_FIELDS:
        if key not in state:
            raise CheckpointError(f"{file}: missing field {key!r}")
    for key in ("step", "tokens_seen"):
        if not _count(state[key]):
            raise CheckpointError(f"{file}: {key!r} must be a non-negative int, got {state[key]!r}")
    named = _STEP_DIR.match(path.name)
    if named is not None and int(named.group(1)) != state["step"]:
        raise CheckpointError(f"{file}: step {state['step']} is not the folder's step {int(named.group(1))}")
    sampler = state["sampler"]
    ok = isinstance(sampler, dict) and _count(sampler.get("epoch")) and _count(sampler.get("batch"))
    if not ok or not isinstance(sampler.get("seed"), int) or isinstance(sampler.get("seed"), bool):
        raise CheckpointError(f"{file}: 'sampler' must hold an int seed and non-negative int epoch and batch, "
                              f"got {sampler!r}")  # fmt: skip


def _check_rng(file: Path, rng: dict[str, torch.Tensor]) -> None:
    """Raise `CheckpointError` unless `rng` holds generator states `set_rng_state` accepts (torch would raise a
    RuntimeError or TypeError there, after the weights were already loaded)."""
    if "cpu" not in rng:
        raise CheckpointError(f"{file}: no 'cpu' generator state")
    expected = {"cpu": torch.get_rng_state()}
    if "cuda" in rng and torch.cuda.is_available():
        expected["cuda"] = torch.cuda.get_rng_state()
    for name, want in expected.items():
        got = rng[name]
        if got.dtype != torch.uint8 or got.dim() != 1 or got.numel() != want.numel():
            raise CheckpointError(
                f"{file}: the {name!r} generator state is {str(got.dtype).removeprefix('torch.')} of shape "
                f"{tuple(got.shape)}, not uint8 of "
                f"shape ({want.numel()},)"
            )


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(state.json, optimizer tensors, rng states) of a checkpoint folder; its weights are in `path/model`
    (a sharded checkpoint: weights and optimizer state in `path/shards`, and the optimizer tensors are empty).

    Does not verify checksums (`verify_checkpoint` does).

    Raises:
        CheckpointError: a file is missing or unreadable, or state.json lacks a field (the message names it).
    """
    path = Path(path)
    for name in _required(path):
        if not (path / name).exists():
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
    state = read_json(path / "state.json")
    _check_state(path, state)
    rng = _load_tensors(path / "rng.safetensors")
    _check_rng(path / "rng.safetensors", rng)
    if is_sharded(path):  # the optimizer state is in the shards, read one tensor at a time on resume
        return state, {}, rng
    return state, _load_tensors(path / "optimizer.safetensors"), rng


def check_weights_match(folder: Path, saved: dict[str, Any], expected: dict[str, Any]) -> None:
    """Raise `CheckpointError` unless checkpoint weights `saved` (name -> full tensor, read from `folder`) have the
    names and shapes of this run's `expected` leaves (a DTensor's `.shape` is its full one).

    Why: a checkpoint of another model shape (the run's config.json, `--model` or `--tokenizer` changed since it
    was saved, or a step folder copied from another run) would otherwise fail with a size mismatch or KeyError deep
    in the in-place copy.
    """
    hint = "the checkpoint is of another model (did --model, --tokenizer, --lora or the run's config.json change?)"
    missing = sorted(set(expected) - set(saved))
    if missing:
        raise CheckpointError(f"{folder}: has no tensor {missing[0]!r} ({len(missing)} missing); {hint}")
    for name, leaf in expected.items():
        if tuple(saved[name].shape) != tuple(leaf.shape):
            raise CheckpointError(
                f"{folder}: tensor {name!r} has shape {tuple(saved[name].shape)}, this run's model has "
                f"{tuple(leaf.shape)}; {hint}"
            )


@attrs.frozen
class Resumable:
    """A checkpoint chosen for resume, read into memory (weights excepted: they are in `path/model`).

    Attributes:
        path: the checkpoint folder.
        state: its state.json.
        optimizer: its optimizer tensors.
        rng: its generator states.
        verified: whether a manifest's checksums were checked (False: saved before manifests).
        skipped: newer checkpoint folders of the run that failed verification or loading.
    """

    path: Path
    state: dict[str, Any]
    optimizer: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    verified: bool
    skipped: tuple[Path, ...] = ()

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def sharded(self) -> bool:
        """Saved by `--fsdp` ranks as per-rank shards (`astrai.train.sharded_checkpoint`)."""
        return is_sharded(self.path)


def open_checkpoint(path: str | Path) -> Resumable:
    """Verify and read one checkpoint folder; raises `CheckpointError` naming the file at fault."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    verified = verify_checkpoint(path)
    state, optimizer, rng = load_checkpoint(path)
    return Resumable(path, state, optimizer, rng, verified)


def newest_valid_checkpoint(run_dir: str | Path, *, warn: Callable[[str], None]) -> Resumable | None:
    """The newest checkpoint of a run that verifies and loads, falling back past corrupt ones.

    Args:
        run_dir: the run folder.
        warn: called with one line for each checkpoint skipped (naming the file and the problem).

    Returns:
        The checkpoint, or None when the run has no checkpoint at all.

    Raises:
        CheckpointError: the run has checkpoints but none is valid (the message lists each one's problem).
    """
    dirs = checkpoint_dirs(run_dir)
    problems: list[str] = []
    for i, path in reversed(list(enumerate(dirs))):
        try:
            found = open_checkpoint(path)
        except CheckpointError as err:
            problems.append(str(err))
            if i > 0:  # the last one's problem is in the error below
                warn(f"warning: {err}; falling back to {dirs[i - 1].name}")
            continue
        return attrs.evolve(found, skipped=tuple(d for d in dirs if checkpoint_step(d) > checkpoint_step(path)))
    if dirs:
        raise CheckpointError(
            f"no valid checkpoint in {Path(run_dir) / 'checkpoints'} ({'; '.join(problems)}); "
            "pass --resume-from DIR to choose one, or start a new run in another --out-dir"
        )
    return None

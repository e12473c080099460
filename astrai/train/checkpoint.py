"""Training checkpoints: atomic `step_NNNNNNNN/` folders under `RUN/checkpoints/`, keeping the last K.

A checkpoint holds everything a resumed run needs to continue the exact loss trajectory:
- `model/`: the weights in HF layout (a full model, or LoRA adapter files);
- `optimizer.safetensors`: the AdamW moments and step counters;
- `rng.safetensors`: torch CPU (and CUDA) generator states;
- `state.json`: step, tokens seen, sampler position, and the run's config.
Each is written into a temp folder that is fsynced and renamed into place (`astrai.io.checkpoint.atomic_dir`),
so a crash or kill at any moment leaves either the previous checkpoint set or the new one, never half a folder.
Temp folders (`.step_*.tmp-*`) are never mistaken for checkpoints and are swept on the next save.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from astrai.io.checkpoint import atomic_dir, read_json, write_json

_STEP_DIR = re.compile(r"^step_(\d{8})$")


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


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    write_model: Callable[[Path], None],
    optimizer: dict[str, torch.Tensor],
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Atomically write checkpoint `step`, then delete all but the newest `keep_last` (>= 1)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step_*.tmp-*"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)

    def write(tmp: Path) -> None:
        (tmp / "model").mkdir()
        write_model(tmp / "model")
        save_file({k: v.detach().contiguous().cpu() for k, v in optimizer.items()}, str(tmp / "optimizer.safetensors"))
        save_file(rng_state(), str(tmp / "rng.safetensors"))
        write_json(tmp / "state.json", {"step": step, **state})

    path = atomic_dir(root / f"step_{step:08d}", write)
    for old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(state.json, optimizer tensors, rng states) of a checkpoint folder; its weights are in `path/model`."""
    path = Path(path)
    for name in ("state.json", "optimizer.safetensors", "rng.safetensors", "model"):
        if not (path / name).exists():
            raise FileNotFoundError(f"checkpoint {path} is incomplete: {name} is missing")
    return (
        read_json(path / "state.json"),
        load_file(str(path / "optimizer.safetensors")),
        load_file(str(path / "rng.safetensors")),
    )

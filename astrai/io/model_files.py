"""Containment of a model folder: every file the loader reads must lie inside the folder.

A model folder is data from strangers (a download, a shared disk). A symlink `tokenizer.json -> /etc/shadow`,
a `weight_map` naming `../../other/secret.safetensors` or a `chat_template.jinja` linked out of the folder would
make `astrai.load` / `astrai serve` read (and, through errors, templates or token ids, echo) files the folder's
author never owned. `check_model_files` resolves each file the loader may read and refuses one whose real path
leaves the folder, naming it, unless the caller allows it (`astrai.load(..., allow_outside_files=True)`, the CLI's
`--allow-outside-model-files`).

Hugging Face cache snapshots are folders of symlinks into `../../blobs/`: when the folder is
`.../models--org--name/snapshots/<commit>/`, the allowed root is the `models--org--name` repo folder, so a cache
loads by default while a link out of that repo folder is still refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from astrai.io.checkpoint import read_json
from astrai.io.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
# the fixed names the loader reads when present (astrai.io.model.load, Tokenizer.from_dir, load_chat_templates)
_NAMED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja", INDEX_FILE)  # fmt: skip


def allowed_root(folder: Path) -> Path:
    """The real folder files may resolve into: the repo folder for a HF cache snapshot, else the folder itself."""
    real = folder.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def _inside(path: Path, root: Path) -> bool:
    real = path.resolve()
    return real == root or root in real.parents


def model_file_paths(folder: Path) -> list[Path]:
    """The files of `folder` the loader may read: the fixed names, templates, shards and the index's shards."""
    paths = [folder / name for name in _NAMED if os.path.lexists(folder / name)]
    extra = folder / "additional_chat_templates"
    if os.path.lexists(extra):
        paths.append(extra)
        if extra.is_dir():
            paths += sorted(extra.glob("*.jinja"))
    paths += sorted(folder.glob("*.safetensors"))
    index = folder / INDEX_FILE
    if index.is_file() and _inside(index, allowed_root(folder)):
        weight_map = read_json(index).get("weight_map")
        if isinstance(weight_map, dict):
            paths += sorted({folder / str(file) for file in weight_map.values()})
    return paths


def check_model_files(folder: str | Path, allow_outside: bool = False) -> None:
    """Refuse a model folder one of whose files resolves outside it (see the module docstring).

    Raises:
        CheckpointError: naming the first file whose real path leaves the allowed root, and the flag that allows it.
    """
    if allow_outside:
        return
    folder = Path(folder)
    root = allowed_root(folder)
    for path in model_file_paths(folder):
        if not _inside(path, root):
            raise CheckpointError(
                f"{path} resolves to {path.resolve()}, outside the model folder {root}; refusing to read it "
                "(pass --allow-outside-model-files, or allow_outside_files=True to astrai.load, if you trust it)"
            )

"""Model names -> folders: a local folder, or a Hugging Face model id found in the local Hugging Face cache.

`resolve_model("Qwen/Qwen3-0.6B")` finds the snapshot that `huggingface-cli download Qwen/Qwen3-0.6B` (or
`hf download`, or transformers' `from_pretrained`) left in the cache, without any network access, so users
coming from transformers and vLLM can keep typing model ids. The cache is laid out by huggingface_hub:

    $HF_HUB_CACHE/models--Qwen--Qwen3-0.6B/refs/main          (holds the commit hash of the branch)
    $HF_HUB_CACHE/models--Qwen--Qwen3-0.6B/snapshots/<commit>/ (config.json, *.safetensors, tokenizer.json ...)

The cache folder is `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else
`$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub` (huggingface_hub's own order). A revision is a
branch or tag (looked up in `refs/`) or a commit hash (a snapshot folder's name); the default is `main`, and a cache
without `refs/main` but with exactly one snapshot uses that snapshot. We read the layout ourselves rather than
depend on huggingface_hub at run time: it is a few lines, and huggingface_hub is a test-only reference here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from astrai.io.errors import CheckpointError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REVISION = re.compile(r"^[\w.-][\w./-]{0,254}$")


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache folder, from the environment as huggingface_hub computes it."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg).expanduser() / "huggingface" / "hub"


def looks_like_repo_id(name: str) -> bool:
    """Whether `name` has the shape of a Hub model id (`org/name` or `name`; no `..`, no leading `/`)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".", "-"))


def _download_hint(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return (f"download it first with `huggingface-cli download {repo_id}{rev}` (or `hf download`, which fill the "
            "Hugging Face cache), or pass a model folder")  # fmt: skip


def _snapshot(repo_dir: Path, repo_id: str, revision: str | None) -> Path:
    """The snapshot folder of `revision` in one repo's cache folder."""
    snapshots = repo_dir / "snapshots"
    if revision is not None and _COMMIT.match(revision) and (snapshots / revision).is_dir():
        return snapshots / revision
    ref = repo_dir / "refs" / (revision or "main")
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8", errors="replace").strip()
        if _COMMIT.match(commit) and (snapshots / commit).is_dir():
            return snapshots / commit
        hint = _download_hint(repo_id, revision)
        raise CheckpointError(f"{repo_id}: the cache's {ref} names snapshot {commit[:64]!r}, which is not in "
                              f"{snapshots}: the download is incomplete; {hint}")  # fmt: skip
    found = sorted(p.name for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if revision is None and len(found) == 1:
        return snapshots / found[0]
    what = f"revision {revision!r}" if revision else "`main` ref"
    listed = f" (snapshots there: {', '.join(found)})" if found else ""
    raise CheckpointError(f"{repo_id}: the Hugging Face cache at {repo_dir} has no {what}{listed}; pass --revision, "
                          f"or {_download_hint(repo_id, revision)}")  # fmt: skip


def resolve_model(name: str | Path, revision: str | None = None) -> Path:
    """The folder of a model given as a local folder or a Hugging Face model id (local cache only, no network).

    Args:
        name: a folder path, or a model id such as `Qwen/Qwen3-0.6B`. An existing folder always wins.
        revision: a branch, tag or commit hash of a model id (default `main`); not allowed with a folder.

    Raises:
        CheckpointError: neither a folder nor a cached model id; the message says where it looked and how to
            download the model.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise CheckpointError(f"{name}: --revision applies to Hugging Face model ids, and this is a local folder")
        return path
    text = str(name)
    if revision is not None and not (_REVISION.match(revision) and ".." not in revision):
        raise CheckpointError(f"revision {revision[:80]!r} is not a branch, tag or commit name")
    if not looks_like_repo_id(text):
        raise CheckpointError(f"{text}: no such model folder (nor a Hugging Face model id such as Qwen/Qwen3-0.6B)")
    cache = hf_cache_dir()
    repo_dir = cache / ("models--" + text.replace("/", "--"))
    if not repo_dir.is_dir():
        raise CheckpointError(f"{text}: no such model folder, and the Hugging Face cache ({cache}) does not hold this "
                              f"model id; {_download_hint(text, revision)}")  # fmt: skip
    folder = _snapshot(repo_dir, text, revision)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{text}: the cached snapshot {folder} has no config.json (a partial download?); "
                              f"{_download_hint(text, revision)}")  # fmt: skip
    return folder

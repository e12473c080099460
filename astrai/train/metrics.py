"""Training metrics history: one JSON object per line, appended as training runs, readable after a crash.

Each line is `{"type": "train" | "eval", "step": int, "time": float, **values}` (`time` is Unix seconds).
The file is opened line-buffered and flushed after every entry, so a killed run keeps everything it logged;
`read_metrics` skips a truncated last line (a crash mid-write). Resuming from a checkpoint at step N
(`MetricsLog(path, resume_step=N)`) first rewrites the file atomically keeping only entries with step <= N, so
the history matches the checkpoint; a fresh run (`resume_step=None`) starts an empty file.

Values are stored as plain JSON: 0-d tensors and numpy scalars become Python numbers (`.item()`, which syncs a
CUDA tensor). Non-finite floats are not valid JSON, so NaN / inf / -inf are written as the strings "NaN",
"Infinity" and "-Infinity" (a diverged loss stays visible in the history) and `read_metrics` turns them back
into floats.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

Kind = Literal["train", "eval"]
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_RESERVED = ("type", "step", "time")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, fsync, then `os.replace`: readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _plain(name: str, value: Any) -> Any:
    """Convert one logged value to a JSON-safe Python value; non-finite floats become strings."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if not isinstance(value, (int, float)) and hasattr(value, "item"):  # 0-d tensor, numpy scalar
        try:
            value = value.item()
        except (RuntimeError, ValueError) as e:
            raise TypeError(f"metric {name!r}: expected a scalar, got a value with shape {value.shape}") from e
    if isinstance(value, int):  # bool included
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    raise TypeError(f"metric {name!r}: expected a number, string or None, got {type(value).__name__}")


def _decode(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: _NONFINITE.get(v, v) if isinstance(v, str) and k != "type" else v for k, v in entry.items()}


def read_metrics(path: str | Path, kind: Kind | None = None) -> list[dict[str, Any]]:
    """Read a metrics JSONL file (optionally only `kind` entries); a truncated last line is skipped, others raise."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == last:  # a crash mid-write leaves at most one partial line, at the end
                break
            raise ValueError(f"{path}:{i + 1}: malformed metrics line: {e}") from e
        if kind is None or entry.get("type") == kind:
            out.append(_decode(entry))
    return out


class MetricsLog:
    """Append-only metrics JSONL writer; `resume_step=N` keeps only the history up to the resumed checkpoint."""

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            atomic_write_bytes(self.path, b"")
        else:
            kept = read_metrics(self.path) if self.path.exists() else []
            kept = [e for e in kept if e.get("step", 0) <= resume_step]
            atomic_write_bytes(self.path, "".join(self._line(e) for e in kept).encode("utf-8"))
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)

    @staticmethod
    def _line(entry: dict[str, Any]) -> str:
        plain = {k: _plain(k, v) for k, v in entry.items()}
        return json.dumps(plain, allow_nan=False, ensure_ascii=False) + "\n"

    def log(self, kind: Kind, step: int, values: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        """Append one entry and flush it to the OS; returns the entry as written (non-finite floats as strings)."""
        if kind not in ("train", "eval"):
            raise ValueError(f"kind must be 'train' or 'eval', got {kind!r}")
        values = {**(values or {}), **kw}
        if clash := [k for k in _RESERVED if k in values]:
            raise ValueError(f"metric names {clash} are reserved")
        if self._file.closed:
            raise ValueError(f"MetricsLog({self.path}) is closed")
        entry = {"type": kind, "step": int(_plain("step", step)), "time": round(time.time(), 3), **values}
        line = self._line(entry)
        self._file.write(line)
        self._file.flush()
        return json.loads(line)

    def train(self, step: int, **values: Any) -> dict[str, Any]:
        """Log a training entry, e.g. `log.train(step, loss=loss, lr=lr)`."""
        return self.log("train", step, values)

    def eval(self, step: int, **values: Any) -> dict[str, Any]:
        """Log an evaluation entry, e.g. `log.eval(step, loss=val_loss)`."""
        return self.log("eval", step, values)

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

"""`Report`: what every evaluation task returns, and how it is shown.

A task's summary is one flat JSON object, `{"task": ..., "model": ..., metric: value, ...}`, printed as the
**last line of stdout** so scripts can `tail -n 1 | jq`; before it a rich table shows the same numbers for
people. Per-sample results (one JSON object per line) go to `--out FILE` when given, written atomically (a temp
file renamed over it, removed on any failure). `check_out` refuses, before the run, an `--out` that is a folder,
the same file as an input (`--data`, ...), or a file of the model folder: writing it would replace that file.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table


@attrs.frozen(kw_only=True)
class Report:
    """The result of one evaluation run.

    Attributes:
        task: the task name (`ppl`, `mc`, `humaneval`, ...).
        model: the model as the user named it (folder or model id).
        metrics: flat name -> number (or short string) summary, in display order.
        samples: per-sample records (JSON-serialisable), written by `write_samples`.
        groups: optional per-group rows (e.g. per MMLU subject): group name -> metrics, shown as a second table.
    """

    task: str
    model: str
    metrics: Mapping[str, Any]
    samples: Sequence[Mapping[str, Any]] = ()
    groups: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)

    def summary(self) -> dict[str, Any]:
        """The JSON summary: task, model, then the metrics (non-finite floats as null: JSON has no NaN)."""
        return {"task": self.task, "model": self.model, **{k: _json_number(v) for k, v in self.metrics.items()}}


def _json_number(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def check_out(out: Path | None, inputs: Mapping[str, Path | None], model: str | Path | None = None) -> None:
    """Refuse an `--out` file that cannot be written or whose writing would destroy an input; None passes.

    Args:
        out: the per-sample results file.
        inputs: flag -> file the run reads (`{"--data": path}`); missing or unset ones are skipped.
        model: the model folder (or model id): `--out` may not be one of its HF files (config, weights, tokenizer).

    Raises:
        ValueError: `out` is a folder, sits under a file, is the same file as an input (also through a link), or
            is a model folder file; the message names both.
    """
    if out is None:
        return
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give a file path for the per-sample results (JSON lines)")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, so the results file cannot be created under it")
    for flag, path in inputs.items():
        if path is not None and out.exists() and Path(path).exists() and os.path.samefile(out, path):
            raise ValueError(f"--out {out} is the input {flag} {path}: writing the results would replace it; "
                             "give another file")  # fmt: skip
    if model and Path(model).is_dir() and out.resolve().parent == Path(model).resolve():
        from fnmatch import fnmatchcase

        from astrai.io.checkpoint import MODEL_FOLDER_ENTRIES

        if any(fnmatchcase(out.name, pattern) for pattern in MODEL_FOLDER_ENTRIES):
            raise ValueError(f"--out {out} is a file of the model folder {model}: writing the results there would "
                             "break the model; give another file")  # fmt: skip


def write_samples(samples: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Per-sample records as JSON lines, written to a temporary file then renamed (no half-written file; the temp
    file is removed if anything fails).

    Raises:
        IsADirectoryError: `path` is a folder.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"cannot write the per-sample results to {path}: it is a folder, give a file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for record in samples:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def show(report: Report, *, out: Path | None = None, console: Console | None = None) -> None:
    """Print the table(s) on `console` (default: stdout), write the samples to `out` when given, then print the
    JSON summary as the last line of stdout."""
    console = console or Console()
    table = Table(title=f"{report.task} — {report.model}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in report.metrics.items():
        table.add_row(name, _fmt(value))
    console.print(table)
    if report.groups:
        columns = list(dict.fromkeys(k for row in report.groups.values() for k in row))
        groups = Table(title="per group")
        groups.add_column("group")
        for column in columns:
            groups.add_column(column, justify="right")
        for name, row in report.groups.items():
            groups.add_row(name, *(_fmt(row.get(c, "")) for c in columns))
        console.print(groups)
    if out is not None:
        write_samples(report.samples, out)
        console.print(f"[dim]{len(report.samples)} per-sample records -> {out}[/]")
    sys.stdout.write(json.dumps(report.summary()) + "\n")
    sys.stdout.flush()

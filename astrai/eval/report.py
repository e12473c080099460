"""`Report`: what every evaluation task returns, and how it is shown.

A task's summary is one flat JSON object, `{"task": ..., "model": ..., metric: value, ...}`, printed as the
**last line of stdout** so scripts can `tail -n 1 | jq`; before it a rich table shows the same numbers for
people. Per-sample results (one JSON object per line) go to `--out FILE` when given, written atomically.
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


def write_samples(samples: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Per-sample records as JSON lines, written to a temporary file then renamed (no half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in samples:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


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

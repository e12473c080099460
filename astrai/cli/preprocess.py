"""`astrai preprocess CONFIG.json`: tokenize, mask and pack JSONL into memory-mapped training shards.

The JSON config (format in docs/data.md) says what to read and how; flags override its paths. The run prints
a progress bar, then a table of counts with a few `file:line` samples for each reason a record was skipped.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import tyro
from rich.markup import escape
from rich.table import Table

from astrai.cli._common import console, fail, run_guarded


@attrs.frozen(kw_only=True)
class PreprocessConfig:
    """Preprocess JSONL records into training shards."""

    config: tyro.conf.Positional[Path]
    """The JSON preprocessing config."""
    output: Path | None = None
    """Output folder (overrides the config's `output`)."""
    tokenizer: Path | None = None
    """Tokenizer folder (overrides the config's `tokenizer`)."""
    inputs: tuple[Path, ...] = ()
    """JSONL files or folders to read instead of the config's `inputs`."""
    overwrite: bool = False
    """Replace the output folder of a previous run (meta.json + shards only; a folder holding anything else, an
    input or the tokenizer is refused), once the new one is complete."""
    progress: bool = True
    """Show a progress bar."""


def _report_table(report) -> Table:
    table = Table(title="astrai preprocess", show_header=False)
    for name in ("records", "kept", "truncated", "shards", "rows", "tokens", "trained_tokens"):
        table.add_row(name, f"{getattr(report, name):,}")
    for reason, count in report.skipped.most_common():
        table.add_row(f"skipped: {reason}", f"{count:,}")
    return table


def main(cfg: PreprocessConfig) -> None:
    """Load the config, apply the overrides, run the preprocessing and print the report."""
    from astrai.data.config import load_config
    from astrai.data.preprocess import preprocess

    data = run_guarded(lambda: load_config(cfg.config))
    overrides = {
        "output": None if cfg.output is None else str(cfg.output),
        "tokenizer": None if cfg.tokenizer is None else str(cfg.tokenizer),
        "inputs": tuple(str(p) for p in cfg.inputs) or None,
    }
    data = attrs.evolve(data, **{k: v for k, v in overrides.items() if v is not None})
    try:
        report = preprocess(data, overwrite=cfg.overwrite, progress=cfg.progress)
    except (FileNotFoundError, ValueError, OSError) as err:
        fail(str(err))
    console.print(_report_table(report))
    for reason, samples in report.samples.items():
        console.print(f"[yellow]{reason}[/] e.g.", highlight=False)
        for sample in samples:
            console.print(f"  {sample}", highlight=False, soft_wrap=True, markup=False)
    console.print(f"wrote [bold]{escape(str(data.output))}[/]")


if __name__ == "__main__":
    main(tyro.cli(PreprocessConfig))

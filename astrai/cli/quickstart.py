"""`astrai quickstart`: the README's `make run` — train a small chat model on CPU in minutes and evaluate it."""

from __future__ import annotations

import attrs
import tyro

from astrai.cli._common import console, run_guarded
from astrai.cli.train import resolve_model
from astrai.quickstart.run import QuickstartSettings, run_quickstart

__all__ = ["QuickstartConfig", "main"]


@attrs.frozen(kw_only=True)
class QuickstartConfig(QuickstartSettings):
    """Train and evaluate a small chat model on CPU in minutes."""


def main(cfg: QuickstartConfig) -> None:
    """Run the quickstart with `cfg` (its `--model` name resolved from `configs/models.py`, as `astrai train` does)."""
    run_guarded(lambda: run_quickstart(cfg, console, model_cfg=resolve_model(cfg.model)))


if __name__ == "__main__":
    main(tyro.cli(QuickstartConfig))

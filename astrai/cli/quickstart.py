"""`astrai quickstart`: the README's `make run` — train a small chat model on CPU in minutes and evaluate it.

`--rl` adds the RL quickstart (`astrai.quickstart.rl`): online GRPO of that SFT model (trained first when
missing) on paraphrased additions, reporting `accuracy before RL` and `accuracy after RL`; `--grpo.*` sets it.
"""

from __future__ import annotations

import attrs
import tyro

from astrai.cli._common import console, run_guarded
from astrai.cli.train import resolve_model
from astrai.quickstart.rl import RLSettings, run_rl
from astrai.quickstart.run import QuickstartSettings, run_quickstart

__all__ = ["QuickstartConfig", "main"]


@attrs.frozen(kw_only=True)
class QuickstartConfig(QuickstartSettings):
    """Train and evaluate a small chat model on CPU in minutes."""

    rl: bool = False
    """Run the RL quickstart: GRPO of out_dir/model (trained first when missing) on paraphrased questions."""
    grpo: RLSettings = RLSettings()
    """The RL quickstart's GRPO settings (with --rl)."""


def main(cfg: QuickstartConfig) -> None:
    """Run the quickstart with `cfg` (its `--model` name resolved from `configs/models.py`, as `astrai train` does)."""
    if cfg.rl:
        run_guarded(lambda: run_rl(cfg, cfg.grpo, console, model_cfg=resolve_model(cfg.model)))
    else:
        run_guarded(lambda: run_quickstart(cfg, console, model_cfg=resolve_model(cfg.model)))


if __name__ == "__main__":
    main(tyro.cli(QuickstartConfig))

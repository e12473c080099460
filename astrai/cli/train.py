"""`astrai train RECIPE|RUN/config.json [--field value ...]`: run or resume a training run.

The first argument picks the base config: a named recipe from `configs/recipes.py` or a saved run config
(a run folder or its config.json, to re-run or `--resume` it); tyro flags override any field of it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tyro

from astrai.cli._common import console, fail, run_guarded


def _usage(recipes: list[str]) -> str:
    return (
        "usage: astrai train RECIPE|RUN_DIR|CONFIG.json [--field value ...]\n"
        f"recipes: {', '.join(recipes)}\n"
        "see `astrai train RECIPE --help` for every field"
    )


def cli(args: list[str]) -> None:
    """Parse `args` (after `astrai train`) and train."""
    from astrai.train.config import TrainConfig, load_config
    from configs.recipes import RECIPES

    if not args or args[0] in ("-h", "--help"):
        console.print(_usage(sorted(RECIPES)), highlight=False)
        return
    first, rest = args[0], args[1:]
    if first in RECIPES:
        base = RECIPES[first]()
    elif Path(first).suffix == ".json" or Path(first).is_dir():
        base = run_guarded(lambda: load_config(first))
    else:
        fail(f"unknown recipe {first!r}; choose one of {', '.join(sorted(RECIPES))} or pass a run's config.json")
    # AvoidSubcommands: optional nested configs (lora) take plain flags (--lora.r 8) when the base config sets them
    cfg = run_guarded(lambda: tyro.cli(TrainConfig, default=base, args=rest, prog=f"astrai train {first}",
                                       config=(tyro.conf.AvoidSubcommands,)))  # fmt: skip
    main(cfg)


def main(cfg) -> None:
    """Train with `cfg` and print where the results went."""
    from astrai.train.loop import train

    result = run_guarded(lambda: train(cfg))
    if result.stopped_early:
        console.print(f"stopped at step {result.steps}; continue with: astrai train {result.run_dir} --resume")
        return
    console.print(f"done: {result.steps} steps, final loss {result.final_loss:.4f}"
                  + (f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""))  # fmt: skip
    if result.model_dir is not None:
        console.print(f"model: {result.model_dir}\nserve it: astrai serve --model {result.model_dir}")


if __name__ == "__main__":
    cli(sys.argv[1:])

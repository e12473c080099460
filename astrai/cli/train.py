"""`astrai train RECIPE|RUN/config.json [--field value ...]`: run or resume a training run.

The first argument picks the base config: a named recipe from `configs/recipes.py` or a saved run config
(a run folder or its config.json, to re-run or `--resume` it); tyro flags override any field of it.
`--model` names a config from `configs/models.py` (resolved here to a `ModelConfig` for the loop, which never
imports `configs/`) or a model folder to fine-tune.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import tyro

from astrai.cli._common import console, fail, run_guarded

if TYPE_CHECKING:
    from astrai.models.config import ModelConfig
    from astrai.train.config import TrainConfig


def _usage(recipes: list[str]) -> str:
    return (
        "usage: astrai train RECIPE|RUN_DIR|CONFIG.json [--field value ...]\n"
        f"recipes: {', '.join(recipes)}\n"
        "see `astrai train RECIPE --help` for every field"
    )


def cli(args: list[str]) -> None:
    """Parse `args` (after `astrai train`) and train."""
    from astrai.configs.recipes import RECIPES
    from astrai.train.config import TrainConfig, load_config

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


def resolve_model(model: str) -> ModelConfig | None:
    """The `ModelConfig` of a named config in `configs/models.py`, or None when `model` is a model folder or a
    Hugging Face model id in the local cache (`astrai.io.hub.resolve_model`).

    Raises:
        ValueError: `model` is none of these (the message lists the names).
    """
    from astrai.configs.models import NAMED
    from astrai.io.hub import resolve_model as resolve_checkpoint

    if model in NAMED:
        return NAMED[model]()
    try:
        resolve_checkpoint(model)
    except ValueError as err:
        raise ValueError(f"model {model!r} is neither a named config ({', '.join(sorted(NAMED))}) nor a folder "
                         f"or cached model id ({err})") from None  # fmt: skip
    return None


def main(cfg: TrainConfig) -> None:
    """Train with `cfg` and print where the results went.

    Exits 2 with one `error:` line on bad input, an unusable checkpoint or a diverged (NaN/inf) step; exits 0
    when `--resume` finds the run already finished (saying so).
    """
    from astrai.train.loop import NonFiniteError, train

    try:
        result = run_guarded(lambda: train(cfg, resolve_model(cfg.model)))
    except NonFiniteError as err:
        fail(str(err))
    if result.stopped_early:
        console.print(f"stopped at step {result.steps}; continue with: astrai train {result.run_dir} --resume")
        return
    if result.already_finished:
        console.print(f"{result.run_dir} is already finished: its checkpoint is at step {result.steps} "
                      f"(--steps {cfg.steps}); nothing to do (raise --steps to train further)")  # fmt: skip
    else:
        losses = {"final loss": result.final_loss, "eval loss": result.eval_loss}  # None when no step ran
        console.print(
            ", ".join([f"done: {result.steps} steps", *(f"{k} {v:.4f}" for k, v in losses.items() if v is not None)])
        )
    if result.model_dir is not None:
        console.print(f"model: {result.model_dir}\nserve it: astrai serve --model {result.model_dir}")


if __name__ == "__main__":
    cli(sys.argv[1:])

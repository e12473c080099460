"""The `astrai` entry point: `astrai <subcommand> [--flags]` (tyro-generated help for each)."""

from __future__ import annotations

import sys

import attrs
import tyro

from astrai.cli import chat, generate, info, preprocess, quickstart, serve
from astrai.cli import train as train_cli


@attrs.frozen
class TrainCommand:
    """Train or resume a run: `astrai train RECIPE|RUN_DIR [--field value ...]` (`astrai train --help`)."""


COMMANDS = {
    "info": (info.InfoConfig, info.main),
    "generate": (generate.GenerateConfig, generate.main),
    "chat": (chat.ChatConfig, chat.main),
    "serve": (serve.ServeConfig, serve.main),
    "preprocess": (preprocess.PreprocessConfig, preprocess.main),
    "quickstart": (quickstart.QuickstartConfig, quickstart.main),
    # listed for `astrai --help` only: `main` hands `astrai train ...` to astrai.cli.train before tyro parses
    "train": (TrainCommand, None),
}


def main(args: list[str] | None = None) -> None:
    """Parse the command line and run the chosen subcommand.

    `astrai train RECIPE [--overrides]` takes a recipe name (or a run's config.json) before its flags, so it is
    parsed by `astrai.cli.train`; every other subcommand is a tyro config class.
    """
    args = sys.argv[1:] if args is None else list(args)
    if args and args[0] == "train":
        train_cli.cli(args[1:])
        return
    cfg = tyro.extras.subcommand_cli_from_dict(
        {name: cls for name, (cls, _) in COMMANDS.items()}, args=args, prog="astrai"
    )
    for cls, run in COMMANDS.values():
        if isinstance(cfg, cls):
            run(cfg)
            return


if __name__ == "__main__":
    main()

"""The `astrai` entry point: `astrai <subcommand> [MODEL] [--flags]` (tyro-generated help for each).

`info`, `generate`, `chat` and `serve` take the model as their first argument, as vLLM does (`astrai serve
Qwen/Qwen3-0.6B`); `--model MODEL` is accepted too (rewritten to the positional before tyro parses).
"""

from __future__ import annotations

import sys

import attrs
import tyro

from astrai.cli import chat, generate, info, preprocess, quickstart, serve
from astrai.cli import eval as eval_cli
from astrai.cli import train as train_cli
from astrai.cli._common import MODEL_COMMANDS, model_flag_to_positional


@attrs.frozen
class TrainCommand:
    """Train or resume a run from a recipe or a run folder."""


@attrs.frozen
class EvalCommand:
    """Evaluate a model: ppl, mc, humaneval, ifeval, rouge, ifd."""


COMMANDS = {
    "info": (info.InfoConfig, info.main),
    "generate": (generate.GenerateConfig, generate.main),
    "chat": (chat.ChatConfig, chat.main),
    "serve": (serve.ServeConfig, serve.main),
    "preprocess": (preprocess.PreprocessConfig, preprocess.main),
    "quickstart": (quickstart.QuickstartConfig, quickstart.main),
    # listed for `astrai --help` only: `main` hands `astrai train ...` / `astrai eval ...` to their own parsers
    "train": (TrainCommand, None),
    "eval": (EvalCommand, None),
}


def main(args: list[str] | None = None) -> None:
    """Parse the command line and run the chosen subcommand.

    `astrai train RECIPE [--overrides]` takes a recipe name (or a run's config.json) before its flags, so it is
    parsed by `astrai.cli.train`; `astrai eval TASK ...` has a subcommand per task (`astrai.cli.eval`); every
    other subcommand is a tyro config class.
    """
    args = sys.argv[1:] if args is None else list(args)
    if args and args[0] == "train":
        train_cli.cli(args[1:])
        return
    if args and args[0] == "eval":
        eval_cli.cli(args[1:])
        return
    if args and args[0] in MODEL_COMMANDS:
        args = [args[0], *model_flag_to_positional(args[1:])]
    cfg = tyro.extras.subcommand_cli_from_dict(
        {name: cls for name, (cls, _) in COMMANDS.items()}, args=args, prog="astrai"
    )
    for cls, run in COMMANDS.values():
        if isinstance(cfg, cls):
            run(cfg)
            return


if __name__ == "__main__":
    main()

"""The `astrai` entry point: `astrai <subcommand> [--flags]` (tyro-generated help for each)."""

from __future__ import annotations

import tyro

from astrai.cli import chat, generate, info, serve

COMMANDS = {
    "info": (info.InfoConfig, info.main),
    "generate": (generate.GenerateConfig, generate.main),
    "chat": (chat.ChatConfig, chat.main),
    "serve": (serve.ServeConfig, serve.main),
}


def main(args: list[str] | None = None) -> None:
    """Parse the command line and run the chosen subcommand."""
    cfg = tyro.extras.subcommand_cli_from_dict(
        {name: cls for name, (cls, _) in COMMANDS.items()}, args=args, prog="astrai"
    )
    for cls, run in COMMANDS.values():
        if isinstance(cfg, cls):
            run(cfg)
            return


if __name__ == "__main__":
    main()

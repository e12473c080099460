"""`astrai eval TASK --model MODEL [task flags] [--out FILE]`: evaluate a model (docs/evaluation.md).

Each task is a module of `astrai.eval` with a `Config` (its flags, tyro subcommand) and
`evaluate(cfg, model=None) -> Report`; this file only parses, runs the task with user errors turned into one
`error:` line and exit status 2, and shows the report (rich table, then the JSON summary as the last stdout line,
per-sample JSON lines to `--out`). The model may also be given as the first argument after the task
(`astrai eval ppl MODEL --data F`), as `astrai generate MODEL` takes it. `--out` is checked before the run: a
folder, an input file (`--data`, ...) or a model file is refused (`astrai.eval.report.check_out`).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import attrs
import tyro

from astrai.cli._common import console, run_guarded

TASKS = {
    "ppl": "astrai.eval.ppl",
    "mc": "astrai.eval.mc",
    "humaneval": "astrai.eval.humaneval",
    "ifeval": "astrai.eval.ifeval",
    "rouge": "astrai.eval.rouge",
    "ifd": "astrai.eval.ifd",
}
"""Subcommand -> module (`Config` + `evaluate`). A module not (yet) in the package is left out."""


def tasks() -> dict[str, ModuleType]:
    """The task modules present, by subcommand name."""
    found = {}
    for name, path in TASKS.items():
        try:
            found[name] = importlib.import_module(path)
        except ModuleNotFoundError as err:
            if err.name != path:
                raise
    return found


def model_positional_to_flag(args: list[str]) -> list[str]:
    """`TASK MODEL ...` -> `TASK --model MODEL ...`: the model may come first, as in `astrai generate MODEL`."""
    if len(args) >= 2 and not args[0].startswith("-") and not args[1].startswith("-"):
        return [args[0], "--model", args[1], *args[2:]]
    return list(args)


def input_paths(cfg: object) -> dict[str, Path]:
    """The file flags of a task config (every Path-valued field but `out`), as `{"--data": path}`."""
    fields = attrs.asdict(cfg, recurse=False) if attrs.has(type(cfg)) else {}
    return {f"--{k.replace('_', '-')}": v for k, v in fields.items() if k != "out" and isinstance(v, Path)}


def cli(args: list[str]) -> None:
    """Parse `args` (the words after `astrai eval`), run the task and show its report."""
    from astrai.eval.common import EvalConfig, check
    from astrai.eval.report import check_out, show

    modules = tasks()
    cfg = tyro.extras.subcommand_cli_from_dict({name: m.Config for name, m in modules.items()},
                                               args=model_positional_to_flag(args), prog="astrai eval")  # fmt: skip
    module = next(m for m in modules.values() if isinstance(cfg, m.Config))
    if isinstance(cfg, EvalConfig):
        run_guarded(lambda: check(cfg))
    out = getattr(cfg, "out", None)
    run_guarded(lambda: check_out(out, input_paths(cfg), getattr(cfg, "model", None)))
    report = run_guarded(lambda: module.evaluate(cfg))
    run_guarded(lambda: show(report, out=cfg.out, console=console))


if __name__ == "__main__":
    cli(sys.argv[1:])

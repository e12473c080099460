"""Shared CLI plumbing: loading a model with a friendly error, and rich console helpers."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

from rich.console import Console

T = TypeVar("T")
console = Console()
err_console = Console(stderr=True)

# Errors users can cause (bad paths, unsupported checkpoints, bad arguments): one red line, no traceback.
USER_ERRORS = (FileNotFoundError, ValueError, KeyError, OSError)


def fail(message: str) -> NoReturn:
    """Print `error: message` to stderr and exit with status 2."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    sys.exit(2)


def run_guarded(fn: Callable[[], T]) -> T:
    """Run `fn`, turning user errors into `fail` instead of a traceback."""
    try:
        return fn()
    except USER_ERRORS as err:
        fail(str(err) if not isinstance(err, KeyError) else f"missing key {err}")


def load_model(path: Path, dtype: str | None = None, device: str = "auto"):
    """`astrai.load` with a friendly error on bad input; says which device it chose (`auto`: CUDA if present)."""
    from astrai.io.model import load, resolve_device

    chosen = resolve_device(device)
    console.print(f"device: {chosen}" + (" (auto)" if device == "auto" else ""), highlight=False)
    return run_guarded(lambda: load(path, dtype=dtype, device=chosen))

"""What the scoring tasks (ppl, mc, rouge, ifd) share: the common flags, loading the model, a progress bar.

`EvalConfig` holds the flags of every such `astrai eval TASK` (model, dtype, device, batch size, limit, output
file); each task's `Config` subclasses it. `load_model` resolves `--device auto` and insists on a tokenizer
(every task reads text). `progress` draws a rich bar on stderr, so stdout keeps only the table and the JSON
summary. Generation for a whole dataset is `astrai.eval.engine_batch.generate_all`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import attrs
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from astrai.io.model import Model, load, resolve_device

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@attrs.frozen(kw_only=True)
class EvalConfig:
    """Flags shared by every `astrai eval` task."""

    model: str
    """Model folder (HF format) or Hugging Face model id in the local HF cache; may also come first, as in
    `astrai eval ppl MODEL --data F`."""
    revision: str | None = None
    """Branch, tag or commit of a Hugging Face model id (None: main)."""
    dtype: Dtype = "auto"
    """Parameter dtype; auto: the checkpoint's."""
    device: str = "auto"
    """Device: auto (CUDA when available, else CPU), cuda, cuda:N or cpu."""
    quantize: Literal["int8"] | None = None
    """int8: evaluate the int8 weight-only quantized model (`astrai.load(..., quantize="int8")`)."""
    batch_size: int = 8
    """Sequences per forward pass (scoring) or decoding at once (generation)."""
    limit: int | None = None
    """Evaluate only the first N samples."""
    out: Path | None = None
    """Write per-sample results (JSON lines) to this file."""


def check(cfg: EvalConfig) -> None:
    """Validate the shared flags (not in `__attrs_post_init__`: tyro would print a traceback-like box for it).

    Raises:
        ValueError: a batch size or limit below 1.
    """
    if cfg.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if cfg.limit is not None and cfg.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {cfg.limit}")


def load_model(cfg: EvalConfig, task: str) -> Model:
    """Load `cfg.model` on `cfg.device` in `cfg.dtype` (quantized when `cfg.quantize` says so).

    Raises:
        ValueError: the model cannot be loaded (`CheckpointError`), or it has no tokenizer.
    """
    dtype = None if cfg.dtype == "auto" else cfg.dtype
    device = resolve_device(cfg.device)
    model = load(cfg.model, dtype=dtype, device=device, revision=cfg.revision, quantize=cfg.quantize)
    if model.quantization is not None:  # stderr: stdout keeps the table and the JSON summary
        _console.print(f"weights: {model.quantization} weight-only, {model.nbytes / 2**20:.1f} MiB", highlight=False)
    return require_tokenizer(model, cfg.model, task)


def require_tokenizer(model: Model, name: str, task: str) -> Model:
    """`model`, or a ValueError naming it when it has no tokenizer (every task reads text)."""
    if model.tokenizer is None:
        raise ValueError(f"{name} has no tokenizer (no tokenizer.json in its folder); astrai eval {task} reads text")
    return model


def first(items: Sequence, limit: int | None) -> list:
    """The first `limit` items (all when None)."""
    return list(items if limit is None else items[:limit])


_console = Console(stderr=True)


@contextmanager
def progress(total: int, description: str) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr over `total` units; yields `advance(n)`. Removed when done."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=_console, transient=True, disable=not _console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)

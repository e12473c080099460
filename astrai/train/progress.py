"""Rich progress bar for training: step, loss, lr, grad norm, tokens/s and ETA on one live line."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    """Context manager; `update(step, metrics)` after each step, `note(text)` prints above the bar."""

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self.total = total
        self._progress = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            disable=not enabled,
        )
        self._task = self._progress.add_task("train", total=total, completed=start, stats="")

    def __enter__(self) -> TrainProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """Advance the bar to `step` and show the step's metrics."""
        stats = (
            f"loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  "
            f"gnorm {metrics['grad_norm']:.3f}  {metrics['tok_s']:,.0f} tok/s"
        )
        self._progress.update(self._task, completed=step, stats=stats)
        # without a terminal (CI logs, nohup) the live bar never redraws: print ~20 plain lines instead
        every = max(1, self.total // 20)
        if self.enabled and not self._progress.console.is_terminal and (step % every == 0 or step == self.total):
            self._progress.console.print(f"step {step}/{self.total}  {stats}", highlight=False)

    def note(self, text: str) -> None:
        """Print a line above the live bar (eval results, checkpoint notices)."""
        if self.enabled:
            self._progress.console.print(text)

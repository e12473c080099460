"""Graceful stop: SIGTERM/SIGINT set a flag the train loop checks between steps (it saves, then exits 0).

A second signal restores the default behaviour, so an impatient Ctrl-C still interrupts immediately.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class StopRequest:
    """Context manager that turns SIGTERM/SIGINT into `requested = True` (main thread only)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # second signal: act as if we were not here
            self._restore()
            signal.raise_signal(signum)
            return
        self.requested, self.signal_name = True, signal.Signals(signum).name

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

"""Stop strings over streamed text: emit what is safe now, hold back what may start a stop string.

Generated text arrives in pieces (one detokenised token or a few at a time). A stop string can span many
pieces, so the tail of the text that is a proper prefix of some stop string is held back until later text
decides it; everything before that tail can never be part of a stop and is emitted at once.

Which stop wins: the occurrence that *ends* first (ties: the one that starts first, i.e. the longest). That is
the stop a token-by-token generator completes first, and it makes the result independent of how the text
is split into pieces: the emitted text is always `text[:start]` (+ the stop string with `include_stop`).

Not here: token-id stops (the scheduler checks those) and detokenisation (the caller feeds decoded text).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Incremental stop-string matcher for one generated sequence.

    Attributes:
        stopped: a stop string has been seen; later `feed`s return ("", True).
        matched: the stop string that fired, or None.
    """

    def __init__(self, stops: Sequence[str], *, include_stop: bool = False) -> None:
        """Args:
        stops: stop strings (non-empty; duplicates are harmless).
        include_stop: end the emitted text with the matched stop string.
        """
        if any(not s for s in stops):
            raise ValueError(f"stop strings must be non-empty, got {list(stops)!r}")
        self._stops = tuple(dict.fromkeys(stops))
        self._include = include_stop
        self._held = ""  # text not emitted yet: always a proper prefix of some stop string
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add newly decoded text.

        Returns:
            (text safe to emit now, stopped). On the feed that completes a stop string: the text before it
            (plus the stop string when `include_stop`) and True.
        """
        if self.stopped:
            return "", True
        buf = self._held + text
        hit = self._first_stop(buf)
        if hit is not None:
            start, stop = hit
            self.stopped, self.matched, self._held = True, stop, ""
            return buf[: start + len(stop)] if self._include else buf[:start], True
        cut = self._held_from(buf)
        self._held = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        """End of generation without a stop: return the held-back text (empty once stopped)."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, buf: str) -> tuple[int, str] | None:
        """(start, stop) of the occurrence ending first, ties to the earliest start; None if there is none."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)  # a stop's first occurrence is also its first to end
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _held_from(self, buf: str) -> int:
        """Start of the longest suffix of `buf` that is a proper prefix of a stop string (len(buf) if none)."""
        longest = max((len(s) for s in self._stops), default=1) - 1
        for i in range(max(0, len(buf) - longest), len(buf)):
            tail = buf[i:]
            if any(s.startswith(tail) for s in self._stops):
                return i
        return len(buf)

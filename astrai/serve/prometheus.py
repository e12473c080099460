"""The Prometheus text exposition format 0.0.4, the few pieces astrai writes it with (no client library needed):
label escaping, sample values as Go's ParseFloat reads them, a family's HELP/TYPE header, a cumulative histogram.

https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def escape_label(value: str) -> str:
    """A label value escaped for the text format: backslash, double quote and newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def number(value: float) -> str:
    # Go's ParseFloat spellings: Python's "inf"/"nan" are not valid sample values
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return repr(value)


def family(name: str, kind: str, doc: str, samples: Iterable[str]) -> list[str]:
    help_text = doc.replace("\\", "\\\\").replace("\n", "\\n")
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


class Histogram:
    """Cumulative-bucket histogram with a sum and a count."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        """Record one value."""
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """Exposition samples for this histogram; `labels` (`a="x",b="y"`) go on every sample."""
        out, running, sep = [], 0, "," if labels else ""
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{number(bound)}"}} {running}')
        tail = f"{{{labels}}}" if labels else ""
        out += [f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}', f"{name}_sum{tail} {number(self.sum)}",
                f"{name}_count{tail} {self.count}"]  # fmt: skip
        return out

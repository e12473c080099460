"""Prometheus metrics in the text exposition format 0.0.4 (no client library: a few counters and histograms).

Exposed at `GET /metrics` (behind the API key when one is set, unless `astrai serve --metrics-public`):
requests by endpoint and status, prompt, generated and embedded tokens, preemptions, time-to-first-token and
inter-token latency histograms, and engine gauges (running, waiting, KV pages used/cached/free/capacity,
prefix-cache hit rate). Updated from the event-loop thread only.

Every family has `# HELP` and `# TYPE` lines; counters end in `_total`. Label values come from a closed set:
`endpoint` is the path of one of the app's routes, and any other path (404s, probes, hostile paths) counts
as `other`, so clients cannot add series or write into the output; label values are escaped anyway
(https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable

from astrai.inference.engine import EngineStats
from astrai.inference.outputs import Delta

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OTHER = "other"  # the endpoint label of every request whose path is not a route


def escape_label(value: str) -> str:
    """A label value escaped for the text format: backslash, double quote and newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    # Go's ParseFloat spellings: Python's "inf"/"nan" are not valid sample values
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return repr(value)


def _family(name: str, kind: str, doc: str, samples: Iterable[str]) -> list[str]:
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

    def lines(self, name: str) -> list[str]:
        """Exposition samples for this histogram."""
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {_number(self.sum)}",
                f"{name}_count {self.count}"]  # fmt: skip
        return out


class Metrics:
    """The server's counters and latency histograms.

    Attributes:
        endpoints: the paths counted under their own `endpoint` label (the app's routes; `build_app` sets
            them); every other path counts as `other`.
        requests: finished HTTP requests by (endpoint label, status).
    """

    def __init__(self, endpoints: Iterable[str] = ()) -> None:
        self.endpoints = frozenset(endpoints)
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.embedding_tokens = 0  # input tokens of /v1/embeddings requests
        self.ttft = Histogram()
        self.itl = Histogram()

    def count_request(self, path: str, status: int) -> None:
        """One finished HTTP request; `path` becomes its label only if it is a route's."""
        self.requests[(path if path in self.endpoints else OTHER, int(status))] += 1

    async def observe(self, deltas: AsyncIterator[Delta], prompt_tokens: int) -> AsyncIterator[Delta]:
        """Pass deltas through, timing the first token and the gaps between tokens."""
        self.prompt_tokens += prompt_tokens
        start = last = time.perf_counter()
        first = True
        async for delta in deltas:
            if delta.token_ids:
                now = time.perf_counter()
                (self.ttft if first else self.itl).observe(now - (start if first else last))
                first, last = False, now
                self.generated_tokens += len(delta.token_ids)
            yield delta

    def render(self, stats: EngineStats, *, up: bool = True) -> str:
        """The exposition text; `up`: whether the engine can still serve (`astrai_engine_up`, as /health's 200)."""
        requests = (f'astrai_requests_total{{endpoint="{escape_label(endpoint)}",status="{status}"}} {n}'
                    for (endpoint, status), n in sorted(self.requests.items()))  # fmt: skip
        lines = _family("astrai_requests_total", "counter",
                        "HTTP requests by endpoint (a route's path, or other) and status.", requests)  # fmt: skip
        scalars = [
            ("astrai_engine_up", "gauge", "1 while the engine serves, 0 once it stopped (/health: 503).", int(up)),
            ("astrai_prompt_tokens_total", "counter", "Prompt tokens of generation requests.", self.prompt_tokens),
            ("astrai_generation_tokens_total", "counter", "Generated tokens.", self.generated_tokens),
            ("astrai_embedding_tokens_total", "counter", "Input tokens of embedding requests.", self.embedding_tokens),
            ("astrai_preemptions_total", "counter", "Sequences preempted for KV space.", stats.preemptions),
            ("astrai_requests_running", "gauge", "Requests decoding now.", stats.running),
            (
                "astrai_requests_waiting",
                "gauge",
                "Sequences queued (a request with n completions counts n).",
                stats.waiting,
            ),
            ("astrai_kv_pages_used", "gauge", "KV pages held by requests.", stats.kv_pages_used),
            ("astrai_kv_pages_cached", "gauge", "KV pages in the prefix cache (evictable).", stats.kv_pages_cached),
            ("astrai_kv_pages_free", "gauge", "KV pages free.", stats.kv_pages_free),
            ("astrai_kv_pages_capacity", "gauge", "KV pages in the pool.", stats.kv_pages_total),
            ("astrai_prefix_cache_hit_rate", "gauge", "Share of prompt tokens found cached.", stats.prefix_hit_rate),
        ]
        for name, kind, doc, value in scalars:
            lines += _family(name, kind, doc, [f"{name} {_number(value)}"])
        histograms = [("astrai_time_to_first_token_seconds", "Seconds from submission to the first token.", self.ttft),
                      ("astrai_inter_token_latency_seconds", "Seconds between tokens.", self.itl)]  # fmt: skip
        for name, doc, hist in histograms:
            lines += _family(name, "histogram", doc, hist.lines(name))
        return "\n".join(lines) + "\n"

"""Prometheus metrics in the text exposition format (no client library: a few counters and histograms).

Exposed at `GET /metrics`: requests by endpoint and status, prompt, generated and embedded tokens,
time-to-first-token and inter-token latency histograms, and engine gauges (running, waiting, KV pages
used/cached/free, prefix-cache hit rate). Updated from the event-loop thread only.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from collections.abc import AsyncIterator

from astrai.inference.engine import EngineStats
from astrai.inference.outputs import Delta

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
        """Exposition lines for this histogram."""
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """The server's counters and latency histograms."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.embedding_tokens = 0  # input tokens of /v1/embeddings requests
        self.ttft = Histogram()
        self.itl = Histogram()

    def count_request(self, endpoint: str, status: int) -> None:
        """One finished HTTP request."""
        self.requests[(endpoint, status)] += 1

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

    def render(self, stats: EngineStats) -> str:
        """The exposition text."""
        lines = ["# HELP astrai_requests_total HTTP requests by endpoint and status.",
                 "# TYPE astrai_requests_total counter"]  # fmt: skip
        for (endpoint, status), n in sorted(self.requests.items()):
            lines.append(f'astrai_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        counters = {"astrai_prompt_tokens_total": self.prompt_tokens,
                    "astrai_generation_tokens_total": self.generated_tokens,
                    "astrai_embedding_tokens_total": self.embedding_tokens}  # fmt: skip
        for name, value in counters.items():
            lines += [f"# TYPE {name} counter", f"{name} {value}"]
        histograms = {"astrai_time_to_first_token_seconds": self.ttft, "astrai_inter_token_latency_seconds": self.itl}
        for name, hist in histograms.items():
            lines += [f"# TYPE {name} histogram", *hist.lines(name)]
        gauges = {
            "astrai_requests_running": stats.running,
            "astrai_requests_waiting": stats.waiting,
            "astrai_kv_pages_used": stats.kv_pages_used,
            "astrai_kv_pages_cached": stats.kv_pages_cached,
            "astrai_kv_pages_free": stats.kv_pages_free,
            "astrai_kv_pages_total": stats.kv_pages_total,
            "astrai_prefix_cache_hit_rate": stats.prefix_hit_rate,
            "astrai_preemptions_total": stats.preemptions,
        }
        for name, value in gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        return "\n".join(lines) + "\n"

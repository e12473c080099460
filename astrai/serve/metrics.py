"""Prometheus metrics in the text exposition format 0.0.4 (no client library: a few counters and histograms).

Exposed at `GET /metrics` (behind the API key when one is set, unless `astrai serve --metrics-public`):
requests by endpoint and status, prompt, generated and embedded tokens, preemptions, time-to-first-token and
inter-token latency histograms, and engine gauges (running, waiting, KV pages used/cached/free/capacity,
prefix-cache hit rate). Updated from the event-loop thread only. With LoRA adapters served, `lora_api.lora_lines`
adds the adapter families (loaded, running / waiting per adapter, vLLM's `vllm:lora_requests_info`).

Beside the `astrai_*` families, vLLM's `vllm:` families under vLLM's names, labels and buckets
(`vllm_metrics`), so dashboards, autoscalers and routers written for vLLM read astrai unchanged.

Every family has `# HELP` and `# TYPE` lines; counters end in `_total`. Label values come from a closed set:
`endpoint` is the path of one of the app's routes, and any other path (404s, probes, hostile paths) counts
as `other`, so clients cannot add series or write into the output; label values are escaped anyway
(https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable

from astrai.inference.engine import EngineStats
from astrai.inference.outputs import Delta
from astrai.serve import tracing
from astrai.serve.prometheus import Histogram, escape_label, family, number
from astrai.serve.vllm_metrics import VLLMMetrics

OTHER = "other"  # the endpoint label of every request whose path is not a route


class Metrics:
    """The server's counters and latency histograms.

    Attributes:
        endpoints: the paths counted under their own `endpoint` label (the app's routes; `build_app` sets
            them); every other path counts as `other`.
        requests: finished HTTP requests by (endpoint label, status).
    """

    def __init__(self, endpoints: Iterable[str] = (), model_name: str = "astrai") -> None:
        self.endpoints = frozenset(endpoints)
        self.model_name = model_name  # the `model_name` label of the vllm: families
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.embedding_tokens = 0  # input tokens of /v1/embeddings requests
        self.ttft = Histogram()
        self.itl = Histogram()
        self.vllm = VLLMMetrics()

    def count_request(self, path: str, status: int) -> None:
        """One finished HTTP request; `path` becomes its label only if it is a route's."""
        self.requests[(path if path in self.endpoints else OTHER, int(status))] += 1

    async def observe(self, deltas: AsyncIterator[Delta], prompt_tokens: int) -> AsyncIterator[Delta]:
        """Pass deltas through, timing the first token and the gaps between tokens."""
        self.prompt_tokens += prompt_tokens
        trace = tracing.CURRENT.get()  # the request's `tracing.RequestTrace` when it is traced, else None
        start = last = time.perf_counter()
        first_at, generated = None, 0
        try:
            async for delta in deltas:
                if delta.token_ids:
                    now = time.perf_counter()
                    gap = now - (start if first_at is None else last)
                    (self.ttft if first_at is None else self.itl).observe(gap)
                    self.vllm.token(gap, first=first_at is None)
                    first_at, last = first_at or now, now
                    generated += len(delta.token_ids)
                    self.generated_tokens += len(delta.token_ids)
                if delta.finish_reason is not None:
                    self.vllm.finished[delta.finish_reason] += 1
                yield delta
        finally:  # also when the client left mid-stream (the generator is closed)
            self.vllm.request_done(prompt_tokens, generated, start, first_at, last)
            if trace is not None:
                trace.observed(prompt_tokens, generated, first_at, last if first_at is not None else None)

    def render(self, stats: EngineStats, *, up: bool = True, prefix_tokens: tuple[int, int] = (0, 0)) -> str:
        """The exposition text; `up`: whether the engine can still serve (`astrai_engine_up`, as /health's 200);
        `prefix_tokens`: the prefix cache's (queried, hit) prompt tokens so far, for vLLM's counters."""
        requests = (f'astrai_requests_total{{endpoint="{escape_label(endpoint)}",status="{status}"}} {n}'
                    for (endpoint, status), n in sorted(self.requests.items()))  # fmt: skip
        lines = family("astrai_requests_total", "counter",
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
            lines += family(name, kind, doc, [f"{name} {number(value)}"])
        histograms = [("astrai_time_to_first_token_seconds", "Seconds from submission to the first token.", self.ttft),
                      ("astrai_inter_token_latency_seconds", "Seconds between tokens.", self.itl)]  # fmt: skip
        for name, doc, hist in histograms:
            lines += family(name, "histogram", doc, hist.lines(name))
        lines += self.vllm.render(stats, self.model_name, prefix_tokens, (self.prompt_tokens, self.generated_tokens))
        return "\n".join(lines) + "\n"

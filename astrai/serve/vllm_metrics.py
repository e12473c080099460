"""vLLM's `vllm:` metric families, beside astrai's own, for what was written against `vllm serve`: Grafana
dashboards, KEDA / HPA autoscalers, the Gateway API inference extension's endpoint picker, SGLang's and vLLM's
routers.

Names, types, labels and histogram buckets are vLLM V1's (`vllm/v1/metrics/loggers.py`): every sample carries
`model_name` (the served name) and `engine` ("0": one engine per server). Counters end in `_total`, as
prometheus_client writes vLLM's. What each one counts here:

- `vllm:num_requests_running` / `vllm:num_requests_waiting` (gauges): sequences decoding now / queued (n
  completions count n);
- `vllm:kv_cache_usage_perc` (gauge): KV pages held by requests over the pool's pages, 0..1 (cached, evictable
  pages count as free, as vLLM's);
- `vllm:gpu_cache_usage_perc` (gauge): the same figure under its older name (vLLM before 0.10), which endpoint
  pickers of the Gateway API inference extension before v0.5 read by default;
- `vllm:cache_config_info` (gauge, 1): the KV cache's layout in labels, `block_size` (tokens per page),
  `num_gpu_blocks` (pages in the pool) and `enable_prefix_caching`, read by the inference extension's prefix-cache
  scorer to size its model of each server's cache (labels as vLLM's info metric: `engine`, no `model_name`);
- `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (counters): prompt tokens looked up in /
  served from the radix cache;
- `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` (counters);
- `vllm:request_success_total{finished_reason}` (counter): finished completions by reason (stop, length, abort);
- histograms: `vllm:time_to_first_token_seconds` (submission to the first token),
  `vllm:inter_token_latency_seconds` (between deliveries), `vllm:time_per_output_token_seconds` (per request:
  (last token - first token) / (tokens - 1)), `vllm:e2e_request_latency_seconds` (submission to the end),
  `vllm:request_prompt_tokens` and `vllm:request_generation_tokens` (per request).

`vllm:lora_requests_info` is `lora_api`'s (written only when the server serves LoRA adapters).

Not here: vLLM's per-phase times (queue, prefill, decode, inference), speculative-decoding families,
`vllm:cache_config_info`, the deprecated `gpu_*` aliases.
"""

from __future__ import annotations

from collections import defaultdict

from astrai.inference.engine import EngineStats
from astrai.serve.prometheus import Histogram, escape_label, family, number

# vLLM V1's buckets (loggers.py), so quantiles computed over astrai and vLLM replicas line up
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # vLLM's 1-2-5 series (up to the context)


class VLLMMetrics:
    """The per-request figures only the server sees (the engine's gauges come from `EngineStats` at render time).

    Attributes:
        finished: finished completions by finish reason.
    """

    def __init__(self) -> None:
        self.finished: dict[str, int] = defaultdict(int)
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)
        self.tpot, self.e2e = Histogram(TPOT_BUCKETS), Histogram(E2E_BUCKETS)
        self.prompt_tokens, self.generation_tokens = Histogram(TOKEN_BUCKETS), Histogram(TOKEN_BUCKETS)

    def token(self, gap: float, first: bool) -> None:
        """One delivery of tokens, `gap` seconds after the submission (first) or the previous delivery."""
        (self.ttft if first else self.itl).observe(gap)

    def request_done(self, prompt_tokens: int, generated: int, start: float, first: float | None, last: float) -> None:
        """A request's stream ended: its submission, first- and last-token times (perf_counter seconds)."""
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generated)
        self.e2e.observe(last - start)
        if first is not None and generated > 1:
            self.tpot.observe((last - first) / (generated - 1))

    def render(self, stats: EngineStats, model_name: str, prefix_tokens: tuple[int, int],
               tokens: tuple[int, int]) -> list[str]:  # fmt: skip
        """The `vllm:` families' exposition lines; `prefix_tokens` (queried, hit) and `tokens` (prompt, generated)
        are the running totals."""
        labels = f'model_name="{escape_label(model_name)}",engine="0"'
        usage = stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0
        queried, hit = prefix_tokens
        prompt, generated = tokens
        scalars = [
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", stats.running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", stats.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage (deprecated: "
             "vllm:kv_cache_usage_perc).", usage),
            ("vllm:prefix_cache_queries_total", "counter",
             "Prefix cache queries, in terms of number of queried tokens.", queried),
            ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", hit),
            ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
             stats.preemptions),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", prompt),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", generated),
            ("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", stats.spec_drafts),
            ("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", stats.spec_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.",
             stats.spec_accepted_tokens),
        ]  # fmt: skip
        lines = []
        for name, kind, doc, value in scalars:
            lines += family(name, kind, doc, [f"{name}{{{labels}}} {number(value)}"])
        if stats.page_size:  # the KV cache's layout, as vLLM's info metric (a gauge of 1, the values in labels)
            info = (f'block_size="{stats.page_size}",enable_prefix_caching="{stats.prefix_cache}",engine="0",'
                    f'num_gpu_blocks="{stats.kv_pages_total}"')  # fmt: skip
            lines += family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
                            [f"vllm:cache_config_info{{{info}}} 1.0"])  # fmt: skip
        hist = stats.spec_accepted_hist  # [a]: rounds that accepted exactly a guesses
        lines += family("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                        "Accepted draft tokens per draft position.",
                        [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} '
                         f"{sum(hist[i + 1 :])}" for i in range(max(len(hist) - 1, 0))])  # fmt: skip
        reasons = sorted({"stop", "length", "abort", *self.finished})
        lines += family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
                        [f'vllm:request_success_total{{{labels},finished_reason="{escape_label(r)}"}} '
                         f"{self.finished.get(r, 0)}" for r in reasons])  # fmt: skip
        histograms = [
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl),
            ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", self.tpot),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.", self.generation_tokens),
        ]
        for name, doc, hist in histograms:
            lines += family(name, "histogram", doc, hist.lines(name, labels))
        return lines

"""OpenTelemetry request tracing (`astrai serve --otlp-traces-endpoint URL`): one span tree per generation request.

Off by default, and then free: this module imports no OpenTelemetry package at its top, the server creates no
tracer, provider or exporter (`ServerState.tracer` is None), and the request path does no tracing work (the hooks
below test for None and go on).

With a `Tracer` (it needs the `tracing` extra: pip install 'astrai[tracing]'), each request to a generation route
(`TRACED_PATHS`) gets a `RequestTrace`, a plain record its hooks fill as it goes, reached through the context
variable `CURRENT` (set for the request's task only): `app.Guard` notes its arrival, its W3C `traceparent` /
`tracestate` headers, its status and when the reply's last byte went out; `common.submit` adds its engine handles,
whose submission and first-scheduling times the engine records anyway (`RequestHandle.submitted`,
`first_scheduled`); `Metrics.observe` adds the first- and last-token times and token counts it takes for the TTFT
metrics. Once the reply is written, `Tracer.finish` turns the record into spans with explicit start and end times:
the engine thread does no tracing work, and the spans go to a `BatchSpanProcessor`, whose own thread exports them,
so export never blocks the event loop.

The tree: a root span (kind SERVER, named `{gen_ai.operation.name} {model}` as the GenAI semantic conventions name
it) from the request's arrival to its reply written, a child of the client's span when the request carries a valid
`traceparent` (same trace id; a missing or malformed one starts a new trace, never an error), and four children in
time order: `queue` (submitted -> first scheduled), `prefill` (-> first token), `decode` (-> last token) and
`delivery` (-> the reply's last byte written; a stream's chunks go out during decode, so its delivery is what follows
the last token). A phase the request never reached is left out (the one before it runs to the reply's end).

Attributes (root): the GenAI conventions' `gen_ai.operation.name`, `gen_ai.request.model` / `gen_ai.response.model`,
`gen_ai.request.max_tokens` / `temperature` / `top_p` / `top_k` / `seed`, `gen_ai.usage.input_tokens` /
`output_tokens`, `gen_ai.response.finish_reasons`; vLLM's names for what the conventions lack (`vllm/tracing.py`):
`gen_ai.request.id`, `gen_ai.request.n`, `gen_ai.usage.num_sequences`, `gen_ai.usage.prompt_tokens` /
`completion_tokens`, and the seconds `gen_ai.latency.time_in_queue`, `time_to_first_token`, `e2e`,
`time_in_model_prefill`, `time_in_model_decode`, `time_in_model_inference`; HTTP's `http.request.method`,
`url.path`, `http.response.status_code` (and `error.type` with an ERROR status for a 5xx). No prompt or output text.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

TRACED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
"""The routes whose requests get spans (the generation routes)."""

INSTALL = "pip install 'astrai[tracing]'"

PROTOCOLS = ("http/protobuf", "grpc")
"""OTLP transports, from `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (else `OTEL_EXPORTER_OTLP_PROTOCOL`; default the
first, the one the `tracing` extra installs; grpc needs opentelemetry-exporter-otlp-proto-grpc)."""

_EXPORTERS = {"http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
              "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"}  # fmt: skip
_PACKAGES = {"http/protobuf": "opentelemetry-exporter-otlp-proto-http",
             "grpc": "opentelemetry-exporter-otlp-proto-grpc"}  # fmt: skip

CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("astrai_request_trace", default=None)
"""The record of the request the running task serves; None when tracing is off or the route is not traced."""

logger = logging.getLogger("astrai.serve")


class TracingUnavailable(ValueError):
    """Tracing was asked for but cannot run: its packages are missing, or the OTLP protocol is unknown."""


def protocol() -> str:
    """The OTLP transport the environment asks for (`PROTOCOLS`)."""
    env = os.environ
    return (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or PROTOCOLS[0]).strip().lower()  # fmt: skip


def check_available(transport: str | None = None) -> None:
    """Raise `TracingUnavailable` (one line naming the install command) unless the SDK and the exporter of
    `transport` (default: `protocol()`) import."""
    transport = transport or protocol()
    if transport not in PROTOCOLS:
        raise TracingUnavailable(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={transport!r} is not supported: use one of "
                                 f"{', '.join(PROTOCOLS)}")  # fmt: skip
    try:
        import opentelemetry.sdk.trace  # noqa: F401
        import opentelemetry.trace.propagation.tracecontext  # noqa: F401
    except ImportError as err:
        raise TracingUnavailable(f"--otlp-traces-endpoint needs the OpenTelemetry SDK ({err}): {INSTALL}") from None
    try:
        __import__(_EXPORTERS[transport])
    except ImportError as err:
        extra = INSTALL if transport == PROTOCOLS[0] else f"pip install {_PACKAGES[transport]}"
        raise TracingUnavailable(f"--otlp-traces-endpoint over {transport} needs {_PACKAGES[transport]} ({err}): "
                                 f"{extra}") from None  # fmt: skip


def otlp_exporter(endpoint: str, transport: str | None = None) -> Any:
    """The OTLP span exporter sending to `endpoint` over `transport` (default: `protocol()`). Over http/protobuf
    a URL without a path gets OTLP's `/v1/traces`, as `OTEL_EXPORTER_OTLP_ENDPOINT` does."""
    transport = transport or protocol()
    check_available(transport)
    module = __import__(_EXPORTERS[transport], fromlist=["OTLPSpanExporter"])
    if transport == "http/protobuf" and urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return module.OTLPSpanExporter(endpoint=endpoint)


class RequestTrace:
    """What one traced request's spans are made of; times are `time.perf_counter()` seconds."""

    __slots__ = ("path", "method", "model", "headers", "arrived", "sent", "handles", "params", "lora",
                 "first_token", "last_token", "prompt_tokens", "output_tokens")  # fmt: skip

    def __init__(self, path: str, method: str, model: str, headers: dict[str, str]) -> None:
        self.path, self.method, self.model, self.headers = path, method, model, headers
        self.arrived, self.sent = time.perf_counter(), None
        self.handles: list[Any] = []
        self.params: Any = None
        self.lora: str | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.prompt_tokens = self.output_tokens = 0

    def add(self, handle: Any, params: Any, lora: str | None) -> None:
        """A request submitted to the engine for this HTTP request (a list of prompts submits several)."""
        self.handles.append(handle)
        self.params, self.lora = self.params or params, lora

    def observed(self, prompt_tokens: int, generated: int, first: float | None, last: float | None) -> None:
        """One engine request's stream ended (`Metrics.observe`): its token counts, first- and last-token times."""
        self.prompt_tokens += prompt_tokens
        self.output_tokens += generated
        if first is not None:
            self.first_token = first if self.first_token is None else min(self.first_token, first)
        if last is not None:
            self.last_token = last if self.last_token is None else max(self.last_token, last)

    def sending(self, send: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        """`send`, noting when the reply's last body message went out."""

        async def traced_send(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.sent = time.perf_counter()

        return traced_send


class Tracer:
    """Spans of traced requests to `exporter` through a `BatchSpanProcessor` (its thread exports them).

    The provider is this server's own (the global one is left alone). Its resource is OpenTelemetry's default
    (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), with service.name "astrai" unless those name one.
    """

    def __init__(self, exporter: Any) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "astrai"}))
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer("astrai.serve")
        self._propagator = TraceContextTextMapPropagator()
        self._offset_ns = time.time_ns() - time.perf_counter_ns()  # perf_counter -> Unix epoch ns

    @classmethod
    def otlp(cls, endpoint: str) -> Tracer:
        """Export to the OTLP collector at `endpoint` (`otlp_exporter`)."""
        return cls(otlp_exporter(endpoint))

    def start(self, scope: Mapping[str, Any], headers: Mapping[str, str], model: str) -> RequestTrace | None:
        """The record of a request arriving, set as `CURRENT` for the running task (each request runs in its own);
        None unless its route is traced. `model`: the served name."""
        if scope["path"] not in TRACED_PATHS:
            return None
        carried = {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}
        trace = RequestTrace(scope["path"], scope["method"], model, carried)
        CURRENT.set(trace)
        return trace

    def finish(self, trace: RequestTrace, status: int) -> None:
        """Emit the request's spans (after its reply was written); never raises (a bug here is logged)."""
        try:
            self._emit(trace, status)
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            logger.exception("request tracing failed for %s", trace.path)

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def _emit(self, trace: RequestTrace, status: int) -> None:
        from opentelemetry import trace as otel
        from opentelemetry.trace import SpanKind, Status, StatusCode

        end = trace.sent if trace.sent is not None else time.perf_counter()
        submitted = min((h.submitted for h in trace.handles if h.submitted is not None), default=None)
        scheduled = min((t for h in trace.handles if (t := h.first_scheduled) is not None), default=None)
        first, last = trace.first_token, trace.last_token
        model = trace.lora or trace.model
        operation = "text_completion" if trace.path == "/v1/completions" else "chat"
        attributes = {"http.request.method": trace.method, "url.path": trace.path,
                      "http.response.status_code": status, "gen_ai.operation.name": operation,
                      "gen_ai.request.model": model, "gen_ai.response.model": model}  # fmt: skip
        if trace.handles:
            attributes.update(self._request_attributes(trace))
        latency = {"gen_ai.latency.e2e": (trace.arrived, end), "gen_ai.latency.time_in_queue": (submitted, scheduled),
                   "gen_ai.latency.time_to_first_token": (trace.arrived, first),
                   "gen_ai.latency.time_in_model_prefill": (scheduled, first),
                   "gen_ai.latency.time_in_model_decode": (first, last),
                   "gen_ai.latency.time_in_model_inference": (scheduled, last)}  # fmt: skip
        attributes.update({k: b - a for k, (a, b) in latency.items() if a is not None and b is not None})
        if status >= 500:
            attributes["error.type"] = str(status)
        root = self._tracer.start_span(f"{operation} {model}", context=self._propagator.extract(trace.headers),
                                       kind=SpanKind.SERVER, start_time=self._ns(trace.arrived),
                                       attributes=attributes)  # fmt: skip
        if status >= 500:
            root.set_status(Status(StatusCode.ERROR))
        inside = otel.set_span_in_context(root)
        marks = [(name, t) for name, t in (("queue", submitted), ("prefill", scheduled), ("decode", first),
                                           ("delivery", last)) if t is not None]  # fmt: skip
        if submitted is None:
            marks = []  # nothing reached the engine: the root alone
        ends = [t for _, t in marks[1:]] + [end] if marks else []
        phase = {"prefill": {"gen_ai.usage.input_tokens": trace.prompt_tokens},
                 "decode": {"gen_ai.usage.output_tokens": trace.output_tokens}}  # fmt: skip
        at = trace.arrived
        for (name, start), stop in zip(marks, ends, strict=True):
            start = max(start, at)  # one clock throughout; guards rounding only
            at = max(stop, start)
            self._tracer.start_span(name, context=inside, start_time=self._ns(start),
                                    attributes=phase.get(name)).end(end_time=self._ns(at))  # fmt: skip
        root.end(end_time=self._ns(max(end, at)))

    @staticmethod
    def _request_attributes(trace: RequestTrace) -> dict[str, Any]:
        params, handles = trace.params, trace.handles
        done = [h.completion for h in handles if h.completion is not None]
        out: dict[str, Any] = {"gen_ai.request.id": ",".join(h.request_id for h in handles),
                               "gen_ai.request.max_tokens": params.max_tokens,
                               "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                               "gen_ai.request.n": params.n, "gen_ai.usage.num_sequences": params.n * len(handles),
                               "gen_ai.usage.input_tokens": trace.prompt_tokens,
                               "gen_ai.usage.output_tokens": trace.output_tokens,
                               "gen_ai.usage.prompt_tokens": trace.prompt_tokens,
                               "gen_ai.usage.completion_tokens": trace.output_tokens}  # fmt: skip
        if params.top_k > 0:
            out["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            out["gen_ai.request.seed"] = params.seed
        if done:
            out["gen_ai.response.finish_reasons"] = [o.finish_reason or "" for c in done for o in c.outputs]
        return out

    def force_flush(self, timeout_ms: int = 30_000) -> bool:
        """Export the spans queued so far (tests; shutdown does it too)."""
        return self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Flush what is queued and stop the export thread (the app's shutdown calls it)."""
        self.provider.shutdown()

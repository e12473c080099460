"""Request tracing (issue 45, item 4): OpenTelemetry spans per generation request, the client's W3C `traceparent`
honoured, OTLP export with `astrai serve --otlp-traces-endpoint`, nothing at all without it.

A live uvicorn server over a tiny model runs with a `Tracer` whose exporter is the SDK's in-memory one, set up the
way `--otlp-traces-endpoint` sets up the OTLP exporter (`Tracer(exporter)`: own provider, BatchSpanProcessor); the
openai and anthropic SDKs send the requests, the traceparent as `extra_headers`. A plain HTTP receiver on 127.0.0.1
stands in for a collector for the OTLP/HTTP path. Without a tracer, a fresh interpreter builds an app and serves a
request with no OpenTelemetry module imported.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.testclient import TestClient

import astrai
from astrai.cli import serve
from astrai.cli._common import parse
from astrai.inference.engine import Engine, EngineConfig
from astrai.serve import tracing
from astrai.serve.app import build_app
from astrai.serve.tracing import Tracer
from helpers import tiny_model_dir

ROOT = Path(__file__).resolve().parents[3]
KEY, MODEL = "trace-key", "tiny-traced"
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
PHASES = ["queue", "prefill", "decode", "delivery"]
MESSAGES = [{"role": "user", "content": "hello world"}]


class Live:
    def __init__(self, engine: Engine, exporter: InMemorySpanExporter, tracer: Tracer, port: int) -> None:
        self.engine, self.exporter, self.tracer = engine, exporter, tracer
        self.base_url = f"http://127.0.0.1:{port}"

    def trees(self, roots: int, timeout: float = 10.0) -> list[tuple]:
        """(root, children by start time) of the next `roots` requests' spans (the exporter is emptied)."""
        deadline = time.monotonic() + timeout
        while True:  # a request's spans are made once its reply went out, maybe just after the client read it
            self.tracer.force_flush()
            spans = self.exporter.get_finished_spans()
            found = [s for s in spans if s.kind is SpanKind.SERVER]
            if len(found) >= roots or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        time.sleep(0.05)  # nothing more arrives
        self.tracer.force_flush()
        spans = self.exporter.get_finished_spans()
        self.exporter.clear()
        found = sorted((s for s in spans if s.kind is SpanKind.SERVER), key=lambda s: s.start_time)
        assert len(found) == roots, [s.name for s in spans]
        trees = []
        for root in found:
            children = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
            trees.append((root, sorted(children, key=lambda s: s.start_time)))
        assert sum(1 + len(c) for _, c in trees) == len(spans), "spans outside the requests' trees"
        return trees


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model = astrai.load(tiny_model_dir(tmp_path_factory.mktemp("traced") / "m"))
    engine = Engine(model, EngineConfig(compile=False, kv_budget_tokens=4096, max_running=8, prefix_cache=False))
    exporter = InMemorySpanExporter()
    tracer = Tracer(exporter)  # as `Tracer.otlp` does with the OTLP exporter
    app = build_app(engine, model_name=MODEL, api_key=KEY, tracer=tracer)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    for _ in range(1000):
        if uv.started:
            break
        time.sleep(0.01)
    yield Live(engine, exporter, tracer, uv.servers[0].sockets[0].getsockname()[1])
    uv.should_exit = True
    with contextlib.suppress(Exception):
        thread.join(timeout=10)


@pytest.fixture
def oai(live):
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        yield client


def _check_tree(root, children, *, input_tokens: int, output_tokens: int, reasons=("length",)) -> None:
    """One request's tree: the four phases in time order inside the root, in its trace, and the usage."""
    assert [c.name for c in children] == PHASES
    for child in children:
        assert child.context.trace_id == root.context.trace_id and child.kind is SpanKind.INTERNAL
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    for before, after in zip(children, children[1:], strict=False):
        assert before.end_time <= after.start_time
    a = root.attributes
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (input_tokens, output_tokens)
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (input_tokens, output_tokens)
    assert reasons is None or tuple(a["gen_ai.response.finish_reasons"]) == reasons
    assert a["http.response.status_code"] == 200 and a["gen_ai.request.id"].startswith("req-")
    for name in ("time_in_queue", "time_to_first_token", "e2e", "time_in_model_prefill", "time_in_model_decode"):
        assert a[f"gen_ai.latency.{name}"] >= 0
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"]
    assert children[1].attributes["gen_ai.usage.input_tokens"] == input_tokens
    assert children[2].attributes["gen_ai.usage.output_tokens"] == output_tokens


def _joins_client_trace(root) -> None:
    assert root.context.trace_id == int(TRACE_ID, 16)
    assert root.parent is not None and root.parent.is_remote and root.parent.span_id == int(PARENT_ID, 16)


def test_a_chat_request_is_one_tree_in_the_clients_trace(live, oai):
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.5, top_p=0.9,
                                        extra_body={"ignore_eos": True},
                                        extra_headers={"traceparent": TRACEPARENT,
                                                       "tracestate": "vendor=abc"})  # fmt: skip
    ((root, children),) = live.trees(1)
    _joins_client_trace(root)
    assert root.context.trace_state.get("vendor") == "abc"  # tracestate goes along
    assert root.name == f"chat {MODEL}" and root.status.status_code is StatusCode.UNSET
    _check_tree(root, children, input_tokens=reply.usage.prompt_tokens, output_tokens=6)
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (6, 0.5, 0.9)
    assert (a["gen_ai.request.n"], a["url.path"], a["http.request.method"]) == (1, "/v1/chat/completions", "POST")


def test_a_stream_is_one_tree_too(live, oai):
    stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                         extra_headers={"traceparent": TRACEPARENT})  # fmt: skip
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    ((root, children),) = live.trees(1)
    _joins_client_trace(root)
    _check_tree(root, children, input_tokens=usage.prompt_tokens, output_tokens=5)


def test_without_traceparent_each_request_starts_a_new_trace(live, oai):
    for _ in range(2):
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, extra_body={"ignore_eos": True})
    trees = live.trees(2)
    assert all(root.parent is None for root, _ in trees)
    assert len({root.context.trace_id for root, _ in trees}) == 2
    for root, children in trees:
        assert [c.name for c in children] == PHASES and root.context.trace_id != int(TRACE_ID, 16)


@pytest.mark.parametrize("header", [
    "garbage", f"00-{TRACE_ID}-{PARENT_ID}", f"00-{'0' * 32}-{PARENT_ID}-01", f"00-{TRACE_ID}-{'0' * 16}-01",
    f"00-{TRACE_ID.upper()}-{PARENT_ID}-01", f"ff-{TRACE_ID}-{PARENT_ID}-01", "00-" + "z" * 32 + f"-{PARENT_ID}-01",
])  # fmt: skip
def test_a_malformed_traceparent_is_ignored(live, oai, header):
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                        extra_headers={"traceparent": header, "tracestate": "a=b"})  # fmt: skip
    assert reply.choices
    ((root, children),) = live.trees(1)
    assert root.parent is None and root.context.trace_id != int(TRACE_ID, 16)
    assert [c.name for c in children] == PHASES


def test_the_other_generation_routes_are_traced(live, oai):
    headers = {"traceparent": TRACEPARENT}
    body = oai.completions.create(model=MODEL, prompt=["hello", "the quick fox"], max_tokens=4, extra_headers=headers,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    ((root, children),) = live.trees(1)  # a list of prompts: several engine requests, one tree
    _joins_client_trace(root)
    assert root.name == f"text_completion {MODEL}" and len(root.attributes["gen_ai.request.id"].split(",")) == 2
    _check_tree(root, children, input_tokens=body.usage.prompt_tokens, output_tokens=8, reasons=("length",) * 2)

    resp = oai.responses.create(model=MODEL, input="hello", max_output_tokens=4, extra_headers=headers)
    ((root, children),) = live.trees(1)  # (this route takes no ignore_eos: the model may stop early)
    _joins_client_trace(root)
    _check_tree(
        root, children, input_tokens=resp.usage.input_tokens, output_tokens=resp.usage.output_tokens, reasons=None
    )

    with anthropic.Anthropic(base_url=live.base_url, api_key=KEY, max_retries=0, timeout=60) as client:
        msg = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers=headers)
    ((root, children),) = live.trees(1)
    _joins_client_trace(root)
    _check_tree(
        root, children, input_tokens=msg.usage.input_tokens, output_tokens=msg.usage.output_tokens, reasons=None
    )


def test_a_request_refused_before_the_engine_is_a_root_alone(live, oai):
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1,
                                    extra_headers={"traceparent": TRACEPARENT})  # fmt: skip
    ((root, children),) = live.trees(1)
    _joins_client_trace(root)
    assert children == [] and root.attributes["http.response.status_code"] == 400
    assert "gen_ai.usage.input_tokens" not in root.attributes


def test_other_routes_make_no_spans(live, oai):
    oai.models.list()
    for path in ("/health", "/metrics", "/v1/nowhere"):
        httpx.get(live.base_url + path, headers={"traceparent": TRACEPARENT, "authorization": f"Bearer {KEY}"})
    time.sleep(0.05)
    live.tracer.force_flush()
    assert live.exporter.get_finished_spans() == ()


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: keeps each POST's path and decoded ExportTraceServiceRequest."""

    received: list = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        self.received.append((self.path, self.headers["content-type"], ExportTraceServiceRequest.FromString(body)))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_spans_reach_an_otlp_http_collector(live, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        tracer = Tracer.otlp(f"http://127.0.0.1:{collector.server_address[1]}")  # the flag's path: /v1/traces added
        client = TestClient(build_app(live.engine, model_name=MODEL, tracer=tracer))  # no lifespan: the engine stays
        reply = client.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                            json={"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True})  # fmt: skip
        assert reply.status_code == 200, reply.text
        client.close()
        tracer.shutdown()  # flushes
    finally:
        collector.shutdown()
        collector.server_close()
    ((path, kind, request),) = _Collector.received
    assert (path, kind) == ("/v1/traces", "application/x-protobuf")
    (resource,) = request.resource_spans
    service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
    spans = [s for scope in resource.scope_spans for s in scope.spans]
    assert service == "astrai" and sorted(s.name for s in spans) == sorted([f"chat {MODEL}", *PHASES])
    assert {s.trace_id.hex() for s in spans} == {TRACE_ID}


def test_without_the_flag_nothing_of_opentelemetry_is_imported(tmp_path):
    script = f"""
import json, sys
from starlette.testclient import TestClient
import astrai, astrai.cli.serve
from astrai.inference.engine import Engine, EngineConfig
from astrai.serve.app import build_app
from helpers import tiny_model_dir
model = astrai.load(tiny_model_dir({str(tmp_path / "m")!r}))
engine = Engine(model, EngineConfig(compile=False, kv_budget_tokens=1024, max_running=2))
app = build_app(engine, model_name="m")
with TestClient(app) as client:
    reply = client.post("/v1/chat/completions", headers={{"traceparent": {TRACEPARENT!r}}},
                        json={{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2}})
    assert reply.status_code == 200, reply.text
print(json.dumps({{"tracer": repr(app.state.tracer),
                   "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"tracer": "None", "otel": []}


def test_the_flag_reaches_the_config_and_builds_a_tracer():
    cfg = parse(serve.ServeConfig, ["--model", "m", "--otlp-traces-endpoint", "http://127.0.0.1:4318"])
    assert cfg.otlp_traces_endpoint == "http://127.0.0.1:4318"
    assert parse(serve.ServeConfig, ["--model", "m"]).otlp_traces_endpoint is None
    assert serve._tracer(None) is None
    tracer = serve._tracer(cfg.otlp_traces_endpoint)
    try:
        assert isinstance(tracer, Tracer)
    finally:
        tracer.shutdown()


@pytest.mark.parametrize(
    "missing", ["opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"]
)
def test_without_the_packages_serve_stops_at_start_naming_the_extra(tmp_path, monkeypatch, capsys, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: importing it raises ImportError
    args = ["--model", str(tmp_path), "--port", "0", "--otlp-traces-endpoint", "http://127.0.0.1:4318"]
    with pytest.raises(SystemExit) as exit_info:
        serve.main(parse(serve.ServeConfig, args))  # an empty folder: it stops before loading any model
    err = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2 and "pip install 'astrai[tracing]'" in err and "Traceback" not in err


def test_an_unknown_otlp_protocol_is_one_error(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(tracing.TracingUnavailable, match="http/protobuf, grpc"):
        tracing.check_available()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(tracing.TracingUnavailable, match="opentelemetry-exporter-otlp-proto-grpc"):
        tracing.check_available()


def test_concurrent_requests_each_get_their_own_tree(live, oai):
    parents = [f"00-{k:032x}-{k + 1:016x}-01" for k in range(1, 7)]

    def ask(k: int) -> int:
        stream = k % 2 == 1
        reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2 + k, stream=stream,
                                            extra_body={"ignore_eos": True},
                                            extra_headers={"traceparent": parents[k]})  # fmt: skip
        if stream:
            assert sum(1 for _ in reply) > 0
        return k

    with ThreadPoolExecutor(len(parents)) as pool:
        assert sorted(pool.map(ask, range(len(parents)))) == list(range(len(parents)))
    trees = live.trees(len(parents))
    by_trace = {root.context.trace_id: (root, children) for root, children in trees}
    assert sorted(by_trace) == list(range(1, 7))
    for k in range(len(parents)):
        root, children = by_trace[k + 1]
        assert root.parent.span_id == k + 2 and [c.name for c in children] == PHASES
        assert root.attributes["gen_ai.usage.output_tokens"] == 2 + k  # its own request's counts, not another's

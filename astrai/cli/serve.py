"""`astrai serve MODEL`: an OpenAI- and Anthropic-compatible HTTP server on uvicorn, with vLLM's flag names.

MODEL is a folder or a Hugging Face model id in the local HF cache (`--model MODEL` works too). Binds 127.0.0.1
by default. SIGINT/SIGTERM stop accepting connections, let in-flight requests finish for up to
`--graceful-timeout` seconds, then end the rest (finish_reason "abort") and free their KV. `--tool-call-parser`
names the model's tool-call format (default: detected from the chat template). `--embeddings` also
serves `POST /v1/embeddings` (`--embed-pooling mean|cls|last`, `--no-embed-normalize`). Older astrai spellings
stay as aliases (`--max-running` for `--max-num-seqs`, `--max-step-tokens` for `--max-num-batched-tokens`).
`--enable-lora --lora-modules name=path ...` serves LoRA adapters beside the base model, picked by a request's
`model` (docs/serving.md, "Serving LoRA adapters").
"""

from __future__ import annotations

import errno
import gc
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import attrs
import tyro

from astrai.cli._common import (
    USER_ERRORS,
    ModelArgs,
    console,
    err_console,
    fail,
    load_model,
    parse,
    run_guarded,
    served_names,
)
from astrai.cli.serve_start import prepare_grammar, warm_up
from astrai.openmp import release_idle_threads, share_cpu_cores_default

if TYPE_CHECKING:
    from astrai.inference.engine import Engine, EngineConfig
    from astrai.io.model import Model


LogLevel = Literal["debug", "info", "warning", "error", "critical"]
ToolCallParserName = Literal["hermes", "mistral", "llama3_json", "qwen3_coder", "deepseek_v3"]


@attrs.frozen(kw_only=True)
class ServeConfig(ModelArgs):
    """Serve a model over HTTP (OpenAI and Anthropic APIs)."""

    host: str = "127.0.0.1"
    """Interface to bind (0.0.0.0 exposes the server to the network)."""
    port: int = 8000
    """TCP port."""
    api_key: tuple[str, ...] = ()
    """Require `Authorization: Bearer KEY` or `x-api-key: KEY` on /v1/* routes and GET /metrics; several keys:
    any of them. Default: the ASTRAI_API_KEY environment variable (which, unlike a flag, `ps` does not show);
    unset: no key."""
    cache_salt_by_api_key: bool = False
    """Multi-tenant prefix cache: requests share cached prompt pages only with requests that sent the same API key
    (each key's hash salts its pages, with a request's own cache_salt). Needs --api-key."""
    enable_prompt_tokens_details: bool = False
    """Report usage.prompt_tokens_details.cached_tokens (vLLM's flag; off by default: cache hits of other clients'
    prompts would show in it)."""
    metrics_public: bool = False
    """Serve GET /metrics without the API key (a scraper can also send it: `authorization` in its config)."""
    served_model_name: tuple[str, ...] = ()
    """Model id(s) a request's `model` may name (vLLM's flag; any other is a 404 model_not_found). The first is
    reported by /v1/models and in responses. Default: the folder name (or the model id), and --model as typed."""
    max_num_seqs: Annotated[int, tyro.conf.arg(aliases=("--max-running",))] = 64
    """Most sequences decoding at once."""
    max_num_batched_tokens: Annotated[int, tyro.conf.arg(aliases=("--max-step-tokens",))] = 2048
    """Tokens one engine step may process (decodes + prefill chunks); smaller means finer chunked prefill."""
    max_waiting: int = 256
    """Most queued sequences (n completions take n); more are answered 429 (OpenAI) / 529 (Anthropic)."""
    gpu_memory_utilization: float | None = None
    """CUDA: fraction (0, 1] of the GPU's total memory for weights, KV cache and activations (vLLM's meaning).
    Default: the KV cache takes 85% of the memory left free after loading the weights. Ignored on CPU."""
    kv_budget: int | None = None
    """KV cache size in tokens, overriding --gpu-memory-utilization (default: sized from memory; CPU: 1 GiB)."""
    page_size: int = 16
    """Tokens per KV page."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (radix tree)."""
    share_cpu_cores: bool = attrs.field(factory=share_cpu_cores_default)
    """CPU: run the steps on the cores other programs leave (`EngineConfig.share_cpu_cores`; on unless
    `ASTRAI_SHARE_CPU_CORES=0`); one compile serves every thread count it picks (`astrai.inference.thread_count`)."""
    generation_config: str = "auto"
    """Sampling defaults for requests that leave a field unset (temperature, top_p, top_k, min_p, ...).
    auto: the model's generation_config.json; none or vllm: no defaults; a folder: its generation_config.json."""
    max_body_bytes: int = 8 << 20
    """Largest accepted request body (counted as it arrives, chunked or not: 413 past it)."""
    body_timeout: float = 60.0
    """Seconds a request body may take to arrive in full (408 after)."""
    header_timeout: float = 10.0
    """Seconds a request head may take from the connection opening or its first byte (408 and close after)."""
    keep_alive_timeout: int = 5
    """Seconds an idle keep-alive connection stays open."""
    max_connections: int = 512
    """Most open connections, streams included (more are answered 503 and closed)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host header names accepted besides localhost/127.0.0.1/[::1] ("*": any).
    Unset: requests arriving on a loopback address must name a loopback host (DNS rebinding), others may name any."""
    allowed_origins: tuple[str, ...] = ()
    """CORS: browser origins allowed to call the API (http://localhost:3000, or "*": any).
    vLLM's JSON list ('["http://a"]') works too. Unset: no CORS headers at all (vLLM's default is "*")."""
    allowed_methods: tuple[str, ...] = ("*",)
    """CORS: methods allowed for the --allowed-origins."""
    allowed_headers: tuple[str, ...] = ("*",)
    """CORS: request headers allowed for the --allowed-origins."""
    allow_credentials: bool = False
    """CORS: allow credentials (cookies, Authorization) from the --allowed-origins."""
    tokenizer_workers: int = 4
    """Threads that render chat templates and tokenize prompts, off the event loop (more requests queue)."""
    allow_special_tokens_in_content: bool = False
    """Encode special-token text in chat messages (`<|im_end|>`) as control tokens, not as plain text."""
    data_parallel_size: Annotated[int, tyro.conf.arg(aliases=("-dp",))] = 1
    """Engine replicas behind this one address (vLLM's flag): N worker processes, each a whole engine with its
    share of the CPU cores (or its own GPUs, --tensor-parallel-size each), requests to the least busy one
    (`astrai.serve.replicas`; needs httpx: pip install 'astrai[replicas]')."""
    compile: bool = True
    """torch.compile the decode step, and on CUDA the prefill step (compiled at start)."""
    cuda_graphs: bool = True
    """CUDA: replay decode steps from CUDA graphs, captured for every batch bucket at start."""
    async_scheduling: bool = False
    """Overlap schedule (vLLM's flag; SGLang's overlap scheduler): plan step N+1 while the device runs step N,
    deliver N's tokens after N+1 is queued. Off by default until measured on a GPU; on CPU it changes nothing."""
    pack_weights: bool = True
    """CPU: a oneDNN-packed copy of the projection weights for batched decode and prefill (faster; costs the
    weights' memory once more; skipped when free memory is short)."""
    fuse_projections: Literal["auto", "on", "off"] = "auto"
    """Serve q/k/v and gate/up of each block as one projection each (two GEMMs instead of five per block; costs
    those weights' memory once more). auto: on CUDA when the copy fits, off on CPU (no consistent gain there)."""
    speculative_config: str | None = None
    """Speculative decoding, vLLM's JSON: '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    (prompt lookup; the output is the same tokens, fewer forwards when it copies the prompt). docs/inference.md."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """vLLM's flag: fcfs admits requests by arrival; priority by each request's `priority` field first (lower is
    sooner, then arrival), and preempts the highest value first. Under fcfs a non-zero `priority` is a 400."""
    graceful_timeout: int = 30
    """Seconds in-flight requests get to finish on shutdown."""
    log_level: Annotated[LogLevel, tyro.conf.arg(aliases=("--uvicorn-log-level",), metavar="LEVEL")] = "info"
    """Log level of uvicorn and astrai's loggers: debug, info, warning, error or critical."""
    enable_log_requests: bool = False
    """Log each request's prompt text (a debug aid: request logs otherwise never carry prompts or the API key)."""
    otlp_traces_endpoint: str | None = None
    """OpenTelemetry: export a span tree per generation request (queue, prefill, decode, delivery; the client's
    W3C traceparent honoured) to this OTLP collector URL (vLLM's flag; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
    http/protobuf (default) or grpc). Needs pip install 'astrai[tracing]'. Unset: no tracing at all."""
    tool_call_parser: ToolCallParserName | None = None
    """Format of the model's tool calls (vLLM's names). Default: detected from the chat template ([TOOL_CALLS]:
    mistral, <function=: qwen3_coder, <|python_tag|>: llama3_json, tool▁calls▁begin: deepseek_v3, else hermes)."""
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = None
    """Split <think>...</think> off the answer: OpenAI `reasoning_content` (streamed as deltas), Anthropic `thinking`
    blocks (vLLM's names). Default: none, the text stays as the model wrote it."""
    responses_store_max_entries: int = 1024
    """Most responses /v1/responses keeps (store=true) for GET and previous_response_id; least recently used out
    first (0: keep none)."""
    responses_store_max_bytes: int = 64 << 20
    """Most bytes (JSON size, responses and their conversations) the /v1/responses store keeps."""
    max_reply_bytes: int = 32 << 20
    """Largest reply a request may ask for, estimated before generation from n, max_tokens, logprobs, echo and
    prompt_logprobs (a bigger one is a 400 naming them); 0: no limit."""
    stream_stall_timeout: float = 30.0
    """Seconds a stream may wait on a client that stopped reading before its request is aborted; 0: never."""
    embeddings: bool = False
    """Also serve POST /v1/embeddings: the model's blocks run bidirectionally, pooled per input."""
    embed_pooling: Literal["mean", "cls", "last"] = "mean"
    """Embedding pooling: mean of all tokens, the first token (cls) or the last token."""
    embed_normalize: bool = True
    """L2-normalise embeddings (cosine similarity becomes a dot product)."""
    max_embedding_tokens_per_request: int = 300_000
    """Most tokens one embeddings request may hold over all its inputs (OpenAI's limit); more is a 400."""
    max_embedding_batch_tokens: int | None = None
    """Padded tokens per encoder pass; requests take turns pass by pass. Default: --max-num-batched-tokens."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT folders) of the base model; a request's `model` names the adapter it runs with."""
    lora_modules: tuple[str, ...] = ()
    """Adapters loaded at start, each name=path or vLLM's JSON '{"name": ..., "path": ..., "base_model_name": ...}'
    (base_model_name: the served name its card gives as parent). Needs --enable-lora."""
    max_loras: int = 4
    """Most distinct adapters in one batch (device slots); requests for others wait for a free slot."""
    max_lora_rank: int = 16
    """Largest adapter rank served (adapters of a higher rank are refused at load)."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory (least recently used out first). Default: --max-loras."""
    enable_lora_runtime_updates: bool = False
    """Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING),
    behind the API key. Needs --enable-lora."""
    lora_root: str | None = None
    """Runtime loads may only read adapter folders under this folder (symlinks resolved); unset: any path."""


def origin_list(values: tuple[str, ...]) -> tuple[str, ...]:
    """`--allowed-origins`-style values, each a plain entry or (as vLLM takes them) a JSON list of entries."""
    out: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                items = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"{value!r} is not a JSON list: {err}") from None
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise ValueError(f"{value!r} must be a JSON list of strings")
            out += items
        else:
            out.append(value)
    return tuple(out)


@attrs.frozen
class LoRAModule:
    """One `--lora-modules` entry: the adapter's name, its PEFT folder, and the served name its card gives as
    parent (vLLM's base_model_name; None: the served name)."""

    name: str
    path: str
    base_model_name: str | None = None


def _lora_module(value: str) -> LoRAModule:
    shape = 'name=path or a JSON object {"name": ..., "path": ..., "base_model_name": ...}'
    if not value.lstrip().startswith("{"):
        name, eq, path = value.partition("=")
        if not (eq and name.strip() and path.strip()):
            raise ValueError(f"--lora-modules {value!r}: expected {shape}")
        return LoRAModule(name.strip(), path.strip())
    try:
        entry = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"--lora-modules {value!r} is not valid JSON: {err}") from None
    unknown = sorted(set(entry) - {"name", "path", "base_model_name"}) if isinstance(entry, dict) else []
    if not isinstance(entry, dict) or unknown:
        raise ValueError(
            f"--lora-modules {value!r}: expected {shape}" + (f"; unknown keys {unknown}" if unknown else "")
        )
    name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise ValueError(f'--lora-modules {value!r}: "name" and "path" must be non-empty strings')
    if base is not None and not isinstance(base, str):
        raise ValueError(f'--lora-modules {value!r}: "base_model_name" must be a string')
    return LoRAModule(name, path, base or None)


def lora_modules(cfg: ServeConfig, served: tuple[str, ...]) -> list[LoRAModule]:
    """The adapters `--lora-modules` names (name=path or vLLM's JSON form), checked against the other LoRA flags
    and the served names (`served`: the base model's; an adapter may not take one, a base_model_name must be one).

    Raises:
        ValueError: a malformed entry (naming it), a name given twice, a LoRA flag without --enable-lora, a
            --lora-root that is not a folder.
    """
    if not cfg.enable_lora:
        given = [flag for flag, on in (("--lora-modules", cfg.lora_modules),
                                       ("--enable-lora-runtime-updates", cfg.enable_lora_runtime_updates),
                                       ("--lora-root", cfg.lora_root is not None)) if on]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)} needs --enable-lora (serving LoRA adapters is off without it)")
        return []
    if cfg.lora_root is not None and not Path(cfg.lora_root).expanduser().is_dir():
        raise ValueError(f"--lora-root {cfg.lora_root!r} is not a folder")
    modules = [_lora_module(value) for value in cfg.lora_modules]
    seen: set[str] = set()
    for module in modules:
        if module.name in served:
            raise ValueError(f"--lora-modules {module.name!r}: the base model is served under that name; give the "
                             "adapter another")  # fmt: skip
        if module.name in seen:
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        if module.base_model_name is not None and module.base_model_name not in served:
            raise ValueError(f"--lora-modules {module.name!r}: base_model_name {module.base_model_name!r} is not a "
                             f"served model name ({', '.join(served)})")  # fmt: skip
        seen.add(module.name)
    return modules


def sampling_defaults(choice: str, model: Model) -> dict[str, Any]:
    """The request defaults `--generation-config` asks for (SamplingParams names -> values)."""
    from astrai.io.model import read_generation_defaults

    if choice == "auto":
        return dict(model.generation_defaults)
    if choice in ("none", "vllm"):
        return {}
    folder = Path(choice).expanduser()
    if not (folder / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {choice!r}: expected auto, none, vllm or a folder with a "
                         "generation_config.json")  # fmt: skip
    return read_generation_defaults(folder)


def engine_config(cfg: ServeConfig):
    """The EngineConfig the flags ask for."""
    from astrai.inference.engine import EngineConfig

    return EngineConfig(max_running=cfg.max_num_seqs, max_step_tokens=cfg.max_num_batched_tokens,
                        max_waiting=cfg.max_waiting, max_model_len=cfg.max_model_len,
                        kv_budget_tokens=cfg.kv_budget, gpu_memory_utilization=cfg.gpu_memory_utilization,
                        page_size=cfg.page_size, prefix_cache=cfg.enable_prefix_caching, seed=cfg.seed,
                        share_cpu_cores=cfg.share_cpu_cores,
                        compile=cfg.compile, cuda_graphs=cfg.cuda_graphs, pack_weights=cfg.pack_weights,
                        fuse_projections={"auto": None, "on": True, "off": False}[cfg.fuse_projections],
                        tensor_parallel_size=cfg.tensor_parallel_size, overlap_schedule=cfg.async_scheduling,
                        scheduling_policy=cfg.scheduling_policy, speculative=cfg.speculative_config,
                        enable_lora=cfg.enable_lora, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
                        max_cpu_loras=cfg.max_cpu_loras)  # fmt: skip


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` as uvicorn binds one (IPv6 for a host with `:`), for uvicorn to listen on.

    Bound before the model loads: a port that is taken fails in a second with an error naming it, not after
    minutes of loading and compiling as uvicorn's own bind would; port 0 picks a free port.

    Raises:
        OSError: the address cannot be bound (in use, not this machine's, no permission), with the address named.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        hint = "; another server may be running there: pass another --port" if err.errno == errno.EADDRINUSE else ""
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}{hint}") from None
    sock.set_inheritable(True)
    return sock


def _load_adapters(engine: Engine, modules: list[LoRAModule]) -> None:
    """Load the `--lora-modules` adapters into `engine` before serving; a bad one stops the server with one error
    line naming it and what is wrong (the engine is shut down first)."""
    for module in modules:
        start = time.perf_counter()
        try:
            engine.load_lora(module.name, Path(module.path).expanduser())
        except USER_ERRORS as err:
            engine.shutdown()
            fail(f"--lora-modules {module.name}={module.path}: cannot load the LoRA adapter: {err}")
        console.print(f"LoRA adapter [bold]{module.name}[/] loaded from {module.path} "
                      f"({time.perf_counter() - start:.1f} s)", highlight=False)  # fmt: skip


def _check_chat_template(model: Model) -> None:
    """Warn at start when the chat template fails on the simplest conversation (one user message): every request
    to /v1/chat/completions and /v1/messages would then be a 400. A warning, not a refusal: /v1/completions and
    /v1/embeddings do not use the template."""
    from astrai.io.chat_template import ChatTemplateError

    if model.tokenizer is None or model.tokenizer.chat_template is None:
        return
    try:
        model.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    except ChatTemplateError as err:
        err_console.print(f"[bold yellow]warning:[/] the chat template fails on a one-message conversation ({err}); "
                          "/v1/chat/completions and /v1/messages will answer 400", highlight=False,
                          soft_wrap=True)  # fmt: skip


def main(cfg: ServeConfig) -> None:
    """Bind the address, load the model, build the app and run uvicorn until interrupted."""
    origins = run_guarded(lambda: origin_list(cfg.allowed_origins))
    if cfg.otlp_traces_endpoint:  # the packages of the `tracing` extra, checked before anything is loaded
        _tracing_error(lambda: None)
    if cfg.data_parallel_size < 1:
        fail(f"--data-parallel-size must be >= 1, got {cfg.data_parallel_size}")
    if cfg.cache_salt_by_api_key and not (cfg.api_key or os.environ.get("ASTRAI_API_KEY")):
        fail("--cache-salt-by-api-key needs --api-key (or ASTRAI_API_KEY): without keys every client is one tenant")
    engine_cfg = run_guarded(lambda: engine_config(cfg))
    modules = run_guarded(lambda: lora_modules(cfg, served_names(cfg.model, cfg.served_model_name)))
    sock = run_guarded(lambda: listen_socket(cfg.host, cfg.port))
    with sock:  # uvicorn closes its servers, not the socket; an early failure leaves it open too
        if cfg.data_parallel_size > 1:
            from astrai.cli.serve_replicas import serve_replicas

            return serve_replicas(cfg, sock, origins)
        _serve(cfg, sock, origins, engine_cfg, modules)


def _tracing_error(make: Any) -> Any:
    """`make()` once the tracing packages are found (`tracing.check_available`); else, or when it raises a
    ValueError, `fail` with the message (its `[tracing]` kept, not read as markup)."""
    from rich.markup import escape

    from astrai.serve.tracing import check_available

    try:
        check_available()
        return make()
    except ValueError as err:  # TracingUnavailable, or a URL the exporter refuses
        fail(escape(str(err)))


def _tracer(endpoint: str | None):
    """The request tracer exporting to `endpoint` over OTLP (`astrai.serve.tracing`); None without one."""
    if not endpoint:
        return None
    from astrai.serve.tracing import Tracer

    return _tracing_error(lambda: Tracer.otlp(endpoint))


def _serve(cfg: ServeConfig, sock: socket.socket, origins: tuple[str, ...], engine_cfg: EngineConfig,
           modules: list[LoRAModule]) -> None:  # fmt: skip
    """Load the model, start the engine, build the app and run uvicorn on `sock` until interrupted."""
    from astrai.inference.engine import Engine
    from astrai.inference.graphs import GraphCaptureError
    from astrai.models.encoder import EncoderConfig
    from astrai.serve.app import build_app
    from astrai.serve.server import ConnectionLimits, GracefulServer, logging_config, server_config, with_cors

    port = sock.getsockname()[1]
    model = load_model(cfg)
    _check_chat_template(model)
    defaults = run_guarded(lambda: sampling_defaults(cfg.generation_config, model))
    # on CUDA the start compiles the decode step and captures its graphs: seconds to minutes for large models
    with console.status("starting the engine (KV pool; on CUDA: compiling and capturing the decode graphs)"):
        try:
            engine = run_guarded(lambda: Engine(model, engine_cfg))
        except GraphCaptureError as err:
            fail(str(err))
    _load_adapters(engine, modules)
    threading.Thread(target=prepare_grammar, args=(engine,), name="grammar-view", daemon=True).start()
    warm_up(engine)
    release_idle_threads()  # loading and warm-up built this thread an OpenMP pool: it would slow the engine's
    kv_tokens = engine.stats().kv_pages_total * engine_cfg.page_size
    console.print(f"KV cache: {kv_tokens:,} tokens; max model len {engine.max_model_len:,}; "
                  f"up to {engine_cfg.max_running} sequences", highlight=False)  # fmt: skip
    if defaults:
        console.print(f"sampling defaults ({cfg.generation_config}): {defaults}", highlight=False)
    names = served_names(cfg.model, cfg.served_model_name)
    name = names[0]
    embeddings = EncoderConfig(pooling=cfg.embed_pooling, normalize=cfg.embed_normalize) if cfg.embeddings else None
    api_key = cfg.api_key or os.environ.get("ASTRAI_API_KEY") or None
    if cfg.enable_lora_runtime_updates and (api_key is None or cfg.lora_root is None):
        risk = "any client that reaches the server" if api_key is None else "a client with the API key"
        where = "from any folder this process can read (set --lora-root)" if cfg.lora_root is None else ""
        err_console.print(f"[bold yellow]warning:[/] --enable-lora-runtime-updates: {risk} can load LoRA adapters "
                          f"{where}".rstrip(), highlight=False, soft_wrap=True)  # fmt: skip
    app = build_app(engine, model_name=name, api_key=api_key, max_body_bytes=cfg.max_body_bytes,
                    embeddings=embeddings, body_timeout=cfg.body_timeout,
                    allowed_hosts=cfg.allowed_hosts or None, metrics_public=cfg.metrics_public,
                    tokenizer_workers=cfg.tokenizer_workers,
                    allow_special_tokens_in_content=cfg.allow_special_tokens_in_content,
                    log_requests=cfg.enable_log_requests, sampling_defaults=defaults,
                    tool_call_parser=cfg.tool_call_parser, reasoning_parser=cfg.reasoning_parser,
                    model_aliases=names[1:], responses_max_stored=cfg.responses_store_max_entries,
                    responses_max_stored_bytes=cfg.responses_store_max_bytes,
                    max_embedding_tokens_per_request=cfg.max_embedding_tokens_per_request,
                    max_embedding_batch_tokens=cfg.max_embedding_batch_tokens,
                    cache_salt_by_api_key=cfg.cache_salt_by_api_key,
                    enable_prompt_tokens_details=cfg.enable_prompt_tokens_details,
                    max_reply_bytes=cfg.max_reply_bytes or None,
                    stream_stall_timeout=cfg.stream_stall_timeout or None,
                    lora_parents={m.name: m.base_model_name for m in modules if m.base_model_name},
                    lora_runtime_updates=cfg.enable_lora_runtime_updates,
                    lora_root=None if cfg.lora_root is None else str(Path(cfg.lora_root).expanduser()),
                    tracer=_tracer(cfg.otlp_traces_endpoint))  # fmt: skip
    app = with_cors(app, origins, methods=cfg.allowed_methods, headers=cfg.allowed_headers,
                    credentials=cfg.allow_credentials)  # fmt: skip
    extra = f", embeddings: {cfg.embed_pooling} pooling" if cfg.embeddings else ""
    console.print(f"serving [bold]{name}[/] on http://{cfg.host}:{port}/v1  (OpenAI and Anthropic APIs{extra})")
    limits = ConnectionLimits(header_timeout=cfg.header_timeout, keep_alive_timeout=cfg.keep_alive_timeout,
                              max_connections=cfg.max_connections)  # fmt: skip
    config = server_config(app, limits, host=cfg.host, port=port, timeout_graceful_shutdown=cfg.graceful_timeout,
                           log_level=cfg.log_level, log_config=logging_config(cfg.log_level))  # fmt: skip
    # model, tokenizer and libraries are loaded: take their objects out of the cyclic GC's reach, so that a full
    # collection (which a big reply's many small objects trigger) scans what requests allocate, not the whole heap:
    # it stops every thread, the event loop included (docs/serving.md, "Big replies")
    gc.collect()
    gc.freeze()
    GracefulServer(config, engine).run(sockets=[sock])
    if engine.fatal is not None:
        fail(f"the server stopped: {engine.fatal}")


if __name__ == "__main__":
    main(parse(ServeConfig, prog="astrai serve"))

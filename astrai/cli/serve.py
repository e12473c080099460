"""`astrai serve --model DIR`: an OpenAI- and Anthropic-compatible HTTP server on uvicorn.

Binds 127.0.0.1 by default. SIGINT/SIGTERM stop accepting connections, let in-flight requests finish for up to
`--graceful-timeout` seconds, then end the rest (finish_reason "abort") and free their KV. `--embeddings` also
serves `POST /v1/embeddings` (`--embed-pooling mean|cls|last`, `--no-embed-normalize`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import attrs
import tyro

from astrai.cli._common import console, fail, load_model, run_guarded


@attrs.frozen(kw_only=True)
class ServeConfig:
    """Serve a model over HTTP."""

    model: Path
    """HF-format model folder."""
    host: str = "127.0.0.1"
    """Interface to bind (0.0.0.0 exposes the server to the network)."""
    port: int = 8000
    """TCP port."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` or `x-api-key: KEY` on /v1/* routes and GET /metrics. Default: the
    ASTRAI_API_KEY environment variable (which, unlike a flag, `ps` does not show); unset means no key."""
    metrics_public: bool = False
    """Serve GET /metrics without the API key (a scraper can also send it: `authorization` in its config)."""
    served_model_name: str | None = None
    """Model id reported by /v1/models and in responses (default: the folder name)."""
    max_running: int = 64
    """Most sequences decoding at once."""
    max_waiting: int = 256
    """Most queued sequences (a request with n completions takes n) before the server answers 429 (OpenAI) / 529
    (Anthropic)."""
    kv_budget: int | None = None
    """KV pool size in tokens (default: a share of free memory on CUDA, 1 GiB on CPU)."""
    page_size: int = 16
    """Tokens per KV page."""
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
    """Host header names accepted besides localhost/127.0.0.1/[::1] ("*": any). Unset: requests arriving on a
    loopback address must name a loopback host (DNS rebinding), others may name any."""
    tokenizer_workers: int = 4
    """Threads that render chat templates and tokenize prompts, off the event loop (more requests queue)."""
    allow_special_tokens_in_content: bool = False
    """Encode special-token text in chat messages (`<|im_end|>`) as control tokens, not as plain text."""
    dtype: str | None = None
    """Parameter dtype (float32, bfloat16, float16); default: the checkpoint's."""
    device: str = "auto"
    """Device: auto (CUDA when available, else CPU), cuda, cuda:N or cpu."""
    compile: bool = True
    """torch.compile the decode step (first requests wait for the compile)."""
    cuda_graphs: bool = True
    """CUDA: replay decode steps from CUDA graphs, captured for every batch bucket at start (dense models)."""
    graceful_timeout: int = 30
    """Seconds in-flight requests get to finish on shutdown."""
    embeddings: bool = False
    """Also serve POST /v1/embeddings: the model's blocks run bidirectionally, pooled per input."""
    embed_pooling: Literal["mean", "cls", "last"] = "mean"
    """Embedding pooling: mean of all tokens, the first token (cls) or the last token."""
    embed_normalize: bool = True
    """L2-normalise embeddings (cosine similarity becomes a dot product)."""


def main(cfg: ServeConfig) -> None:
    """Load the model, build the app and run uvicorn until interrupted."""
    from astrai.inference.engine import Engine, EngineConfig
    from astrai.inference.graphs import GraphCaptureError
    from astrai.models.encoder import EncoderConfig
    from astrai.serve.app import build_app
    from astrai.serve.server import ConnectionLimits, GracefulServer, server_config

    model = load_model(cfg.model, cfg.dtype, cfg.device)
    engine_cfg = EngineConfig(max_running=cfg.max_running, max_waiting=cfg.max_waiting, kv_budget_tokens=cfg.kv_budget,
                              page_size=cfg.page_size, compile=cfg.compile, cuda_graphs=cfg.cuda_graphs)  # fmt: skip
    # on CUDA the start compiles the decode step and captures its graphs: seconds to minutes for large models
    with console.status("starting the engine (KV pool; on CUDA: compiling and capturing the decode graphs)"):
        try:
            engine = run_guarded(lambda: Engine(model, engine_cfg))
        except GraphCaptureError as err:
            fail(str(err))
    name = cfg.served_model_name or cfg.model.resolve().name
    embeddings = EncoderConfig(pooling=cfg.embed_pooling, normalize=cfg.embed_normalize) if cfg.embeddings else None
    api_key = cfg.api_key or os.environ.get("ASTRAI_API_KEY") or None
    app = build_app(engine, model_name=name, api_key=api_key, max_body_bytes=cfg.max_body_bytes,
                    embeddings=embeddings, body_timeout=cfg.body_timeout,
                    allowed_hosts=cfg.allowed_hosts or None, metrics_public=cfg.metrics_public,
                    tokenizer_workers=cfg.tokenizer_workers,
                    allow_special_tokens_in_content=cfg.allow_special_tokens_in_content)  # fmt: skip
    extra = f", embeddings: {cfg.embed_pooling} pooling" if cfg.embeddings else ""
    console.print(f"serving [bold]{name}[/] on http://{cfg.host}:{cfg.port}/v1  (OpenAI and Anthropic APIs{extra})")
    limits = ConnectionLimits(header_timeout=cfg.header_timeout, keep_alive_timeout=cfg.keep_alive_timeout,
                              max_connections=cfg.max_connections)  # fmt: skip
    config = server_config(app, limits, host=cfg.host, port=cfg.port, timeout_graceful_shutdown=cfg.graceful_timeout,
                           log_level="info")  # fmt: skip
    GracefulServer(config, engine).run()


if __name__ == "__main__":
    main(tyro.cli(ServeConfig))

"""`astrai serve --data-parallel-size N`: start N engine replicas and the front that relays to them.

Each replica is a whole `astrai serve` in its own process (`python -m astrai.cli.serve_worker`, its config read
from stdin as JSON, so no API key shows in `ps`), on a free loopback port, with `data_parallel_size` 1. On CPU it
gets its share of the cores: `cores // N` threads (`OMP_NUM_THREADS`) pinned to cores of its own (Linux), so
replicas do not fight over them; with CUDA, `tensor_parallel_size` devices of its own (`CUDA_VISIBLE_DEVICES`;
each replica is a TP group). Replicas die with the front (`PR_SET_PDEATHSIG` on Linux) and are stopped when it
stops. The front (`astrai.serve.replicas`) binds the address before the replicas start (a taken port fails at
once), waits until every replica answers /health, then serves.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import attrs
import cattrs

from astrai.cli._common import console, fail

READY_TIMEOUT = 1800.0  # seconds a replica may take to load, compile and say it is serving


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_shares(size: int, cores: Sequence[int]) -> list[list[int]]:
    """The cores each of `size` replicas is pinned to: equal contiguous shares (at least one core each; with fewer
    cores than replicas they share round-robin)."""
    cores = sorted(cores)
    if len(cores) < size:
        return [[cores[i % len(cores)]] for i in range(size)]
    share = len(cores) // size
    return [cores[i * share : (i + 1) * share] for i in range(size)]


def pin_and_follow_parent() -> None:
    """In the replica, first thing: pin to the cores the front chose (`ASTRAI_REPLICA_CORES`), and die when the
    front dies (Linux)."""
    cores = os.environ.pop("ASTRAI_REPLICA_CORES", "")
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])
    if sys.platform.startswith("linux"):
        parent = int(os.environ.pop("ASTRAI_REPLICA_PARENT", "0"))
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if parent and os.getppid() != parent:  # the front died before the line above
            sys.exit(1)


def start_replicas(cfg, size: int) -> list[tuple[subprocess.Popen, int]]:
    """Start `size` replica processes of `cfg` (a ServeConfig); returns (process, port) per replica."""
    import torch

    converter = cattrs.Converter()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per = cfg.tensor_parallel_size
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    shares = cpu_shares(size, cores)
    out = []
    for i in range(size):
        port = _free_port()
        worker = attrs.evolve(cfg, host="127.0.0.1", port=port, data_parallel_size=1)
        env = {**os.environ, "ASTRAI_REPLICA_PARENT": str(os.getpid())}
        pin = None
        if gpus >= size * per:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in range(i * per, (i + 1) * per))
        else:
            pin = shares[i]
            env["OMP_NUM_THREADS"], env["ASTRAI_REPLICA_CORES"] = str(len(pin)), ",".join(map(str, pin))
        process = subprocess.Popen([sys.executable, "-m", "astrai.cli.serve_worker"], stdin=subprocess.PIPE, env=env)
        process.stdin.write(json.dumps(converter.unstructure(worker)).encode())
        process.stdin.close()
        out.append((process, port))
        where = f"GPUs {env['CUDA_VISIBLE_DEVICES']}" if pin is None else f"cores {pin}"
        console.print(f"replica {i}: pid {process.pid}, port {port}, {where}", highlight=False)
    return out


def wait_ready(started: list[tuple[subprocess.Popen, int]], timeout: float = READY_TIMEOUT) -> None:
    """Wait until every replica answers /health with 200; a replica that exits first stops the start."""
    import httpx

    deadline = time.monotonic() + timeout
    pending = dict(enumerate(started))
    while pending:
        for i, (process, port) in list(pending.items()):
            if process.poll() is not None:
                stop_replicas(started)
                fail(f"replica {i} exited with code {process.returncode} before it was serving (its output is above)")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    del pending[i]
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            stop_replicas(started)
            fail(f"replicas {sorted(pending)} were not serving after {timeout:.0f} s")
        time.sleep(0.2)


def stop_replicas(started: list[tuple[subprocess.Popen, int]], grace: float = 10.0) -> None:
    """SIGTERM every replica (they finish gracefully), then SIGKILL those still running after `grace` seconds."""
    for process, _ in started:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process, _ in started:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


def serve_replicas(cfg, sock: socket.socket, origins: tuple[str, ...]) -> None:
    """Run the front on `sock` over `cfg.data_parallel_size` replicas until interrupted (`origins`: CORS)."""
    try:
        import httpx
    except ImportError:
        fail("--data-parallel-size needs httpx to relay requests: pip install 'astrai[replicas]'")
    from astrai.serve.replicas import Replica, ReplicaSet, front_app
    from astrai.serve.server import ConnectionLimits, StoppableServer, logging_config, server_config, with_cors

    size = cfg.data_parallel_size
    started = start_replicas(cfg, size)
    try:
        wait_ready(started)
        replicas = ReplicaSet([Replica(i, f"http://127.0.0.1:{port}", process)
                               for i, (process, port) in enumerate(started)])  # fmt: skip
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.max_connections)
        client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
        app = with_cors(front_app(replicas, client, max_body_bytes=cfg.max_body_bytes), origins,
                        methods=cfg.allowed_methods, headers=cfg.allowed_headers,
                        credentials=cfg.allow_credentials)  # fmt: skip
        port = sock.getsockname()[1]
        console.print(f"serving {size} replicas on http://{cfg.host}:{port}/v1")
        conn = ConnectionLimits(header_timeout=cfg.header_timeout, keep_alive_timeout=cfg.keep_alive_timeout,
                                max_connections=cfg.max_connections)  # fmt: skip
        config = server_config(app, conn, host=cfg.host, port=port, timeout_graceful_shutdown=cfg.graceful_timeout,
                               log_level=cfg.log_level, log_config=logging_config(cfg.log_level))  # fmt: skip
        StoppableServer(config).run(sockets=[sock])
    finally:
        stop_replicas(started)

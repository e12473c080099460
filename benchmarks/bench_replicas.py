"""Replicas behind a router (issue 45): cache-aware vs round-robin routing over two one-thread `astrai serve`
workers, against one two-thread engine, on a shared-prefix chat workload.

Arms (every one a set of real processes on 127.0.0.1, each serving with an API key):
- **cache_aware**: two `astrai serve` workers, each pinned to its own core (`sched_setaffinity`, the core shares of
  `astrai.cli.serve_replicas.cpu_shares`) with one torch thread (`OMP_NUM_THREADS=1`), behind SGLang's router
  (`python -m sglang_router.launch_router --policy cache_aware`, its other settings at their defaults);
- **round_robin**: the same two workers behind the router with `--policy round_robin`;
- **one_engine**: one `astrai serve` with two threads on both cores, no router, twice a worker's KV budget (the same
  threads and KV memory in total as the two workers);
- **dp_front** (`--dp-front`, on by default): `astrai serve --data-parallel-size 2` (astrai's own front: two
  one-thread replicas pinned by it, each request to the replica with the fewest in flight).
Workers are started once (their start-up, compiling the decode step, is not timed) and reused by every round; the
router is started afresh for every run of its arm (its approximate prefix tree starts empty).

Workload: `--prompts` long system prompts (`--system-tokens` tokens of random words each), `--users` users per
system prompt, each with a distinct short user turn (`--user-tokens`): prompts x users chat requests through the
OpenAI-compatible API (`/v1/chat/completions`, streaming, greedy, `ignore_eos`, `--new` tokens each), sent in a
seeded random order (system prompts interleaved, so round robin scatters each prompt's users over both workers),
with `--concurrency` requests in flight, from asyncio + httpx in this process. Every round draws new system prompts
and user turns (the same for every arm in the round) and every arm's prefix caches are flushed before its run
(`POST /flush_cache` on each worker), so every run starts cold. Arms run once per round, in an order rotated by one
each round; each figure is the median over `--rounds` rounds with its min-max, and the ratios are taken round by
round.

Per run: output tok/s (completion tokens from the streams' usage chunks over the run's wall time), TTFT p50/p99
(request sent to its first content chunk, at the client), and per replica the prefix-cache hit rate (the deltas of
its `vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total`, prompt tokens found cached over prompt
tokens looked up), its requests and preemptions. `--kv-budget` sets each one-thread worker's KV cache in tokens
(the default, three quarters of the workload's system prompts together, is the case cache-aware routing is for: one
replica cannot hold every prefix but each can hold its half); the read bandwidth is probed at the start of each
round (`bench_forward.memory_bandwidth_gbs`, all workers idle).

Goals (issue 45, 2-core CPU): cache_aware >= 1.5x round_robin's prefix hit rate and a lower p50 TTFT. Model: a
random SmolLM2-135M-shaped model (`bench_serve.build_model`, fp32) saved to a temporary folder. Prints rich tables
and the JSON report as the last stdout line. `--smoke`: a tiny model, eager, a few requests, 1 round (seconds).
Usage: python benchmarks/bench_replicas.py [--prompts 8] [--users 8] [--system-tokens 512] [--user-tokens 24]
       [--new 16] [--concurrency 8] [--rounds 3] [--kv-budget 3072] [--no-dp-front] [--no-compile] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results" / "bench_replicas.json"
KEY = "bench-replicas-key"
NAME = "bench"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOALS = {"hit_rate_cache_aware_vs_round_robin": 1.5, "ttft_p50_cache_aware_vs_round_robin": 1.0}
ARMS = ["cache_aware", "round_robin", "one_engine", "dp_front"]
COUNTERS = {"queries": "vllm:prefix_cache_queries_total", "hits": "vllm:prefix_cache_hits_total",
            "requests": "vllm:request_success_total", "preemptions": "vllm:num_preemptions_total",
            "prompt_tokens": "vllm:prompt_tokens_total"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A subprocess in its own process group (pinned to `cores` when given), its output to `log`; `stop` ends the
    whole group: SIGTERM, then SIGKILL after `grace` seconds."""

    def __init__(self, name: str, argv: list[str], log: Path, *, env: dict | None = None,
                 cores: list[int] | None = None) -> None:  # fmt: skip
        self.name, self.argv, self.log = name, argv, log
        self.env = {**os.environ, **(env or {})}
        self.cores = cores
        self.proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        cores = self.cores

        def pin() -> None:  # in the child, before exec: the pinning is inherited by every thread it starts
            if cores is not None and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cores)

        self.out = open(self.log, "w")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(self.argv, stdout=self.out, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, preexec_fn=pin)  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self, grace: float = 15.0) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)  # the group: a front's replicas too
            try:
                self.proc.wait(timeout=wait)
                if sig == signal.SIGTERM:  # the leader ended; make sure nothing of its group outlives it
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                break
            except subprocess.TimeoutExpired:
                continue
        self.out.close()
        self.proc = None


def wait_healthy(proc: Proc, url: str, deadline: float) -> None:
    """Until `url`/health answers 200; raises when `proc` exits or `deadline` (monotonic) passes."""
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited before serving:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} was not serving in time:\n{proc.tail()}")
        time.sleep(0.3)


def serve_argv(model_dir: str, port: int, args: argparse.Namespace, kv: int, *extra: str) -> list[str]:
    """`astrai serve` on 127.0.0.1:`port` with a KV budget of `kv` tokens (the API key comes by environment)."""
    return [sys.executable, "-m", "astrai.cli.main", "serve", model_dir, "--port", str(port), "--served-model-name",
            NAME, "--kv-budget", str(kv), "--max-model-len", str(args.max_model_len), "--log-level", "warning",
            "--compile" if args.compile else "--no-compile", *extra]  # fmt: skip


def threads_env(n: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n), "ASTRAI_API_KEY": KEY}


class Router:
    """sglang-router over `urls` with `policy` (its other settings at their defaults but faster health checks),
    waited for until it counts every worker healthy."""

    def __init__(self, urls: list[str], policy: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.urls = urls
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", policy,
                "--api-key", KEY, "--worker-urls", *urls, "--health-check-interval-secs", "5",
                "--shutdown-grace-period-secs", "1", "--log-level", "warn"]  # fmt: skip
        self.proc = Proc(f"router ({policy})", argv, log)

    def __enter__(self) -> Router:
        self.proc.start()
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ready = httpx.get(f"{self.url}/readiness", timeout=2)
                if ready.status_code == 200 and ready.json().get("healthy_workers") == len(self.urls):
                    return self
            if not self.proc.alive() or time.monotonic() > deadline:
                self.proc.stop()
                raise RuntimeError(f"the router did not count {len(self.urls)} healthy workers:\n{self.proc.tail()}")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.proc.stop(grace=10)


def metrics(url: str) -> dict[str, float]:
    """The counters of `COUNTERS` in `url`/metrics, each summed over its samples."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    out = dict.fromkeys(COUNTERS, 0.0)
    names = {v: k for k, v in COUNTERS.items()}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


def flush(url: str) -> None:
    reply = httpx.post(f"{url}/flush_cache", headers=AUTH, timeout=30)
    if reply.status_code != 200 or reply.json().get("flushed") is not True:
        raise RuntimeError(f"flushing {url} failed: {reply.status_code} {reply.text[:300]}")


def words_text(rng: random.Random, tokenizer, tokens: int) -> str:
    """Random lower-case words, cut where the text first reaches `tokens` tokens."""
    words: list[str] = []
    while True:
        words += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                  for _ in range(max(4, tokens // 8))]  # fmt: skip
        if len(tokenizer.encode(" ".join(words))) >= tokens:
            break
    lo, hi = 1, len(words)  # the fewest words reaching `tokens`
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.encode(" ".join(words[:mid]))) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def workload(tokenizer, args: argparse.Namespace, seed: int) -> list[dict]:
    """The round's requests in sending order: each system prompt with each of its users' turns, shuffled."""
    rng = random.Random(seed)
    systems = [words_text(rng, tokenizer, args.system_tokens) for _ in range(args.prompts)]
    requests = [dict(system=p, user=words_text(rng, tokenizer, args.user_tokens)) for p in range(args.prompts)
                for _ in range(args.users)]  # fmt: skip
    rng.shuffle(requests)
    return [{"model": NAME, "messages": [{"role": "system", "content": systems[r["system"]]},
                                         {"role": "user", "content": r["user"]}],
             "max_tokens": args.new, "temperature": 0, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True}} for r in requests]  # fmt: skip


async def one_request(client: httpx.AsyncClient, body: dict) -> tuple[float | None, int]:
    """Stream one chat request: (seconds to its first content chunk, completion tokens); (None, 0) on an error."""
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return None, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return None, 0
            choices = event.get("choices") or []
            if first is None and choices and "role" not in choices[0].get("delta", {}):
                first = time.perf_counter() - start  # the first chunk after the role chunk: a token's text
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return first, tokens


async def load(url: str, bodies: list[dict], concurrency: int) -> dict:
    """`bodies` through `url` with `concurrency` in flight, in order: wall, tokens, TTFTs, errors."""
    queue, ttft, out = list(reversed(bodies)), [], dict(tokens=0, errors=0)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            body = queue.pop()
            try:
                first, tokens = await one_request(client, body)
            except httpx.HTTPError:
                first, tokens = None, 0
            if first is None:
                out["errors"] += 1
            else:
                ttft.append(first)
                out["tokens"] += tokens

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return dict(out, wall_s=wall, ttft=ttft)


def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


class Setup:
    """The processes every arm needs: the two pinned one-thread workers, the two-thread engine, the DP front."""

    def __init__(self, model_dir: str, args: argparse.Namespace, folder: Path) -> None:
        from astrai.cli.serve_replicas import cpu_shares

        self.args, self.procs, self.seconds = args, [], {}
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
        self.cores, self.shares = cores, cpu_shares(2, cores)
        self.workers: list[str] = []  # the router arms' worker URLs
        for i, share in enumerate(self.shares):
            port = free_port()
            self.procs.append(Proc(f"worker {i}", serve_argv(model_dir, port, args, args.kv_budget),
                                   folder / f"worker{i}.log", env=threads_env(len(share)), cores=share))  # fmt: skip
            self.workers.append(f"http://127.0.0.1:{port}")
        port = free_port()
        self.one = f"http://127.0.0.1:{port}"
        self.procs.append(Proc("one engine", serve_argv(model_dir, port, args, 2 * args.kv_budget),
                               folder / "one.log", env=threads_env(len(cores)), cores=cores))  # fmt: skip
        self.front, self.front_replicas = None, []
        if args.dp_front:
            port = free_port()
            self.front = f"http://127.0.0.1:{port}"
            self.procs.append(Proc("dp front", serve_argv(model_dir, port, args, args.kv_budget,
                                                          "--data-parallel-size", "2"),
                                   folder / "front.log", env={"ASTRAI_API_KEY": KEY}, cores=cores))  # fmt: skip

    def start(self) -> None:
        """The two workers first (they fill the inductor cache the front's replicas, of the same shape, then read),
        then the engine and the front together."""
        from _common import console

        deadline = time.monotonic() + self.args.start_timeout
        start = time.perf_counter()
        for proc in self.procs[:2]:
            proc.start()
        for proc, url in zip(self.procs[:2], self.workers, strict=True):
            wait_healthy(proc, url, deadline)
        self.seconds["workers"] = time.perf_counter() - start
        console.print(f"[dim]two workers serving after {self.seconds['workers']:.0f} s[/]")
        start = time.perf_counter()
        for proc in self.procs[2:]:
            proc.start()
        wait_healthy(self.procs[2], self.one, deadline)
        if self.front is not None:
            wait_healthy(self.procs[3], self.front, deadline)
            self.front_replicas = _replica_urls(self.procs[3].log)
        self.seconds["engine_and_front"] = time.perf_counter() - start
        console.print(f"[dim]engine and front serving after {self.seconds['engine_and_front']:.0f} s more[/]")

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()

    def replicas(self, arm: str) -> list[str]:
        """The worker URLs whose metrics and caches an arm uses."""
        return {"cache_aware": self.workers, "round_robin": self.workers, "one_engine": [self.one],
                "dp_front": self.front_replicas}[arm]  # fmt: skip


def _replica_urls(log: Path) -> list[str]:
    """The front's replica ports, from its start-up lines (`replica i: pid P, port N, ...`)."""
    ports = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("replica ") and ", port " in line:
            ports[int(line.split()[1].rstrip(":"))] = int(line.split(", port ")[1].split(",")[0])
    if len(ports) != 2:
        raise RuntimeError(f"could not read the front's replica ports from its log:\n{log.read_text()[-2000:]}")
    return [f"http://127.0.0.1:{ports[i]}" for i in sorted(ports)]


def run_arm(setup: Setup, arm: str, bodies: list[dict], args: argparse.Namespace, folder: Path) -> dict:
    """One cold run of `arm` over `bodies`: flush its workers' caches, send the load, read the counters' deltas."""
    urls = setup.replicas(arm)
    for url in urls:
        flush(url)
    before = [metrics(u) for u in urls]

    def go(target: str) -> dict:
        return asyncio.run(load(target, bodies, args.concurrency))

    if arm in ("cache_aware", "round_robin"):
        with Router(urls, arm, folder / f"router_{arm}.log") as router:
            got = go(router.url)
    else:
        got = go(setup.one if arm == "one_engine" else setup.front)
    after = [metrics(u) for u in urls]
    replicas = []
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        d = {k: a[k] - b[k] for k in COUNTERS}
        replicas.append(dict(replica=i, requests=int(d["requests"]), queried_tokens=int(d["queries"]),
                             hit_tokens=int(d["hits"]), hit_rate=d["hits"] / d["queries"] if d["queries"] else 0.0,
                             preemptions=int(d["preemptions"])))  # fmt: skip
    queried = sum(r["queried_tokens"] for r in replicas)
    return dict(arm=arm, requests=len(bodies), errors=got["errors"], tokens=got["tokens"], wall_s=got["wall_s"],
                output_tok_s=got["tokens"] / got["wall_s"], ttft_p50=pct(got["ttft"], 50),
                ttft_p99=pct(got["ttft"], 99), ttft_mean=statistics.fmean(got["ttft"]) if got["ttft"] else None,
                hit_rate=sum(r["hit_tokens"] for r in replicas) / queried if queried else 0.0,
                replicas=replicas)  # fmt: skip


def warm(setup: Setup, tokenizer, args: argparse.Namespace) -> None:
    """One untimed request straight to every worker (first-call set-up outside the timed runs)."""
    body = workload(tokenizer, args, seed=7)[0]
    urls = setup.workers + [setup.one] + setup.front_replicas
    for url in urls:
        got = asyncio.run(load(url, [body], 1))
        if got["errors"]:
            raise RuntimeError(f"the warm-up request to {url} failed")


def run(args: argparse.Namespace) -> dict:
    import torch
    from _common import console
    from bench_forward import memory_bandwidth_gbs
    from bench_serve import build_model

    from astrai.io.model import save

    torch.manual_seed(0)
    arms = [a for a in ARMS if a != "dp_front" or args.dp_front]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_replicas_") as tmp:
        folder = Path(tmp)
        model = build_model(args.config, args.vocab)
        tokenizer = model.tokenizer
        weight_bytes = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(model.params))
        model_dir = str(save(model, folder / "model"))
        config = model.config
        del model
        setup = Setup(model_dir, args, folder)
        runs: dict[str, list[dict]] = defaultdict(list)
        bandwidths, loads = [], []
        try:
            setup.start()
            warm(setup, tokenizer, args)
            for r in range(args.rounds):
                bodies = workload(tokenizer, args, seed=1000 + r)
                bandwidths.append(memory_bandwidth_gbs(256 if args.smoke else 1024, 3))
                loads.append(os.getloadavg()[0])
                order = arms[r % len(arms) :] + arms[: r % len(arms)]
                for arm in order:
                    row = run_arm(setup, arm, bodies, args, folder)
                    runs[arm].append(row)
                    per = ", ".join(f"{x['hit_rate']:.2f}/{x['requests']}" for x in row["replicas"])
                    console.print(f"[dim]round {r + 1}/{args.rounds} {arm}: {row['output_tok_s']:.1f} tok/s, TTFT "
                                  f"p50 {row['ttft_p50']:.2f} s p99 {row['ttft_p99']:.2f} s, hit rate "
                                  f"{row['hit_rate']:.2f} (per replica rate/requests: {per}), errors "
                                  f"{row['errors']}[/]")  # fmt: skip
        finally:
            setup.stop()
    report = dict(benchmark="bench_replicas", date=datetime.date.today().isoformat(), config=args.config,
                  vocab=config.vocab_size, dtype="float32", weight_bytes=weight_bytes, cpu=_cpu_name(),
                  cores=len(setup.cores), torch=torch.__version__, router=_router_version(), compile=args.compile,
                  prompts=args.prompts, users=args.users, requests=args.prompts * args.users,
                  system_tokens=args.system_tokens, user_tokens=args.user_tokens, new_tokens=args.new,
                  concurrency=args.concurrency, rounds=args.rounds, kv_budget_worker=args.kv_budget,
                  kv_budget_one_engine=2 * args.kv_budget, page_size=16, arms=arms, goals=GOALS,
                  worker_cores=setup.shares, start_seconds=setup.seconds,
                  cold="every round draws new system prompts and user turns; each arm's workers' prefix caches are "
                       "flushed (POST /flush_cache) before its run; the router is restarted per run",
                  bandwidth_gbs=dict(median=statistics.median(bandwidths), min=min(bandwidths), max=max(bandwidths),
                                     runs=bandwidths),
                  loadavg_1min_at_rounds=loads, loadavg_end=os.getloadavg(),
                  runs=dict(runs))  # fmt: skip
    report["results"] = [summarise(arm, runs[arm]) for arm in arms]
    report["ratios"] = ratios(runs, arms)
    report["seconds"] = time.perf_counter() - started
    return report


def _spread(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def summarise(arm: str, rows: list[dict]) -> dict:
    """An arm's medians (min-max) over the rounds; per replica, its hit rate's median and its requests' total."""
    out = dict(arm=arm, errors=sum(r["errors"] for r in rows))
    for key in ("output_tok_s", "ttft_p50", "ttft_p99", "hit_rate"):
        out[key] = _spread([r[key] for r in rows])
    n = len(rows[0]["replicas"])
    out["replica_hit_rate"] = [statistics.median(r["replicas"][i]["hit_rate"] for r in rows) for i in range(n)]
    out["replica_requests"] = [sum(r["replicas"][i]["requests"] for r in rows) for i in range(n)]
    out["preemptions"] = sum(x["preemptions"] for r in rows for x in r["replicas"])
    return out


def ratios(runs: dict[str, list[dict]], arms: list[str]) -> list[dict]:
    """Round-by-round ratios: cache_aware over round_robin (hit rate, p50 TTFT, tok/s) and each two-replica arm over
    the one engine (tok/s, p50 TTFT)."""
    pairs = [("hit_rate_cache_aware_vs_round_robin", "hit_rate", "cache_aware", "round_robin"),
             ("ttft_p50_cache_aware_vs_round_robin", "ttft_p50", "cache_aware", "round_robin"),
             ("tok_s_cache_aware_vs_round_robin", "output_tok_s", "cache_aware", "round_robin")]  # fmt: skip
    for arm in [a for a in arms if a != "one_engine"]:
        pairs += [(f"tok_s_{arm}_vs_one_engine", "output_tok_s", arm, "one_engine"),
                  (f"ttft_p50_{arm}_vs_one_engine", "ttft_p50", arm, "one_engine")]  # fmt: skip
    out = []
    for name, key, num, den in pairs:
        values = [a[key] / b[key] if b[key] else float("inf") for a, b in zip(runs[num], runs[den], strict=True)]
        row = dict(ratio=name, of=f"{num} / {den} ({key})", **_spread(values), runs=values, goal=GOALS.get(name))
        if name.startswith("hit_rate"):
            row["met"] = row["median"] >= row["goal"]
        elif name in GOALS:  # lower TTFT: the ratio below the goal
            row["met"] = row["median"] < row["goal"]
        out.append(row)
    return out


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def _router_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang-router")
    except PackageNotFoundError:
        return None


def show(report: dict) -> None:
    from _common import console, table

    what = {"cache_aware": "2 x 1-thread workers, sglang-router cache_aware",
            "round_robin": "2 x 1-thread workers, sglang-router round_robin",
            "one_engine": "1 x 2-thread engine, no router",
            "dp_front": "astrai serve --data-parallel-size 2 (fewest in flight)"}  # fmt: skip
    rows = []
    for r in report["results"]:
        tok, p50 = r["output_tok_s"], r["ttft_p50"]
        rows.append(dict(arm=r["arm"], tok_s=f"{tok['median']:.1f} ({tok['min']:.1f}-{tok['max']:.1f})",
                         ttft_p50=f"{p50['median']:.2f} ({p50['min']:.2f}-{p50['max']:.2f})",
                         ttft_p99=r["ttft_p99"]["median"], hit_rate=r["hit_rate"]["median"],
                         per_replica=" / ".join(f"{h:.2f}" for h in r["replica_hit_rate"]),
                         requests=" / ".join(str(n) for n in r["replica_requests"]),
                         errors=r["errors"], preempted=r["preemptions"]))  # fmt: skip
    p = report
    console.print(table(f"{p['prompts']} system prompts x {p['users']} users ({p['system_tokens']}+{p['user_tokens']}"
                        f" prompt tokens, {p['new_tokens']} new), {p['concurrency']} in flight, {p['config']} fp32, "
                        f"KV {p['kv_budget_worker']} tokens per 1-thread worker: median (min-max) of {p['rounds']} "
                        "rounds", rows,
                        [("arm", ""), ("tok_s", ""), ("ttft_p50", ""), ("ttft_p99", ".2f"), ("hit_rate", ".3f"),
                         ("per_replica", ""), ("requests", ""), ("errors", ""), ("preempted", "")]))  # fmt: skip
    console.print("; ".join(f"{arm}: {what[arm]}" for arm in report["arms"]), highlight=False)
    console.print(table("ratios, round by round: median (min-max)", report["ratios"],
                        [("ratio", ""), ("of", ""), ("median", ".3f"), ("min", ".3f"), ("max", ".3f"), ("goal", ".2f"),
                         ("met", "")]))  # fmt: skip
    bw = report["bandwidth_gbs"]
    console.print(f"read bandwidth {bw['median']:.1f} GB/s ({bw['min']:.1f}-{bw['max']:.1f}); load average at the "
                  f"rounds {', '.join(f'{x:.1f}' for x in report['loadavg_1min_at_rounds'])}; start-up (not timed) "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in report["start_seconds"].items())
                  + f"; whole run {report['seconds']:.0f} s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    parser.add_argument("--config", default="smollm2-135m", help="named model shape (random weights)")
    parser.add_argument("--vocab", type=int, default=4096, help="tokenizer size asked of the trained tokenizer")
    parser.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--users", type=int, default=8, help="requests (distinct user turns) per system prompt")
    parser.add_argument("--system-tokens", type=int, default=512, help="tokens of each system prompt")
    parser.add_argument("--user-tokens", type=int, default=24, help="tokens of each user turn")
    parser.add_argument("--new", type=int, default=16, help="new tokens per request (greedy, ignore_eos)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; every arm runs once per round")
    parser.add_argument("--kv-budget", type=int, default=3072,
                        help="KV tokens of each 1-thread worker (the one engine: twice this)")  # fmt: skip
    parser.add_argument("--dp-front", action=argparse.BooleanOptionalAction, default=True,
                        help="also run astrai serve --data-parallel-size 2")  # fmt: skip
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compiled decode in every engine (default: on, off in --smoke)")  # fmt: skip
    parser.add_argument("--start-timeout", type=float, default=1200.0,
                        help="seconds each engine may take to start (a cold inductor cache: minutes)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny model, eager, 2 x 3 requests, 1 round")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON report")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.vocab, args.prompts, args.users, args.system_tokens = "tiny", 300, 2, 3, 48
        args.user_tokens, args.new, args.concurrency, args.rounds, args.kv_budget = 8, 4, 4, 1, 1024
        args.start_timeout = min(args.start_timeout, 120.0)
    if args.compile is None:
        args.compile = not args.smoke
    args.max_model_len = args.system_tokens + args.user_tokens + args.new + 64  # room for the chat template
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        parser.error("needs sglang-router (pip install sglang-router: the dev extra)")
    from _common import emit

    report = run(args)
    show(report)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

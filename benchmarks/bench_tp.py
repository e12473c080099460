"""Tensor-parallel inference on the user's path: `Engine(model, EngineConfig(tensor_parallel_size=N))` for N = 1, 2.

Per N: the engine start (for N > 1: spawning the rank processes and sharding), per-rank parameter and KV bytes,
and generation throughput (`--requests` greedy requests of `--max-tokens` tokens submitted at once: prefill, then
batched decode), median of `--repeats` runs with min/max, the first (cold: radix prefix cache empty) run reported
apart from the warm ones (the same prompts again: every prompt is a prefix-cache hit). The greedy outputs of every
N must equal N = 1's, otherwise the script fails. Eager steps (TP does not compile its steps yet), fp32.

On CPU the ranks share the machine's cores (each takes 1/N of the threads): this measures the cost of the
collectives and of the step broadcast, not a speed-up; the speed-up needs N devices (GPU: unmeasured, none lent).
Prints a rich table and writes JSON (also the last stdout line). `--smoke` runs a tiny model in seconds.
Usage: python benchmarks/bench_tp.py [--preset small] [--requests 8] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import console, emit, table

from astrai.inference.cache import kv_bytes_per_token
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.io.model import Model
from astrai.models.config import ModelConfig
from astrai.models.decoder import init_params
from astrai.models.tp import shard_params, tp_config
from astrai.ops.collectives import TensorParallel
from astrai.tree import leaves

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "cpu_bench_tp.json"
PRESETS = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "smoke": (64, 128, 2, 4, 2, 256),
    "small": (512, 1536, 8, 8, 4, 8192),
}
MIB = 2**20


def model_config(preset: str) -> ModelConfig:
    hidden, inter, layers, heads, kv, vocab = PRESETS[preset]
    return ModelConfig(model_type="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       head_dim=hidden // heads, qk_norm=True, max_position_embeddings=2048)  # fmt: skip


def rank_mib(model: Model, size: int) -> float:
    """Parameter MiB on the busiest rank (rank 0: it holds the row-parallel biases)."""
    shard = shard_params(model.params, model.config, TensorParallel(rank=0, size=size))
    return sum(t.numel() * t.element_size() for t in leaves(shard)) / MIB


def measure(model: Model, size: int, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    config = EngineConfig(tensor_parallel_size=size, compile=False, kv_budget_tokens=args.requests * 512, seed=0)
    with Engine(model, config) as engine:
        start_s = time.perf_counter() - t0
        runs, outputs = [], None
        for _ in range(args.repeats + 1):  # the first run is cold (empty prefix cache)
            t = time.perf_counter()
            handles = [engine.submit(p, params) for p in prompts]
            outs = [h.result().outputs[0].token_ids for h in handles]
            runs.append(args.requests * args.max_tokens / (time.perf_counter() - t))
            outputs = outputs or outs
    warm = runs[1:]
    return {
        "tp": size,
        "start_s": start_s,
        "param_mib_per_rank": rank_mib(model, size),
        "kv_bytes_per_token_per_rank": kv_bytes_per_token(tp_config(model.config, size), model.dtype),
        "cold_tok_s": runs[0],
        "warm_tok_s": statistics.median(warm),
        "warm_min": min(warm),
        "warm_max": max(warm),
        "outputs": outputs,
    }


def run(args: argparse.Namespace) -> dict:
    cfg = model_config(args.preset)
    model = Model(config=cfg, params=init_params(cfg, seed=0))
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(args.requests)
    ]
    rows = [measure(model, size, prompts, args) for size in (1, 2)]
    if rows[1]["outputs"] != rows[0]["outputs"]:
        raise RuntimeError("TP=2 greedy outputs differ from TP=1: the comparison would not be fair")
    for row in rows:
        row.pop("outputs")
        row["warm_vs_tp1"] = row["warm_tok_s"] / rows[0]["warm_tok_s"]
    return {
        "benchmark": "bench_tp",
        "preset": args.preset,
        "model": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size},
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "backend": "gloo",
        "results": rows,
        "host": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
    }


def show(report: dict) -> None:
    title = (f"TP inference via Engine, preset {report['preset']} ({report['requests']} requests x "
             f"{report['max_tokens']} tokens, {report['threads']} threads shared by the ranks)")  # fmt: skip
    cols = [("tp", ""), ("start_s", ".1f"), ("param_mib_per_rank", ".1f"), ("kv_bytes_per_token_per_rank", ""),
            ("cold_tok_s", ".0f"), ("warm_tok_s", ".0f"), ("warm_min", ".0f"), ("warm_max", ".0f"),
            ("warm_vs_tp1", ".2f")]  # fmt: skip
    console.print(table(title, report["results"], cols))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="warm runs (after one cold run)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.requests, args.prompt_len, args.max_tokens, args.repeats = "smoke", 2, 8, 4, 1
    report = run(args)
    show(report)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

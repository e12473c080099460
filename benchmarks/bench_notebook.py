"""Notebook decode: `astrai.generate_ids` first and later calls vs transformers `generate`, same weights (CPU).

One prompt (`--prompt-len` random tokens), `--new` greedy tokens (no stop), whole-call wall time as a notebook
user sees it (prefill included) on both sides:
- transformers: `model.generate` eager (DynamicCache) and its fastest path (static cache + `torch.compile`):
  `--repeats` timed calls each, alternating, after one warm-up call each (the static path compiles there; its
  compile time is reported as that path's first call);
- astrai cached, compiled (the default): the process's first call (builds the engine, compiles with cold
  caches), after `release_engines` a first call again (a new engine, warm caches), then `--repeats`
  calls on the cached engine; then a size-up call (twice the tokens: a bigger engine, compiled again with
  warm inductor/dynamo caches);
- astrai cached, eager (`engine_cache.COMPILE = False`): first call and `--repeats` calls;
- astrai uncached (`engine_cache.run_once`, what `astrai.generate` did before: an eager engine per call).
Medians with min/max over the repeats. Prints a rich table and the JSON report as the last stdout line.
Usage: python benchmarks/bench_notebook.py [--config smollm2-135m] [--new 64] [--repeats 5]; `--smoke` in seconds.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import console, emit, hf_generate_kwargs, table
from bench_engine import build, hf_generate, prompts

import astrai
from astrai.configs.models import NAMED
from astrai.inference import engine_cache
from astrai.inference.generate import _params

RESULTS = Path(__file__).resolve().parent / "results" / "bench_notebook.json"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(name: str, new: int, seconds: list[float], first_s: float | None = None) -> dict:
    rates = [new / s for s in seconds]
    row = dict(path=name, tok_s=statistics.median(rates), tok_s_min=min(rates), tok_s_max=max(rates))
    if first_s is not None:
        row.update(first_call_s=first_s, first_tok_s=new / first_s)
    return row


def astrai_rows(model, prompt: list[list[int]], args) -> list[dict]:
    def call(new: int = args.new) -> None:
        astrai.generate_ids(model, prompt, max_tokens=new, stop_token_ids=[])

    rows = []
    for compile in (True, False):
        engine_cache.COMPILE = compile
        astrai.release_engines()
        first = _timed(call)
        rows.append(summary(f"astrai cached, {'compiled' if compile else 'eager'}", args.new,
                            [_timed(call) for _ in range(args.repeats)], first))  # fmt: skip
        if compile:  # twice the tokens: the engine is rebuilt bigger and compiled again (warm caches)
            size_up = _timed(lambda: call(2 * args.new))
            rows[-1].update(size_up_call_s=size_up, size_up_tok_s=2 * args.new / size_up)
    engine_cache.COMPILE = True
    astrai.release_engines()
    params = _params(args.new, 0.0, 0, 1.0, None, (), [])
    run_once = [_timed(lambda: engine_cache.run_once(model, prompt, params)) for _ in range(args.repeats)]
    rows.append(summary("astrai uncached (engine per call, eager)", args.new, run_once))
    return rows


def hf_rows(hf, prompt: list[list[int]], args) -> list[dict]:
    """transformers `generate` eager and with static cache + compile: one warm-up call each (the static one
    compiles; its time is that row's first call), then `--repeats` calls each, alternating."""
    # the static cache is sized for the size-up call's length too, so one compiled graph serves every call
    modes = {"eager": hf_generate_kwargs("eager", 0),
             "static-compile": hf_generate_kwargs("static-compile", args.prompt_len + 2 * args.new)}  # fmt: skip
    first = {mode: hf_generate(hf, prompt, args.new, **extra) for mode, extra in modes.items()}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode, extra in modes.items():
            seconds[mode].append(hf_generate(hf, prompt, args.new, **extra))
    return [summary("transformers generate (eager)", args.new, seconds["eager"]),
            summary("transformers generate (static cache + compile)", args.new, seconds["static-compile"],
                    first["static-compile"])]  # fmt: skip


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    from bench_forward import memory_bandwidth_gbs

    bandwidth = memory_bandwidth_gbs(256 if args.smoke else 1024)
    with tempfile.TemporaryDirectory() as tmp:
        hf, model = build(args.config, torch.float32, Path(tmp), "cpu")
    prompt = prompts(1, args.prompt_len, model.config.vocab_size, 1)
    start = time.perf_counter()  # the process's first call: builds the engine, compiles with cold caches
    ours = astrai.generate_ids(model, prompt, max_tokens=args.new, stop_token_ids=[])
    cold_s = time.perf_counter() - start
    rows = hf_rows(hf, prompt, args)
    rows += astrai_rows(model, prompt, args)
    rows[2].update(cold_first_call_s=cold_s)
    base = rows[0]["tok_s"]
    for row in rows:
        row["vs_hf"] = row["tok_s"] / base
        row["vs_hf_static_compile"] = row["tok_s"] / rows[1]["tok_s"]
    return dict(benchmark="bench_notebook", config=args.config, dtype="float32", threads=torch.get_num_threads(),
                machine=platform.processor() or platform.machine(), torch=torch.__version__,
                memory_read_gbs=bandwidth, prompt_len=args.prompt_len, new_tokens=args.new,
                repeats=args.repeats, tokens_checked=len(ours[0]), rows=rows)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny config, few tokens (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.prompt_len, args.new, args.repeats = "tiny", 8, 8, 3
    report = run(args)
    cols = [("path", ""), ("cold_first_call_s", ".1f"), ("first_call_s", ".2f"), ("tok_s", ".1f"),
            ("tok_s_min", ".1f"), ("tok_s_max", ".1f"), ("vs_hf", ".2f"), ("vs_hf_static_compile", ".2f"),
            ("size_up_call_s", ".2f")]  # fmt: skip
    console.print(table(f"single stream, {report['config']} fp32, {report['prompt_len']}-token prompt, "
                        f"{report['new_tokens']} new tokens, {report['threads']} threads (tok/s of whole calls, "
                        f"median of {report['repeats']})", report["rows"], cols))  # fmt: skip
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

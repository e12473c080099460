"""Two engine-step choices of issue 16 item 1, A/B in one process: fused projections, and guards on the parameters.

(a) **Fused projections** (`EngineConfig.fuse_projections`): two engines on the same weights, one serving q/k/v
    and gate/up fused, one the checkpoint layout. Each round submits R prompts of `--context` tokens to each
    engine in turn and records the median decode-step time once every row decodes; the same greedy tokens are
    checked. The path users take: `Engine` steps, compiled decode (as `astrai serve` runs it).
(b) **Per-call checks** (`step.SERVED_STEP_OPTIONS`): the compiled decode step called directly, three ways,
    alternating in blocks of 20 calls: with every Dynamo guard and inductor's size asserts (the default); without
    the guards on the `params` argument (`step.without_param_guards`); and as the engine compiles it, also
    without the wrapper's size/stride/alignment asserts. On the model, and on a narrow model of the same tree
    (`narrow_config`: same layers and leaves, so the same guards and asserts, with kernels that take ~nothing),
    which isolates the checks' cost from the box's noise. The logits must be identical.

Median of `--rounds` (min-max). Prints rich tables and the JSON report as the last stdout line, also written
to `--out`. `--smoke`: the tiny config, seconds (CI). On CUDA, (a) is `profile_step.py --fuse-projections
on/off` in `run_gpu_perf.sh` (kernels per step, CUDA graphs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch
from _common import console, emit, table

from astrai.configs.models import NAMED, tiny
from astrai.inference.cache import init_kv_cache, make_attn_meta
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.inference.step import SERVED_STEP_OPTIONS, compile_step, decode_step, without_param_guards
from astrai.io.model import Model
from astrai.models.config import ModelConfig
from astrai.models.decoder import init_params
from astrai.tree import cast

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_bench_step_layout.json"


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def narrow_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with its layers and head counts but 8-wide heads, a 128-wide MLP and a 512-token vocabulary: the same
    parameter tree (so the same guards and graph) where the kernels take next to no time, so (b) isolates the
    per-call cost of the guards from the box's noise."""
    heads = cfg.num_attention_heads
    return attrs.evolve(cfg, hidden_size=8 * heads, head_dim=8, intermediate_size=128, vocab_size=512)


def fused_ab(model: Model, rows: int, context: int, new: int, rounds: int) -> dict:
    """(a): median ms per decode step, fused vs apart, and whether both engines sampled the same tokens."""
    config = dict(background=False, max_running=max(rows, 2), prefix_cache=False)
    engines = {fused: Engine(model, EngineConfig(fuse_projections=fused, **config)) for fused in (False, True)}
    vocab = model.config.vocab_size
    prompts = [[(13 * i + 7 * j) % (vocab - 3) + 3 for j in range(context)] for i in range(rows)]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    times, tokens = {False: [], True: []}, {}
    for _ in range(rounds + 1):  # the first round compiles: not counted
        for fused, engine in engines.items():
            handles, stamps = [engine.submit(p, params) for p in prompts], []
            while engine.step():
                stamps.append(time.perf_counter())
            steps = [b - a for a, b in zip(stamps[rows:], stamps[rows + 1 :], strict=False)]  # decode steps only
            times[fused].append(1e3 * statistics.median(steps))
            tokens[fused] = [h.result().outputs[0].token_ids for h in handles]
    for engine in engines.values():
        engine.shutdown()
    apart, fused = (_spread(times[f][1:]) for f in (False, True))
    same = tokens[False] == tokens[True]
    return {"rows": rows, "context": context, "apart_ms": apart, "fused_ms": fused,
            "apart_over_fused": apart["median"] / fused["median"], "same_tokens": same}  # fmt: skip


def guards_ab(model: Model, context: int, rounds: int) -> dict:
    """(b): µs per compiled decode call (batch 1) with every check, without the guards on the parameters, and
    as the engine compiles it (no parameter guards, no wrapper asserts)."""
    cfg, params = model.config, model.params
    unguarded = {"guard_filter_fn": without_param_guards}
    steps = {
        "all": compile_step(decode_step, cfg=cfg),
        "unguarded": compile_step(decode_step, cfg=cfg, options=unguarded),
        "served": compile_step(decode_step, cfg=cfg, options=SERVED_STEP_OPTIONS),
    }
    page = 16
    pages = -(-(context + 1) // page)
    cache = init_kv_cache(cfg, pages + 1, page, dtype=model.dtype, device="cpu")
    meta = make_attn_meta([list(range(1, pages + 1))], [context], [1], page_size=page, device="cpu", decode=True,
                          rows=1, width=pages)  # fmt: skip
    tokens = torch.tensor([3])
    times, logits = {k: [] for k in steps}, {}
    with torch.inference_mode():
        for name, step in steps.items():  # compile and warm up
            for _ in range(3):
                logits[name] = step(params, tokens, meta, cache)
        for _ in range(rounds):
            for name, step in steps.items():
                start = time.perf_counter()
                for _ in range(20):
                    step(params, tokens, meta, cache)
                times[name].append(1e6 * (time.perf_counter() - start) / 20)
    guarded, unguarded, served = (_spread(times[k]) for k in ("all", "unguarded", "served"))
    identical = all(torch.equal(logits["all"], other) for other in logits.values())
    return {"context": context, "all_guards_us": guarded, "no_param_guards_us": unguarded, "served_us": served,
            "saved_us": guarded["median"] - unguarded["median"],
            "asserts_saved_us": unguarded["median"] - served["median"], "identical": identical}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="decoding requests in (a)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    parser.add_argument("--new", type=int, default=40, help="tokens each request decodes in (a)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], choices=["a", "b"])
    parser.add_argument("--smoke", action="store_true", help="tiny config, few steps (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.dtypes, args.rows, args.context, args.new, args.rounds = ["float32"], [2], 24, 6, 2
    cfg = tiny(vocab_size=97) if args.smoke else NAMED[args.config]()
    base = init_params(cfg, seed=0)
    fused_rows, guard_rows = [], []
    for dtype in args.dtypes:
        model = Model(config=cfg, params=cast(base, getattr(torch, dtype)), tokenizer=None, eos_token_ids=())
        if "a" not in args.skip:
            fused_rows += [
                {"dtype": dtype, **fused_ab(model, r, args.context, args.new, args.rounds)} for r in args.rows
            ]
        if "b" not in args.skip:
            guard_rows.append({"dtype": dtype, "model": "real", **guards_ab(model, args.context, args.rounds)})
    if "b" not in args.skip:  # the same tree (layers, leaves, guards) at a width where the kernels cost ~nothing
        narrow = Model(config=narrow_config(cfg), params=init_params(narrow_config(cfg), seed=0), tokenizer=None,
                       eos_token_ids=())  # fmt: skip
        guard_rows.append({"dtype": "float32", "model": "narrow", **guards_ab(narrow, args.context, 3 * args.rounds)})
    flat = [{**r, "apart": r["apart_ms"]["median"], "fused": r["fused_ms"]["median"]} for r in fused_rows]
    console.print(table(f"(a) decode step ms, {args.config}: q/k/v and gate/up apart vs fused (median of "
                        f"{args.rounds})", flat, [("dtype", "s"), ("rows", "d"), ("apart", ".2f"), ("fused", ".2f"),
                                                  ("apart_over_fused", ".3f"), ("same_tokens", "")]))  # fmt: skip
    flat = [{**r, "all": r["all_guards_us"]["median"], "unguarded": r["no_param_guards_us"]["median"],
             "served": r["served_us"]["median"]} for r in guard_rows]  # fmt: skip
    title = (f"(b) compiled decode call µs, batch 1: every check / no guards on the parameters / also no wrapper "
             f"asserts (the engine's) (median of {args.rounds}")  # fmt: skip
    columns = [("dtype", "s"), ("model", "s"), ("all", ".0f"), ("unguarded", ".0f"), ("served", ".0f"),
               ("saved_us", ".0f"), ("asserts_saved_us", ".0f"), ("identical", "")]  # fmt: skip
    console.print(table(title + " x 20 calls; narrow: 3x the rounds)", flat, columns))
    emit({"benchmark": "bench_step_layout", "config": "tiny" if args.smoke else args.config,
          "torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": args.rounds,
          "fused_projections": fused_rows, "param_guards": guard_rows}, args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

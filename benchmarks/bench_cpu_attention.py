"""CPU paged decode attention: the AVX-512 kernel vs the plain-torch reference it replaces, alone and in a step.

Isolated (per layer): one decode attention call of a model's shapes (SmolLM2-135M by default: 9 query heads over
3 KV heads of 64) for B requests of C tokens of context each, over a shuffled page table. Providers, in the same
process and interleaved round by round:
- `ref_eager`: `triton_kernels.decode_attention.decode_attention_ref` (page gather into fp32, mask, SDPA);
- `ref_compiled`: the same under `torch.compile`, what the engine's compiled CPU decode step ran before the kernel;
- `kernel`: `astrai.cpu_kernels.decode_attention`.
GB/s = the K/V bytes the request's context holds / the median time (min-max in the JSON).

`--mixed ROWS CONTEXT NEW` adds an eager mixed step (the engine's CPU prefill path) with the kernels on and off:
ROWS decoding requests of CONTEXT tokens beside a NEW-token prompt; the decoding rows take one kernel call per layer.

`--step-contexts C ...` adds what users get: bench_forward's batch-1 path (`torch.compile`d `decode_step`, greedy,
20 timed tokens after a C-token context) with the CPU kernels on and off: two graphs in one fresh process per
dtype and context, the second traced with the kernel library marked unavailable, timed in alternation for
`--rounds` rounds (median ms per token per round; the median of the rounds, all rounds in the JSON). At one row
only decode attention differs (the matvec kernel takes 2-8 rows). The roofline fraction counts the weights plus the
context's K/V bytes per token against the read bandwidth (best of 10 sums of 1 GiB); `weights_roofline_on` counts
the weights only, as bench_forward does.

Usage: python benchmarks/bench_cpu_attention.py [--dtypes bfloat16 float32] [--contexts 128 512 2048]
[--batch 1 8] [--step-contexts 512 2048 --rounds 6] [--mixed 64 256 16]. `--smoke` in seconds. Prints rich tables,
then the JSON report as the last stdout line.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import console, emit, table, timed
from bench_forward import build, decode_weight_bytes, memory_bandwidth_gbs

from astrai.configs.models import NAMED
from astrai.cpu_kernels import decode_attention as cpu_attention
from astrai.triton_kernels.decode_attention import decode_attention_ref

RESULTS = Path(__file__).parent / "results" / "bench_cpu_attention.json"
PROVIDERS = ("ref_eager", "ref_compiled", "kernel")
PAGE = 16


def _inputs(cfg, dtype: torch.dtype, batch: int, context: int):
    gen = torch.Generator().manual_seed(0)
    width = -(-context // PAGE)
    rows = (batch * width + 1) * PAGE
    k = torch.randn(rows, cfg.num_key_value_heads, cfg.head_dim, generator=gen).to(dtype)
    v = torch.randn(rows, cfg.num_key_value_heads, cfg.head_dim, generator=gen).to(dtype)
    table_ = (torch.randperm(batch * width, generator=gen) + 1).int().view(batch, width).contiguous()
    q = torch.randn(batch, cfg.num_attention_heads, cfg.head_dim, generator=gen).to(dtype)
    return q, k, v, table_, torch.full((batch,), context, dtype=torch.int32)


def run(args) -> dict:
    cfg = NAMED[args.config]()
    kw = dict(page_size=PAGE, scale=cfg.head_dim**-0.5)
    compiled = torch.compile(decode_attention_ref, dynamic=False)
    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for batch in args.batch:
            for context in args.contexts:
                inputs = _inputs(cfg, dtype, batch, context)
                calls = {name: functools.partial(fn, *inputs, **kw) for name, fn in
                         [("ref_eager", decode_attention_ref), ("ref_compiled", compiled),
                          ("kernel", cpu_attention.decode_attention)]}  # fmt: skip
                q, k = inputs[:2]
                if not cpu_attention.supports(q, k):
                    console.print(f"[yellow]no kernel: {cpu_attention.unavailable_reason(q, k)}")
                    calls.pop("kernel")
                reference = calls["ref_eager"]().float()
                times = {name: [] for name in calls}
                for name, fn in calls.items():
                    error = (fn().float() - reference).abs().max().item()  # warm-up (compiles), and agreement
                    assert error < (1e-4 if dtype == torch.float32 else 3e-2), f"{name} differs by {error}"
                for _ in range(args.repeats):  # interleaved: every provider sees the same load
                    for name, fn in calls.items():
                        times[name].append(timed(fn, 1)[0])
                kv_bytes = 2 * batch * context * cfg.num_key_value_heads * cfg.head_dim * k.element_size()
                row = {"dtype": dtype_name, "batch": batch, "context": context, "kv_bytes": kv_bytes}
                for name, ms in times.items():
                    row[f"{name}_us"] = statistics.median(ms) * 1e3
                    row[f"{name}_us_min_max"] = [min(ms) * 1e3, max(ms) * 1e3]
                    row[f"{name}_gbs"] = kv_bytes / (statistics.median(ms) * 1e-3) / 1e9
                if "kernel" in times:
                    row["speedup_vs_compiled"] = row["ref_compiled_us"] / row["kernel_us"]
                results.append(row)
                console.print(f"[dim]{dtype_name} B={batch} C={context}: " + ", ".join(
                    f"{n} {row[f'{n}_us']:.0f} us" for n in times))  # fmt: skip
    return dict(benchmark="bench_cpu_attention", config=args.config, threads=torch.get_num_threads(),
                machine=platform.processor() or platform.machine(), torch=torch.__version__,
                repeats=args.repeats, results=results)  # fmt: skip


def step_worker(dtype_name: str, context: int, config: str, rounds: int) -> dict:
    """One process: bench_forward's compiled batch-1 decode after `context` tokens, kernels on and off.

    Two compiled steps in one process: the first traced with the CPU kernels, the second with the library marked
    unavailable (`supports()` is read while tracing, so each graph keeps what it was traced with). Their timings
    alternate for `rounds` rounds (median ms per token of 20 steps each), so both see the same load.
    """
    from astrai.cpu_kernels import library
    from astrai.inference.cache import init_kv_cache, make_attn_meta
    from astrai.inference.step import compile_step, decode_step
    from astrai.ops.attention import pages_needed

    with tempfile.TemporaryDirectory(prefix="bench_cpu_attention_") as folder:  # ~270 MB; the model is in memory
        _, model = build(config, getattr(torch, dtype_name), Path(folder))
    cfg, steps = model.config, 24
    pages = [list(range(1, 1 + pages_needed(context + steps + 2, PAGE)))]
    cache = init_kv_cache(cfg, len(pages[0]) + 1, PAGE, dtype=model.dtype, device="cpu")
    metas = [make_attn_meta(pages, [context + i], [1], page_size=PAGE, device="cpu", decode=True)
             for i in range(steps)]  # fmt: skip
    token, loaded = torch.tensor([1]), library.load()
    steps_by_switch, kept = {}, loaded.reason
    for switch in ("on", "off"):
        loaded.reason = kept if switch == "on" else "switched off for the reference graph"
        steps_by_switch[switch] = compile_step(decode_step, cfg=cfg)
        for meta in metas[:3]:  # compiles
            steps_by_switch[switch](model.params, token, meta, cache)
    loaded.reason = kept
    runs: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for switch, step in steps_by_switch.items():
            times = []
            for meta in metas[4:]:
                start = time.perf_counter()
                step(model.params, token, meta, cache).argmax(-1)
                times.append(time.perf_counter() - start)
            runs[switch].append(statistics.median(times) * 1e3)
    # check what each graph runs: the decode attention kernel once per layer with the kernels on, never off
    kernels, calls = cpu_attention._kernels(), {}
    kernel = kernels.get(model.dtype)
    for switch, step in steps_by_switch.items():
        count: list[int] = []
        if kernel is not None:
            kernels[model.dtype] = lambda *a, count=count: count.append(1) or kernel(*a)
        step(model.params, token, metas[-1], cache)
        calls[switch] = len(count)
    if kernel is not None:
        kernels[model.dtype] = kernel
    element = model.params.embed_tokens.weight.element_size()
    kv = 2 * context * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element
    weights = decode_weight_bytes(model)
    return {"runs": runs, "bytes_per_token": weights + kv, "weight_bytes": weights, "kernel_calls": calls}


def run_steps(args, bandwidth: float) -> list[dict]:
    """Kernels on/off in bench_forward's decode path: one fresh process per dtype and context."""
    out = []
    for dtype_name in args.dtypes:
        for context in args.step_contexts:
            proc = subprocess.run(
                [sys.executable, __file__, "--step-worker", dtype_name, str(context), "--config", args.config,
                 "--rounds", str(args.rounds)], capture_output=True, text=True, timeout=900, check=True,
            )  # fmt: skip
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            runs = report["runs"]
            on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
            row = {"dtype": dtype_name, "context": context, "on_ms": on, "off_ms": off, "speedup": off / on,
                   "on_runs_ms": runs["on"], "off_runs_ms": runs["off"], "on_tok_s": 1e3 / on,
                   "kernel_calls_per_step": report["kernel_calls"],
                   "roofline_on": report["bytes_per_token"] / (on * 1e-3) / (bandwidth * 1e9),
                   "roofline_off": report["bytes_per_token"] / (off * 1e-3) / (bandwidth * 1e9),
                   "weights_roofline_on": report["weight_bytes"] / (on * 1e-3) / (bandwidth * 1e9)}  # fmt: skip
            out.append(row)
            console.print(f"[dim]{dtype_name} context {context}: {on:.1f} ms on, {off:.1f} off")
    return out


def run_mixed(args) -> list[dict]:
    """`--mixed ROWS CONTEXT NEW`: one eager mixed step (the engine's CPU prefill path: ROWS decoding requests of
    CONTEXT tokens beside one NEW-token prompt), kernels on and off, alternating for `--rounds` rounds. With the
    kernels on, the decoding rows take one kernel call per layer; off, the reference gathers their pages."""
    from astrai.cpu_kernels import library
    from astrai.inference.cache import init_kv_cache, make_attn_meta
    from astrai.inference.step import prefill_step
    from astrai.ops.attention import pages_needed

    rows, context, new = args.mixed
    out, loaded = [], library.load()
    for dtype_name in args.dtypes:
        with tempfile.TemporaryDirectory(prefix="bench_cpu_attention_") as folder:
            _, model = build(args.config, getattr(torch, dtype_name), Path(folder))
        per, own = pages_needed(context + 1, PAGE), pages_needed(new, PAGE)
        pages = [list(range(1 + r * per, 1 + (r + 1) * per)) for r in range(rows)]
        pages.append(list(range(1 + rows * per, 1 + rows * per + own)))
        cache = init_kv_cache(model.config, rows * per + own + 1, PAGE, dtype=model.dtype, device="cpu")
        meta = make_attn_meta(pages, [context] * rows + [0], [1] * rows + [new], page_size=PAGE, device="cpu")
        tokens, last = torch.randint(0, model.config.vocab_size, (rows + new,)), torch.arange(rows + 1)
        step = functools.partial(prefill_step, model.params, tokens, meta, cache, last, cfg=model.config)
        kept, runs, logits = loaded.reason, {"on": [], "off": []}, {}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for switch in ("on", "off"):
                loaded.reason = kept if switch == "on" else "switched off for the reference"
                start = time.perf_counter()
                logits[switch] = step()
                if round_:
                    runs[switch].append((time.perf_counter() - start) * 1e3)
        loaded.reason = kept
        on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
        diff = (logits["on"].float() - logits["off"].float()).abs().max().item()
        out.append({"dtype": dtype_name, "rows": rows, "context": context, "new": new, "on_ms": on, "off_ms": off,
                    "speedup": off / on, "on_runs_ms": runs["on"], "off_runs_ms": runs["off"],
                    "max_logit_diff": diff})  # fmt: skip
        console.print(f"[dim]{dtype_name} mixed step: {on:.0f} ms on, {off:.0f} off")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny config, fp32, one shape (seconds)")
    parser.add_argument("--step-contexts", type=int, nargs="*", default=[], help="decode steps, kernels on vs off")
    parser.add_argument("--rounds", type=int, default=6, help="alternating on/off rounds per --step-contexts entry")
    parser.add_argument("--mixed", type=int, nargs=3, metavar=("ROWS", "CONTEXT", "NEW"),
                        help="an eager mixed step, kernels on vs off (e.g. 64 256 16)")  # fmt: skip
    parser.add_argument("--step-worker", nargs=2, metavar=("DTYPE", "CONTEXT"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    if args.step_worker:
        print(json.dumps(step_worker(args.step_worker[0], int(args.step_worker[1]), args.config, args.rounds)))
        return 0
    if args.smoke:
        args.config, args.dtypes, args.contexts, args.batch, args.repeats = "tiny", ["float32"], [300], [2], 3
        args.mixed, args.rounds = args.mixed or [3, 40, 8], 1
    report = run(args)
    report["read_bandwidth_gbs"] = bandwidth = memory_bandwidth_gbs(256 if args.smoke else 1024)
    cols = [("dtype", ""), ("batch", ""), ("context", "")] + [(f"{n}_us", ".0f") for n in PROVIDERS] + [
        ("kernel_gbs", ".1f"), ("speedup_vs_compiled", ".2f")]  # fmt: skip
    console.print(table(f"one decode attention call, {report['config']} shapes, {report['threads']} threads: us "
                        f"(median of {args.repeats} interleaved), GB/s of K/V", report["results"], cols))  # fmt: skip
    if args.step_contexts:
        report["steps"] = run_steps(args, bandwidth)
        console.print(table(f"compiled batch-1 decode of {report['config']}, ms per token, CPU kernels on vs off "
                            f"(median of {args.rounds} alternating rounds); read bandwidth {bandwidth:.1f} GB/s",
                            report["steps"], [("dtype", ""), ("context", ""), ("on_ms", ".1f"), ("off_ms", ".1f"),
                            ("speedup", ".2f"), ("on_tok_s", ".1f"), ("roofline_on", ".0%"),
                            ("roofline_off", ".0%"), ("weights_roofline_on", ".0%")]))  # fmt: skip
    if args.mixed:
        report["mixed"] = run_mixed(args)
        console.print(table(f"eager mixed step of {report['config']}, ms, CPU kernels on vs off (median of "
                            f"{args.rounds} alternating rounds)", report["mixed"], [("dtype", ""), ("rows", ""),
                            ("context", ""), ("new", ""), ("on_ms", ".0f"), ("off_ms", ".0f"), ("speedup", ".2f"),
                            ("max_logit_diff", ".1e")]))  # fmt: skip
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

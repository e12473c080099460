"""Multi-LoRA serving (issue 44): batches over 1, 4 and 8 adapters vs the base model, a plain engine, merged models.

The naive path: one engine per adapter serving its merged weights, one adapter at a time.

Method. A random SmolLM2-135M-shaped model (`bench_serve.build_model`, fp32) and `--adapters` (default 8) random
PEFT adapters of rank `--rank` on all linears (alpha `--alpha`; `init_lora`'s A and a random non-zero B, so each
adapter changes the output), saved with `save_lora` and loaded with `Engine.load_lora`. Engines, each compiled
(`compile=True`), stepping on the benchmark's thread (`background=False`), built and warmed by one untimed run of
every arm (which compiles the steps the timed runs use; `--warm-up` also runs `runner.warm_up()`, every decode
size) before any timing; `timed_compiles` counts graphs Dynamo compiled during the timed rounds:
- **lora**: one engine with `enable_lora=True, max_loras=--adapters, max_lora_rank=--rank`. Its arms send the
  same `--requests` (16) concurrent requests (`--prompt`-token prompts, `--new` tokens each, greedy, ignore_eos)
  with no adapter (`base`) and spread round-robin over 1, 4 and 8 distinct adapters (`lora1`, `lora4`, `lora8`).
- **plain**: an engine without `enable_lora`, same requests, no adapter: what enabling LoRA costs base traffic.
- **naive**: one engine per adapter serving `merge_lora`'s merged weights, requests one adapter at a time
  (adapter 1's requests/adapters requests, then adapter 2's, ...): serving each adapter in its own process, or
  swapping merged weights between batches. Engine builds are not counted.
Every arm runs once per round, in an order rotated by one each round, each run with prompts of its own (so no arm
hits the prefix cache of another); `--rounds` rounds, each rate as the median with min-max, and the ratios
(lora_k / base, base / plain, lora8 / naive) taken round by round. The read bandwidth (sum of a 1 GiB tensor,
`bench_forward.memory_bandwidth_gbs`) is probed at the start of each round. Output tok/s counts generated tokens
over the wall time of the whole `generate` call (prefill included).

Goals (issue 44, 2-core CPU): lora8 >= 0.70x base, lora8 >= 3x naive. `--profile N` also profiles N decode steps
of the base and lora8 batches (`torch.profiler`, top CPU ops by self time). Prints rich tables and the JSON
report as the last stdout line. `--smoke`: a tiny model, eager, a few tokens, 1 round (seconds).
Usage: python benchmarks/bench_lora.py [--requests 16] [--prompt 128] [--new 128] [--rounds 5] [--adapters 8]
       [--mixes 1 4 8] [--rank 16] [--alpha 32] [--profile N] [--warm-up] [--eager] [--out PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "bench_lora.json"
GOALS = {"lora8_vs_base": 0.70, "lora8_vs_naive": 3.0}


def make_adapters(model, count: int, rank: int, alpha: float, folder: Path) -> dict[str, tuple[dict, str]]:
    """`count` random all-linear adapters: name -> (adapter tree, PEFT folder)."""
    import torch

    from astrai.io.lora import save_lora
    from astrai.nn.lora import LoRAAdapter, LoRAConfig, init_lora

    cfg = LoRAConfig(r=rank, alpha=alpha, targets="all-linear")
    out = {}
    for i in range(count):
        g = torch.Generator().manual_seed(100 + i)
        lora = {p: LoRAAdapter(ad.lora_a, torch.randn(ad.lora_b.shape, generator=g) * 0.02, ad.scaling)
                for p, ad in init_lora(model.params, cfg, seed=100 + i).items()}  # fmt: skip
        out[f"adapter{i}"] = (lora, str(save_lora(lora, cfg, folder / f"adapter{i}")))
    return out


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def timed_generate(runs: list[tuple]) -> tuple[float, int]:
    """Wall seconds and generated tokens of `engine.generate(prompts, params, lora=names)` for each
    (engine, prompts, params, names) of `runs`, one after the other."""
    start, tokens = time.perf_counter(), 0
    for engine, batch, params, names in runs:
        outs = engine.generate(batch, params, lora=names)
        tokens += sum(len(o.token_ids) for c in outs for o in c.outputs)
    return time.perf_counter() - start, tokens


def build_engines(model, adapters: dict, args) -> dict:
    """The lora engine (adapters loaded), the plain engine and one merged-weight engine per adapter, warmed up."""
    import attrs
    from _common import console

    from astrai.inference.engine import Engine, EngineConfig
    from astrai.nn.lora import merge_lora

    per_seq = args.prompt + args.new + 16
    common = dict(compile=not args.eager, background=False, max_running=max(args.requests, 4), max_model_len=per_seq)

    def kv(n: int) -> int:  # room for two batches (the radix cache keeps finished requests' pages)
        return max(2 * n * per_seq, 1024)

    engines, seconds = {}, {}
    start = time.perf_counter()
    engines["lora"] = Engine(model, EngineConfig(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                                                 kv_budget_tokens=kv(args.requests), **common))  # fmt: skip
    for name, (_, folder) in adapters.items():
        engines["lora"].load_lora(name, folder)
    engines["plain"] = Engine(model, EngineConfig(kv_budget_tokens=kv(args.requests), **common))
    per_adapter = max(args.requests // len(adapters), 1)
    naive = dict(common, max_running=per_adapter)  # an engine per adapter: that adapter's requests only
    for name, (lora, _) in adapters.items():
        merged = attrs.evolve(model, params=merge_lora(model.params, lora))
        engines[f"naive/{name}"] = Engine(merged, EngineConfig(kv_budget_tokens=kv(per_adapter), **naive))
    seconds["build"] = time.perf_counter() - start
    for key, engine in engines.items() if args.warm_up else ():
        start = time.perf_counter()
        engine.runner.warm_up()
        seconds[f"warm_up {key}"] = time.perf_counter() - start
        console.print(f"[dim]warmed {key} in {seconds[f'warm_up {key}']:.0f} s[/]")
    return engines, seconds


def arm_runs(arm: str, engines: dict, names: list[str], args, params, seed: int) -> list[tuple]:
    """The `generate` calls of one arm's run on fresh prompts seeded by `seed`."""
    vocab = engines["plain"].model.config.vocab_size
    batch = prompts(args.requests, args.prompt, vocab, seed)
    if arm == "plain":
        return [(engines["plain"], batch, params, None)]
    if arm == "base":
        return [(engines["lora"], batch, params, None)]
    if arm.startswith("lora"):
        k = int(arm[4:])
        return [(engines["lora"], batch, params, [names[i % k] for i in range(len(batch))])]
    per = max(len(batch) // len(names), 1)  # naive: adapter j's requests on its merged engine, one adapter at a time
    return [(engines[f"naive/{name}"], batch[j * per : (j + 1) * per], params, None) for j, name in enumerate(names)]


def profile_steps(engine, batch: list, params, names, steps: int, top: int = 12) -> dict:
    """`torch.profiler` over `steps` decode steps of `batch` (after its prefill): ms per step and top CPU ops."""
    import torch.profiler

    handles = [engine.submit(p, params, lora=None if names is None else names[i]) for i, p in enumerate(batch)]
    for _ in range(3):  # the prefill (one step of up to max_step_tokens) and two decode steps
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    while engine.step():
        pass
    for handle in handles:
        handle.result()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    ops = [dict(op=e.key, calls=e.count / steps, self_ms=e.self_cpu_time_total / 1e3 / steps) for e in events]
    return dict(ms_per_step=1e3 * wall / steps, ops=ops)


def run(args: argparse.Namespace) -> dict:
    import torch
    from _common import console
    from bench_forward import memory_bandwidth_gbs
    from bench_serve import build_model
    from bench_throughput import counted_graphs

    from astrai.inference.params import SamplingParams

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args.config, args.vocab)
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    arms = ["base", *(f"lora{k}" for k in args.mixes), "plain", "naive"]
    report = dict(benchmark="bench_lora", date=datetime.date.today().isoformat(), config=args.config,
                  dtype="float32", threads=args.threads, cpu=_cpu_name(),
                  cores=os.cpu_count(), torch=torch.__version__, requests=args.requests, prompt_tokens=args.prompt,
                  new_tokens=args.new, rounds=args.rounds, adapters=args.adapters, rank=args.rank, alpha=args.alpha,
                  targets="all-linear", compile=not args.eager, arms=arms, goals=GOALS,
                  weight_bytes=sum(t.numel() * t.element_size()
                                   for t in torch.utils._pytree.tree_leaves(model.params)))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model, args.adapters, args.rank, args.alpha, Path(tmp))
        names = list(adapters)
        console.print(f"[dim]building {len(adapters) + 2} engines...[/]")
        engines, report["engine_seconds"] = build_engines(model, adapters, args)
        slots = _slots(engines["lora"])
        report["lora_slot_bytes"] = sum(t.numel() * t.element_size() for lin in slots for t in (lin.lora_a, lin.lora_b))
        try:
            console.print(f"[dim]engines built in {report['engine_seconds']['build']:.0f} s; one untimed run of "
                          "every arm (compiles the steps it runs)...[/]")  # fmt: skip
            for i, arm in enumerate(arms):
                start = time.perf_counter()
                timed_generate(arm_runs(arm, engines, names, args, params, seed=900 + i))
                report["engine_seconds"][f"untimed {arm}"] = time.perf_counter() - start
                console.print(f"[dim]untimed {arm}: {time.perf_counter() - start:.0f} s[/]")
            graphs = counted_graphs()
            rates: dict[str, list[float]] = {arm: [] for arm in arms}
            bandwidths = []
            for r in range(args.rounds):
                bandwidths.append(memory_bandwidth_gbs(1024, 3))
                order = arms[r % len(arms) :] + arms[: r % len(arms)]
                for arm in order:
                    seconds, tokens = timed_generate(arm_runs(arm, engines, names, args, params,
                                                              seed=1000 * (r + 1) + arms.index(arm)))  # fmt: skip
                    rates[arm].append(tokens / seconds)
                console.print(f"[dim]round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{a} {rates[a][-1]:.1f}" for a in arms) + f" tok/s; {bandwidths[-1]:.1f} GB/s[/]")  # fmt: skip
            report["timed_compiles"] = counted_graphs() - graphs  # graphs Dynamo compiled in the timed rounds
            report["lora_stats"] = dict(loaded=engines["lora"].stats().lora_loaded)
            if args.profile:
                batch = prompts(args.requests, args.prompt, model.config.vocab_size, 77)
                k = max(args.mixes)
                report["profile"] = {
                    "base": profile_steps(engines["lora"], batch, params, None, args.profile),
                    f"lora{k}": profile_steps(engines["lora"], batch, params,
                                              [names[i % k] for i in range(len(batch))], args.profile),
                    "plain": profile_steps(engines["plain"], batch, params, None, args.profile)}  # fmt: skip
        finally:
            for engine in engines.values():
                engine.shutdown()
    report["bandwidth_gbs"] = dict(median=statistics.median(bandwidths), min=min(bandwidths), max=max(bandwidths))
    report["loadavg_end"] = os.getloadavg()
    report["results"] = [_spread(dict(arm=arm), "tok_s", rates[arm]) for arm in arms]
    ratios = {f"lora{k}_vs_base": (f"lora{k}", "base") for k in args.mixes}
    ratios |= {"base_vs_plain": ("base", "plain"), "lora8_vs_naive": (f"lora{max(args.mixes)}", "naive")}
    report["ratios"] = [_spread(dict(ratio=key, of=f"{num} / {den}", goal=GOALS.get(key)), "value",
                                [a / b for a, b in zip(rates[num], rates[den], strict=True)])
                        for key, (num, den) in ratios.items()]  # fmt: skip
    for row in report["ratios"]:
        row["met"] = None if row["goal"] is None else row["value"] >= row["goal"]
    return report


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _slots(engine) -> list:
    from astrai.nn.lora_slots import slot_linears

    return list(slot_linears(engine.runner.model.params).values())


def _spread(row: dict, key: str, values: list[float]) -> dict:
    return dict(row, **{key: statistics.median(values), "min": min(values), "max": max(values), "runs": values})


def show(report: dict) -> None:
    from _common import console, table

    what = {"base": "lora engine, no adapter", "plain": "engine without enable_lora, no adapter",
            "naive": f"{report['adapters']} merged-weight engines, one adapter at a time"}  # fmt: skip
    rows = [dict(r, path=what.get(r["arm"], f"lora engine, {r['arm'][4:]} distinct adapters"))
            for r in report["results"]]  # fmt: skip
    r = report
    console.print(table(f"{r['requests']} requests, {r['prompt_tokens']}-token prompts, {r['new_tokens']} new tokens, "
                        f"r={r['rank']} all-linear adapters, {r['config']} fp32, {r['threads']} threads: output "
                        f"tok/s, median (min-max) of {r['rounds']} rounds", rows,
                        [("arm", ""), ("path", ""), ("tok_s", ".1f"), ("min", ".1f"), ("max", ".1f")]))  # fmt: skip
    console.print(table("ratios, round by round: median (min-max)", report["ratios"],
                        [("ratio", ""), ("of", ""), ("value", ".3f"), ("min", ".3f"), ("max", ".3f"), ("goal", ".2f"),
                         ("met", "")]))  # fmt: skip
    bw = report["bandwidth_gbs"]
    console.print(f"read bandwidth {bw['median']:.1f} GB/s ({bw['min']:.1f}-{bw['max']:.1f}); weights "
                  f"{report['weight_bytes'] / 2**20:.0f} MiB, adapter slots "
                  f"{report['lora_slot_bytes'] / 2**20:.0f} MiB; engine builds {report['engine_seconds']['build']:.0f} "
                  f"s (not counted); graphs compiled in the timed rounds: {report['timed_compiles']}")  # fmt: skip
    for arm, prof in report.get("profile", {}).items():
        console.print(table(f"profile: {arm}, one decode step of {report['requests']} rows, "
                            f"{prof['ms_per_step']:.1f} ms (under the profiler)", prof["ops"],
                            [("op", ""), ("calls", ".1f"), ("self_ms", ".2f")]))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    parser.add_argument("--config", default="smollm2-135m", help="named model shape (random weights)")
    parser.add_argument("--vocab", type=int, default=512, help="tokenizer size of the random model")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests per arm and round")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=128, help="new tokens per request (greedy, ignore_eos)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds; every arm runs once per round")
    parser.add_argument("--adapters", type=int, default=8, help="adapters loaded (= max_loras, = naive engines)")
    parser.add_argument("--mixes", type=int, nargs="+", default=[1, 4, 8], help="distinct adapters per batch")
    parser.add_argument("--rank", type=int, default=16, help="adapter rank (= max_lora_rank)")
    parser.add_argument("--alpha", type=float, default=32.0, help="adapter lora_alpha")
    parser.add_argument("--eager", action="store_true", help="engines without torch.compile")
    parser.add_argument("--warm-up", action="store_true",
                        help="also run runner.warm_up() on every engine (compiles every decode size; the untimed "
                        "run already compiles the sizes timed)")  # fmt: skip
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N decode steps of the base, largest-mix and plain batches")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny model, eager, 8 requests, few tokens, 1 round")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON report")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.vocab, args.requests, args.prompt, args.new, args.rounds = "tiny", 300, 8, 8, 4, 1
        args.eager, args.profile = True, min(args.profile, 2)
    if max(args.mixes) > args.adapters:
        parser.error(f"--mixes {max(args.mixes)} needs --adapters >= {max(args.mixes)}")
    from _common import emit

    report = run(args)
    show(report)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine throughput and latency vs transformers on the same random weights (SmolLM2-135M-shaped; CPU or CUDA).

Sections (one run, side by side):
  (a) single stream: batch-1 greedy decode tok/s, engine (compiled decode) vs transformers eager (DynamicCache)
      and transformers' fastest path (static cache + `torch.compile`), each warmed up, then `--repeats` rounds
      as in (b), reported as the median with min-max (ratios round by round); roofline fraction.
  (b) N requests of P-token prompts and G new tokens: engine throughput (all submitted at once) vs transformers'
      padded-batch `generate` and vs transformers one by one (the first `--one-by-one` requests in turn), each
      through eager (DynamicCache) and, but under --smoke, static cache + `torch.compile` (warmed untimed at the
      exact timed shapes; its greedy tokens checked against eager's on the same prompts, as are the engine's).
      `--repeats` rounds, each running every path once in a rotated order (other prompts per engine run, so the
      radix cache gains nothing); each rate and each ratio (taken round by round) as the median with min-max.
  (c) 16 requests sharing an S-token system prompt: prefill tokens computed and wall time, radix on vs off,
      cold (nothing cached: the batch's first prefill computes the system prompt) and warm (a second batch
      with the system prompt already cached).
  (d) TTFT and inter-token latency p50/p99 of the engine's streams in (b).
  (e) CUDA only: the engine's decode with and without CUDA graphs ((a) and (b) again with `cuda_graphs=False`).
  (f) `--overlap`: the engine with the overlap schedule on vs off, batch 1 and each N of (b), alternating.
  (g) `--staggered`: the largest N of (b) arriving one every `--arrive-every` steps (mixed steps); on CPU the
      decoding rows of those steps through the decode attention kernel vs the reference, alternating.
The engine steps on the benchmark's thread (`EngineConfig(background=False)`, the offline mode); see
docs/inference.md for why a background engine thread is slower on a 2-core CPU.
The machine (bench_throughput's probe: read/copy GB/s, matmul GFLOP/s; and the load average) is recorded at the start
and the end. Prints rich tables and the JSON report as the last stdout line. `--smoke` runs a tiny config in seconds;
`--skip a b c` leaves sections out (`--overlap --skip a b c` runs (f) alone).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import console, device_peaks, emit, hf_generate_kwargs, table

import astrai
from astrai.configs.models import NAMED
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.io.hf import config_to_hf

RESULTS = Path(__file__).resolve().parent / "results" / "bench_engine.json"


def build(name: str, dtype: torch.dtype, folder: Path, device: str):
    """A random transformers model of the named config and the same weights loaded by astrai."""
    import transformers

    config = transformers.AutoConfig.for_model(**config_to_hf(NAMED[name]()))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)
    hf.save_pretrained(folder)
    return hf.to(device), astrai.load(folder, dtype=dtype, device=device)


def prompts(n: int, length: int, vocab: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(1, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def hf_generate(hf, batch: list[list[int]], new: int, **extra) -> float:
    """Seconds for transformers' greedy generate of a left-padded batch (exactly `new` tokens each); `extra`:
    more `generate` keywords (`_common.hf_generate_kwargs`)."""
    return hf_generate_ids(hf, batch, new, **extra)[0]


def hf_generate_ids(hf, batch: list[list[int]], new: int, **extra) -> tuple[float, torch.Tensor]:
    """`hf_generate`'s seconds and the generated ids, (rows, new), for checking one path against another."""
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=hf.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, **extra)  # fmt: skip
    if hf.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out[:, width:].cpu()


def engine_run(engine: Engine, batch: list[list[int]], new: int, params: list[SamplingParams] | None = None,
               arrive_every: int = 0) -> dict:  # fmt: skip
    """Submit all at once and step the engine on this thread; wall time, TTFT and inter-token latencies.

    Default: greedy, exactly `new` tokens each; `params` (one per prompt) replaces that, and tok_s then counts the
    tokens actually generated (`completions` holds the results). `arrive_every` > 0 submits one prompt every that
    many engine steps instead (staggered arrivals: steps that prefill a prompt while the others decode); TTFT then
    counts from each request's own submission."""
    params = params or [SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)] * len(batch)
    ttft, itl, start = [], [], time.perf_counter()
    queue, handles, submitted = list(zip(batch, params, strict=True)), [], []

    def submit() -> None:
        handles.append(engine.submit(*queue.pop(0)))
        submitted.append(time.perf_counter())

    while queue and not arrive_every:
        submit()
    last: dict[int, float] = {}
    steps = 0
    while True:
        if queue and steps % arrive_every == 0:  # staggered: one arrival every `arrive_every` steps
            submit()
        busy = engine.step()
        steps, now = steps + 1, time.perf_counter()
        for i, handle in enumerate(handles):
            for _ in handle.poll():
                (ttft.append(now - submitted[i]) if i not in last else itl.append(now - last[i]))
                last[i] = now
        if not busy and not queue:
            break
    for handle in handles:
        handle.poll()
        assert handle.completion is not None
    wall = time.perf_counter() - start
    completions = [h.completion for h in handles]
    tokens = sum(len(o.token_ids) for c in completions for o in c.outputs)
    return dict(wall_s=wall, tok_s=tokens / wall, tokens=tokens, ttft=ttft, itl=itl, completions=completions,
                steps=steps)  # fmt: skip


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else 0.0)


def single_decode_tok_s(engine: Engine, model, args) -> float:
    """Batch-1 decode tok/s of the engine (inter-token time only)."""
    run = engine_run(engine, prompts(1, 32, model.config.vocab_size, 1), args.new)
    return (args.new - 1) / sum(run["itl"])


def rounds(providers: dict[str, Callable[[int], float]], repeats: int) -> dict[str, list[float]]:
    """Each provider's rate in each of `repeats` rounds. A round runs every provider once, in an order rotated by
    one each round, so a shared machine's load falls on all of them alike and none always runs first."""
    keys, rates = list(providers), {key: [] for key in providers}
    for r in range(repeats):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            rates[key].append(providers[key](r))
    return rates


def spreads(out: dict, rates: dict[str, list[float]], ratios: dict[str, tuple[str, str]]) -> dict:
    """Into `out`: each rate's median, `_min` and `_max` under its key, and each ratio `key: (num, den)` taken
    round by round (both sides of one round ran minutes apart at most), as the median with its min and max."""
    series = dict(rates)
    for key, (num, den) in ratios.items():
        series[key] = [a / b for a, b in zip(rates[num], rates[den], strict=True)]
    for key, values in series.items():
        out[key], out[f"{key}_min"], out[f"{key}_max"] = statistics.median(values), min(values), max(values)
    return out


def agreement(ids: torch.Tensor, ref: torch.Tensor) -> dict:
    """How two greedy generations of the same prompts ((rows, new) token ids) agree: identical rows, and each row's
    common prefix. On random weights near-tied logits flip an argmax now and then, after which the rows diverge
    for good, so a correct path shows long common prefixes and a broken one diverges at once."""
    prefix = (ids == ref).int().cumprod(1).sum(1)
    return dict(rows=ids.shape[0], new_tokens=ids.shape[1], identical_rows=int((prefix == ids.shape[1]).sum()),
                prefix_mean=float(prefix.float().mean()), prefix_min=int(prefix.min()))  # fmt: skip


def hf_modes(args) -> tuple[str, ...]:
    """transformers' paths timed: eager (DynamicCache) and, but under --smoke (its compiles take a minute on 2
    cores), its fastest (static cache + `torch.compile`)."""
    return ("eager",) if args.smoke else ("eager", "static-compile")


def section_single(hf, engine: Engine, model, args) -> dict:
    prompt = prompts(1, 32, model.config.vocab_size, 1)
    baselines = {mode: hf_generate_kwargs(mode, 32 + args.new) for mode in ("eager", "static-compile")}

    def hf_tok_s(extra: dict) -> float:  # decode only: `new` tokens minus the prefill and first token
        return (args.new - 1) / (hf_generate(hf, prompt, args.new, **extra) - hf_generate(hf, prompt, 1, **extra))

    for extra in baselines.values():  # warm up outside the timing (CUDA context, cuBLAS, the static compile)
        hf_tok_s(extra)
    providers = {"engine_tok_s": lambda r: single_decode_tok_s(engine, model, args),
                 "hf_tok_s": lambda r: hf_tok_s(baselines["eager"]),
                 "hf_static_compile_tok_s": lambda r: hf_tok_s(baselines["static-compile"])}  # fmt: skip
    out = spreads({}, rounds(providers, args.repeats),
                  {"speedup": ("engine_tok_s", "hf_tok_s"),
                   "speedup_vs_static_compile": ("engine_tok_s", "hf_static_compile_tok_s")})  # fmt: skip
    weight_bytes = model.nbytes - (0 if model.params.lm_head is None else model.params.embed_tokens.weight.nbytes)
    return dict(out, roofline=weight_bytes * out["engine_tok_s"] / (args.bandwidth * 1e9), repeats=args.repeats)


def warm_batch(engine: Engine, model, n: int, args) -> None:
    """On CUDA, one untimed run of the same shapes (other prompts, so the radix gains nothing): Triton JIT
    specialisations and cuBLAS heuristics of the mixed prefill steps are set up before the timed run."""
    if args.device == "cuda":
        engine_run(engine, prompts(n, args.prompt_len, model.config.vocab_size, 1000 + n), args.new)


def section_batch(hf, engine: Engine, model, n: int, args) -> dict:
    """(b), (d) for N requests. Providers, one run each per round (`rounds`): the engine (all N submitted at
    once; other prompts each round, so its radix gains nothing), transformers' padded batch of the N and
    transformers one by one (the first `--one-by-one` of them in turn, tok/s over their total time), each
    through each of `hf_modes`. Every transformers path first runs untimed at its exact timed shapes (the N
    padded, one request; the same cache length), which is where the static path compiles; the compiled path's
    greedy tokens are checked against eager's on the same prompts, and the engine's first run (the same
    prompts) against eager's too. `timed_compiles` counts graphs Dynamo compiled during the timed rounds."""
    from bench_throughput import counted_graphs

    vocab, one, modes = model.config.vocab_size, min(args.one_by_one, n), hf_modes(args)
    batch = prompts(n, args.prompt_len, vocab, n)
    extra = {mode: hf_generate_kwargs(mode, args.prompt_len + args.new) for mode in modes}
    warm_batch(engine, model, n, args)
    ids = {}
    for mode in modes:
        ids[mode] = hf_generate_ids(hf, batch, args.new, **extra[mode])[1]
        hf_generate(hf, batch[:1], args.new, **extra[mode])
    runs: list[dict] = []

    def engine_tok_s(r: int) -> float:
        runs.append(engine_run(engine, prompts(n, args.prompt_len, vocab, n + 7919 * r), args.new))
        return runs[-1]["tok_s"]

    def padded(mode: str) -> Callable[[int], float]:
        return lambda r: n * args.new / hf_generate(hf, batch, args.new, **extra[mode])

    def one_by_one(mode: str) -> Callable[[int], float]:
        return lambda r: one * args.new / sum(hf_generate(hf, [p], args.new, **extra[mode]) for p in batch[:one])

    names = {"eager": "", "static-compile": "_static_compile"}
    providers = {"engine_tok_s": engine_tok_s}
    for mode in modes:
        providers[f"hf_padded{names[mode]}_tok_s"] = padded(mode)
        providers[f"hf_one_by_one{names[mode]}_tok_s"] = one_by_one(mode)
    graphs = counted_graphs()
    rates = rounds(providers, args.repeats)
    out = dict(requests=n, repeats=args.repeats, one_by_one_requests=one, timed_compiles=counted_graphs() - graphs)
    spreads(out, rates, {f"vs_{key[3:-6]}": ("engine_tok_s", key) for key in providers if key != "engine_tok_s"})
    engine_ids = torch.tensor([list(c.outputs[0].token_ids) for c in runs[0]["completions"]])  # round 0: `batch`
    out["check"] = {"engine vs eager": agreement(engine_ids, ids["eager"])}
    if "static-compile" in ids:
        out["check"]["static-compile vs eager"] = agreement(ids["static-compile"], ids["eager"])
    run = min(runs, key=lambda r: abs(r["tok_s"] - out["engine_tok_s"]))  # the median run's latencies
    return dict(out, ttft_p50=pct(run["ttft"], 50), ttft_p99=pct(run["ttft"], 99), itl_p50=pct(run["itl"], 50),
                itl_p99=pct(run["itl"], 99))  # fmt: skip


def section_prefix(model, args, make_engine) -> dict:
    """(c): cold, the first batch meets an empty cache; warm, a second batch (other tails) finds the system
    prompt cached by the first. The warm-up request shares nothing with them."""
    vocab = model.config.vocab_size
    system = prompts(1, args.system_len, vocab, 7)[0]
    batches = {"cold": prompts(16, 16, vocab, 8, prefix=system), "warm": prompts(16, 16, vocab, 9, prefix=system)}
    out = {phase: {} for phase in batches}
    for radix in (True, False):
        with make_engine(prefix_cache=radix) as engine:
            engine_run(engine, prompts(1, args.system_len + 16, vocab, 6), 2)  # the same shapes, another prompt
            for phase, batch in batches.items():
                before = engine.stats().prompt_tokens
                run = engine_run(engine, batch, args.prefix_new)
                out[phase]["on" if radix else "off"] = dict(prefill_tokens=engine.stats().prompt_tokens - before,
                                                            wall_s=run["wall_s"])  # fmt: skip
    for phase in out.values():
        phase["fewer_prefill_tokens"] = phase["off"]["prefill_tokens"] / max(phase["on"]["prefill_tokens"], 1)
        phase["speedup"] = phase["off"]["wall_s"] / phase["on"]["wall_s"]
    return out


def section_graphs(model, args, make_engine, report: dict) -> dict:
    """(e) the same decode runs with CUDA graphs off; ratios against the graphed runs of (a) and (b)."""
    with make_engine(cuda_graphs=False) as engine:
        warm_up(engine, model, args)
        single = single_decode_tok_s(engine, model, args)
        batch = []
        for n in args.requests:
            warm_batch(engine, model, n, args)
            batch.append(engine_run(engine, prompts(n, args.prompt_len, model.config.vocab_size, n), args.new)["tok_s"])
    rows = [dict(requests=1, graphs_tok_s=report["single"]["engine_tok_s"], no_graphs_tok_s=single)]
    rows += [dict(requests=b["requests"], graphs_tok_s=b["engine_tok_s"], no_graphs_tok_s=tok_s)
             for b, tok_s in zip(report["batch"], batch, strict=True)]  # fmt: skip
    for row in rows:
        row["speedup"] = row["graphs_tok_s"] / row["no_graphs_tok_s"]
    return dict(rows=rows)


def section_overlap(model, args, make_engine) -> dict:
    """(f) the overlap schedule on vs off (`EngineConfig.overlap_schedule`): batch 1 and each of --requests,
    alternating engines run by run, median of --repeats with min-max. On CPU the forward is synchronous, so the
    two should match; on a GPU the host's scheduling and delivery hide behind the running step."""
    rows, vocab = [], model.config.vocab_size
    with make_engine(overlap=False) as off, make_engine(overlap=True) as on:
        for engine in (off, on):
            warm_up(engine, model, args)
        for n in (1, *args.requests):
            rates = {"off": [], "on": []}
            for r in range(args.repeats):
                batch = prompts(n, args.prompt_len, vocab, 31 * n + r)
                for key, engine in (("off", off), ("on", on)):
                    warm_batch(engine, model, n, args)
                    rates[key].append(engine_run(engine, batch, args.new)["tok_s"])
            row = dict(requests=n, repeats=args.repeats)
            for key, values in rates.items():
                row[f"{key}_tok_s"] = statistics.median(values)
                row[f"{key}_tok_s_min"], row[f"{key}_tok_s_max"] = min(values), max(values)
            row["speedup"] = row["on_tok_s"] / row["off_tok_s"]
            rows.append(row)
    return dict(rows=rows)


def section_staggered(model, args, make_engine) -> dict:
    """(g) `--staggered`: the largest N of (b) arriving one every `--arrive-every` engine steps, so most steps prefill
    a prompt beside the decoding rows. On CPU it compares the decode attention kernel against the reference for the
    decoding rows of those mixed steps: the reference arm swaps `astrai.ops.attention._cpu_extend` (what eager CPU
    prefill and mixed steps call) for the extend reference's loop with its default `decode_rows`. Decode steps run
    the kernel in both arms. Radix off (no run reuses another's prompts); alternating runs, median of --repeats with
    min-max."""
    from astrai.cpu_kernels import library
    from astrai.ops import attention
    from astrai.triton_kernels.extend_attention import extend_per_request

    n, vocab, kernel = max(args.requests), model.config.vocab_size, attention._cpu_extend
    runs: dict[str, list[dict]] = {"kernel": [], "reference": []}
    with make_engine(prefix_cache=False) as engine:
        warm_up(engine, model, args)
        for r in range(args.repeats):
            for k, key in enumerate(runs):
                attention._cpu_extend = kernel if key == "kernel" else extend_per_request
                try:
                    batch = prompts(n, args.prompt_len, vocab, 977 + 2 * r + k)
                    runs[key].append(engine_run(engine, batch, args.new, arrive_every=args.arrive_every))
                finally:
                    attention._cpu_extend = kernel
    rows = []
    for key, results in runs.items():
        rates = [x["tok_s"] for x in results]
        rows.append(dict(mixed_rows=key, tok_s=statistics.median(rates), tok_s_min=min(rates), tok_s_max=max(rates),
                         steps=statistics.median(x["steps"] for x in results),
                         ttft_p50=statistics.median(pct(x["ttft"], 50) for x in results),
                         ttft_p99=statistics.median(pct(x["ttft"], 99) for x in results),
                         itl_p50=statistics.median(pct(x["itl"], 50) for x in results),
                         itl_p99=statistics.median(pct(x["itl"], 99) for x in results)))  # fmt: skip
    return dict(requests=n, arrive_every=args.arrive_every, kernel_available=library.load().reason is None,
                repeats=args.repeats, rows=rows, speedup=rows[0]["tok_s"] / rows[1]["tok_s"])  # fmt: skip


def warm_up(engine: Engine, model, args) -> None:
    """Compile the steps (and capture the CUDA graphs) for the batch sizes the sections use."""
    for n in sorted({1, 2, *args.requests}):
        engine_run(engine, prompts(n, 8, model.config.vocab_size, 99), 3)


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    from bench_throughput import machine as probe_machine

    cuda, dtype = args.device == "cuda", getattr(torch, args.dtype)
    # the machine as bench_throughput probes it (read/copy GB/s, matmul GFLOP/s) and the load average, at the
    # start and again at the end: on a shared box they say how loaded it was while this ran
    probe = dict(probe_machine(args.device, dtype, small=args.smoke), loadavg=os.getloadavg())
    args.bandwidth = device_peaks(torch.cuda.get_device_name())[0] / 1e9 if cuda else probe["read_gbs"]
    with tempfile.TemporaryDirectory() as tmp:
        hf, model = build(args.config, dtype, Path(tmp), args.device)

    # --smoke: eager engines, which run the same sections without the decode step's compiles (~45 s on 2 cores
    # with a cold inductor cache; tests/astrai/inference check the compiled steps)
    def make_engine(prefix_cache: bool = True, cuda_graphs: bool = True, overlap: bool = False,
                    compile: bool = not args.smoke) -> Engine:  # fmt: skip
        cfg = EngineConfig(max_running=max(args.requests), max_step_tokens=args.step_tokens, compile=compile,
                           prefix_cache=prefix_cache, background=False, cuda_graphs=cuda_graphs,
                           overlap_schedule=overlap)  # fmt: skip
        return Engine(model, cfg)

    machine = torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine())
    report = dict(benchmark="bench_engine", config=args.config, dtype=args.dtype, device=args.device,
                  threads=torch.get_num_threads(), machine=machine, torch=torch.__version__,
                  memory_read_gbs=args.bandwidth, probe=probe, prompt_len=args.prompt_len,
                  new_tokens=args.new)  # fmt: skip
    start = time.perf_counter()
    if {"a", "b"} - set(args.skip):
        with make_engine() as engine:
            # on CUDA the start compiles the decode step and captures every bucket's graph; elsewhere the pool
            report["engine_start_s"] = time.perf_counter() - start
            console.print(f"[dim]engine started in {report['engine_start_s']:.1f} s; warming up...[/]")
            warm_up(engine, model, args)
            if "a" not in args.skip:
                console.print("[dim](a) single stream...[/]")
                report["single"] = section_single(hf, engine, model, args)
            if "b" not in args.skip:
                report["batch"] = []
                for n in args.requests:
                    console.print(f"[dim](b) {n} requests...[/]")
                    report["batch"].append(section_batch(hf, engine, model, n, args))
    if "c" not in args.skip:
        console.print("[dim](c) shared system prompt, radix on/off...[/]")
        report["prefix"] = section_prefix(model, args, make_engine)
    if cuda and not {"a", "b"} & set(args.skip):
        console.print("[dim](e) CUDA graphs off...[/]")
        report["graphs"] = section_graphs(model, args, make_engine, report)
    if args.staggered:
        console.print("[dim](g) staggered arrivals, mixed steps' decoding rows: kernel vs reference...[/]")
        report["staggered"] = section_staggered(model, args, make_engine)
    if args.overlap:
        console.print("[dim](f) overlap schedule on vs off...[/]")
        report["overlap"] = section_overlap(model, args, make_engine)
    report["probe_end"] = dict(probe_machine(args.device, dtype, small=args.smoke), loadavg=os.getloadavg())
    return report


PATHS = {  # (a)/(b) rate keys and what each runs, for the tables
    "engine_tok_s": "astrai engine",
    "hf_tok_s": "transformers eager (DynamicCache)",
    "hf_static_compile_tok_s": "transformers static cache + torch.compile",
    "hf_padded_tok_s": "transformers padded batch, eager (DynamicCache)",
    "hf_padded_static_compile_tok_s": "transformers padded batch, static cache + torch.compile",
    "hf_one_by_one_tok_s": "transformers one by one, eager (DynamicCache)",
    "hf_one_by_one_static_compile_tok_s": "transformers one by one, static cache + torch.compile",
}


def spread_text(row: dict, key: str, spec: str) -> str:
    """`row[key]` as "median (min-max)"."""
    return f"{row[key]:{spec}} ({row[f'{key}_min']:{spec}}-{row[f'{key}_max']:{spec}})"


def rate_rows(row: dict, ratio_of: dict[str, str]) -> list[dict]:
    """One table row per path measured in `row`: its tok/s and the engine's ratio to it, each median (min-max)."""
    return [dict(requests=row.get("requests", 1), path=name, tok_s=spread_text(row, key, ".1f"),
                 engine_ratio=spread_text(row, ratio_of[key], ".2f") if key in ratio_of else "")
            for key, name in PATHS.items() if key in row]  # fmt: skip


def show(r: dict) -> None:
    cols = [("requests", ""), ("path", ""), ("tok_s", ""), ("engine_ratio", "")]
    if "single" in r:
        s = r["single"]
        rows = rate_rows(s, {"hf_tok_s": "speedup", "hf_static_compile_tok_s": "speedup_vs_static_compile"})
        console.print(table(f"(a) single stream decode, {r['config']} {r['dtype']}, {r['threads']} threads: median "
                            f"(min-max) of {s['repeats']} rounds, ratios round by round; roofline "
                            f"{s['roofline']:.0%}", rows, cols))  # fmt: skip
    if "batch" in r:
        rows = [x for b in r["batch"] for x in rate_rows(b, {k: f"vs_{k[3:-6]}" for k in PATHS if k != "engine_tok_s"})]
        console.print(table(f"(b) N requests of {r['prompt_len']}-token prompts, {r['new_tokens']} new tokens each: "
                            f"median (min-max) of {r['batch'][0]['repeats']} rounds, ratios round by round", rows,
                            cols))  # fmt: skip
        rows = [dict(requests=b["requests"], check=name, **c) for b in r["batch"] for name, c in b["check"].items()]
        console.print(table("(b) greedy tokens on the same prompts: rows identical, common prefix (tokens)", rows,
                            [("requests", ""), ("check", ""), ("identical_rows", ""), ("rows", ""),
                             ("prefix_mean", ".1f"), ("prefix_min", ""), ("new_tokens", "")]))  # fmt: skip
        console.print(table("(d) the engine's latencies in (b), its median run (seconds)", r["batch"],
                            [("requests", ""), ("ttft_p50", ".2f"), ("ttft_p99", ".2f"), ("itl_p50", ".3f"),
                             ("itl_p99", ".3f"), ("timed_compiles", "")]))  # fmt: skip
    if "prefix" in r:
        rows = [dict(cache=phase, radix=k, **p[k], speedup=p["speedup"] if k == "on" else None,
                     fewer_prefill_tokens=p["fewer_prefill_tokens"] if k == "on" else None)
                for phase, p in r["prefix"].items() for k in ("on", "off")]  # fmt: skip
        console.print(table("(c) 16 requests sharing a system prompt, radix on vs off", rows,
                            [("cache", ""), ("radix", ""), ("prefill_tokens", ""), ("wall_s", ".2f"),
                             ("fewer_prefill_tokens", ".1f"), ("speedup", ".2f")]))  # fmt: skip
    if "graphs" in r:
        console.print(table("(e) engine decode tok/s with and without CUDA graphs", r["graphs"]["rows"],
                            [("requests", ""), ("graphs_tok_s", ".0f"), ("no_graphs_tok_s", ".0f"),
                             ("speedup", ".2f")]))  # fmt: skip
    if "overlap" in r:
        console.print(table("(f) engine tok/s, overlap schedule on vs off (median, min-max)", r["overlap"]["rows"],
                            [("requests", ""), ("on_tok_s", ".1f"), ("on_tok_s_min", ".1f"), ("on_tok_s_max", ".1f"),
                             ("off_tok_s", ".1f"), ("off_tok_s_min", ".1f"), ("off_tok_s_max", ".1f"),
                             ("speedup", ".2f")]))  # fmt: skip
    if "staggered" in r:
        g = r["staggered"]
        console.print(table(f"(g) {g['requests']} requests arriving every {g['arrive_every']} steps: the decoding rows "
                            "of mixed steps through the kernel vs the reference (median, min-max; seconds)", g["rows"],
                            [("mixed_rows", ""), ("tok_s", ".1f"), ("tok_s_min", ".1f"), ("tok_s_max", ".1f"),
                             ("steps", ".0f"), ("ttft_p50", ".2f"), ("ttft_p99", ".2f"), ("itl_p50", ".3f"),
                             ("itl_p99", ".3f")]))  # fmt: skip
    probes = [dict(r[k], when=k, loadavg=" ".join(f"{v:.2f}" for v in r[k]["loadavg"]))
              for k in ("probe", "probe_end") if k in r]  # fmt: skip
    console.print(table(f"machine: {r['probe']['cpu']}, {r['probe']['cores']} cores", probes,
                        [("when", ""), ("read_gbs", ".1f"), ("copy_gbs", ".1f"), ("matmul_gflops", ".0f"),
                         ("loadavg", "")]))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--one-by-one", type=int, default=3, help="requests timed one by one in transformers")
    parser.add_argument("--repeats", type=int, default=3, help="(a), (b): timed runs of each side, alternating")
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--prefix-new", type=int, default=16)
    parser.add_argument("--step-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--overlap", action="store_true", help="(f): the overlap schedule on vs off")
    parser.add_argument("--staggered", action="store_true", help="(g): staggered arrivals, CPU mixed-step kernel")
    parser.add_argument("--arrive-every", type=int, default=2, help="(g): engine steps between two arrivals")
    parser.add_argument("--skip", nargs="*", default=[], choices=["a", "b", "c"], help="sections not to run")
    parser.add_argument("--smoke", action="store_true", help="tiny config, few tokens (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.requests, args.prompt_len, args.new = "tiny", [4], 16, 8
        args.one_by_one, args.system_len, args.prefix_new, args.repeats, args.staggered = 1, 64, 4, 1, True
    report = run(args)
    show(report)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

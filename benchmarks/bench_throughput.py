"""End-to-end offline throughput on nano-vllm's workload: astrai's `Engine` vs transformers, same weights and requests.

The workload (nano-vllm's `bench.py`): N requests with input and output lengths uniform in [lo, hi] (fixed seed),
random token-id prompts, `ignore_eos`, all submitted at once. Presets:
  gpu    256 requests, lengths in [100, 1024], Qwen3-0.6B shape (random weights), bf16 on CUDA.
  cpu    16 requests, lengths in [16, 128], a scaled-down Qwen3 shape (12 layers, hidden 512, vocab 32768), fp32.
  smoke  4 tiny requests on the tiny config, eager engine, eager baseline (seconds; what CI runs).

astrai: one `Engine(background=False)` (vLLM's offline mode: the benchmark's thread runs the steps) with a KV pool
that holds every request; after each step the benchmark polls every request's handle, so each delta's timestamp is
the end of the step that produced it (TTFT counts from the common submit time, so it includes queueing).
Sampling is greedy (nano-vllm samples at temperature 0.6; with ignore_eos the amount of work is the same).

transformers (its fastest path, `--baseline static-compile`): `generate` with `cache_implementation="static"`,
one `max_cache_len` for every call, and generate's own `torch.compile` of the decode forward (transformers' auto
compile; `compile_config._compile_all_devices` turns it on for CPU). Requests are sorted by output length and
run as left-padded batches of `--hf-batch` (each batch decodes its longest output; only the requested tokens
count). `--baseline eager` is the dynamic-cache eager `generate` on the same batches.

Each side runs the whole workload once untimed (compiles, autotuning), then `--repeats` timed runs alternate
astrai and transformers; medians with min..max. Every repeat draws fresh prompt token ids of the same lengths so
the radix cache never hits a previous run. The lower bound: FLOPs (2 * matmul params * tokens + causal attention)
at the device's peak, and bytes (every weight read once per sequential step, i.e. max output length steps, plus
the K/V each decode token reads) at the measured bandwidth; each result is shown as the fraction of that bound.
Prints rich tables and the JSON report as the last stdout line.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import torch
from _common import PEAKS, console, emit, hf_generate_kwargs, table

import astrai
from astrai.configs.models import NAMED
from astrai.inference.cache import kv_bytes_per_token
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.io.hf import config_to_hf
from astrai.models.config import ModelConfig

RESULTS = Path(__file__).resolve().parent / "results" / "bench_throughput.json"
PRESETS = {
    "gpu": dict(config="qwen3-0.6b", dtype="bfloat16", device="cuda", requests=256, lo=100, hi=1024, hf_batch=64,
                step_tokens=8192, repeats=3, compile=True, baseline="static-compile"),
    "cpu": dict(config="qwen3-cpu", dtype="float32", device="cpu", requests=16, lo=16, hi=128, hf_batch=16,
                step_tokens=2048, repeats=3, compile=True, baseline="static-compile"),
    "smoke": dict(config="tiny", dtype="float32", device="cpu", requests=4, lo=4, hi=12, hf_batch=2,
                  step_tokens=256, repeats=2, compile=False, baseline="eager"),
}  # fmt: skip


def model_config(name: str) -> ModelConfig:
    """A named config, or `qwen3-cpu`: Qwen3-0.6B's family and proportions scaled to ~54M params for 2 CPU cores."""
    if name == "qwen3-cpu":
        return attrs.evolve(NAMED["qwen3-0.6b"](), vocab_size=32768, hidden_size=512, intermediate_size=1536,
                            num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                            max_position_embeddings=4096)  # fmt: skip
    return NAMED[name]()


def build(cfg: ModelConfig, dtype: torch.dtype, device: str):
    """A random transformers model of `cfg` and the same weights loaded by astrai (through a saved folder)."""
    import transformers

    config = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = astrai.load(tmp, dtype=dtype, device=device)
    return hf.to(device), model


# ---- workload and bound ---------------------------------------------------------------------------------------
def workload(n: int, lo: int, hi: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Input and output lengths, uniform in [lo, hi] (nano-vllm: seed 0, [100, 1024])."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist(), torch.randint(
        lo, hi + 1, (n,), generator=gen
    ).tolist()


def prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def lower_bound(model, ins: list[int], outs: list[int], peak_flops: float, bandwidth: float) -> dict:
    """Seconds the workload needs at least: max(FLOPs / peak, bytes / bandwidth), with both terms."""
    cfg, p = model.config, model.params
    embed = p.embed_tokens.weight.numel()
    head = cfg.hidden_size * cfg.vocab_size
    body = model.num_parameters - embed - (0 if p.lm_head is None else head)  # matmul weights per token (+ norms)
    seq = [i + o - 1 for i, o in zip(ins, outs, strict=True)]  # tokens through the layers (last output not fed)
    attn = sum(4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * t * (t + 1) / 2 for t in seq)
    flops = 2 * body * sum(seq) + 2 * head * sum(outs) + attn
    weights = model.nbytes - (0 if p.lm_head is None else p.embed_tokens.weight.nbytes)  # the table is gathered
    kv = kv_bytes_per_token(cfg, model.dtype)
    kv_reads = sum(kv * sum(i + k for k in range(1, o)) for i, o in zip(ins, outs, strict=True))
    nbytes = weights * max(outs) + kv_reads
    compute_s, memory_s = flops / peak_flops, nbytes / bandwidth
    return dict(flops=flops, bytes=nbytes, weight_bytes=weights, kv_read_bytes=kv_reads, compute_s=compute_s,
                memory_s=memory_s, bound_s=max(compute_s, memory_s))  # fmt: skip


# ---- machine ----------------------------------------------------------------------------------------------------
def _best_s(fn, repeats: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def machine(device: str, dtype: torch.dtype, small: bool) -> dict:
    """CPU model, cores, threads; measured read/copy bandwidth and matmul FLOP/s (best of several); GPU name/peaks."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    out = dict(cpu=cpu, cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = (64 if small else 512 if not cuda else 2048) * 2**20 // 4  # fp32 elements: 64 MiB .. 2 GiB
    x = torch.ones(n, device=device)
    y = torch.empty_like(x)
    out["read_gbs"] = n * 4 / _best_s(lambda: x.sum(), 10, sync) / 1e9
    out["copy_gbs"] = 2 * n * 4 / _best_s(lambda: y.copy_(x), 10, sync) / 1e9
    m = 512 if small else 2048 if not cuda else 8192
    a, b = (torch.randn(m, m, device=device, dtype=dtype) for _ in range(2))
    out["matmul_gflops"] = 2 * m**3 / _best_s(lambda: a @ b, 5, sync) / 1e9
    out["gpu"] = torch.cuda.get_device_name() if cuda else None
    spec = next(((bw, fl) for key, bw, fl in PEAKS if cuda and key in out["gpu"]), None)
    out["spec_bandwidth_gbs"], out["spec_bf16_tflops"] = (spec[0] / 1e9, spec[1] / 1e12) if spec else (None, None)
    # the bound: bandwidth measured (copy on GPU, read on CPU as bench_engine/bench_forward record it); FLOP/s the
    # GPU's published dense bf16 peak when known, else the measured matmul
    out["bound_bandwidth_gbs"] = out["copy_gbs"] if cuda else out["read_gbs"]
    out["bound_gflops"] = spec[1] / 1e9 if spec and dtype == torch.bfloat16 else out["matmul_gflops"]
    return out


# ---- the two systems ----------------------------------------------------------------------------------------------
def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def astrai_run(engine: Engine, batch: list[list[int]], outs: list[int]) -> dict:
    """Submit every request at once, step on this thread, timestamp each request's deltas after every step."""
    handles = [engine.submit(p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
               for p, o in zip(batch, outs, strict=True)]  # fmt: skip
    start = time.perf_counter()
    ttft, itl, last, tokens = [], [], {}, 0
    while engine.step():
        now = time.perf_counter()
        for i, handle in enumerate(handles):
            for delta in handle.poll():
                if not delta.token_ids:
                    continue
                tokens += len(delta.token_ids)
                ttft.append(now - start) if i not in last else itl.append(now - last[i])
                last[i] = now
    wall = time.perf_counter() - start
    for handle in handles:
        handle.poll()
    got = [len(h.completion.outputs[0].token_ids) if h.completion else 0 for h in handles]
    assert got == outs, "astrai did not produce every requested token"
    return dict(wall_s=wall, ttft=ttft, itl=itl)


def hf_batches(ins: list[int], outs: list[int], size: int) -> list[list[int]]:
    """Request indices grouped by output length (longest first) into batches of `size`."""
    order = sorted(range(len(outs)), key=lambda i: (-outs[i], -ins[i]))
    return [order[k : k + size] for k in range(0, len(order), size)]


def hf_run(hf, batch: list[list[int]], outs: list[int], groups: list[list[int]], mode: str, cache_len: int) -> dict:
    """transformers' `generate` over the padded groups; seconds and the tokens it computed (padding included)."""
    extra = hf_generate_kwargs(mode, cache_len)
    computed = 0
    start = time.perf_counter()
    for group in groups:
        rows, new = [batch[i] for i in group], max(outs[i] for i in group)
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=hf.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=hf.device)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0, **extra)  # fmt: skip
        assert out.shape[1] == width + new
        computed += len(rows) * new
    if hf.device.type == "cuda":
        torch.cuda.synchronize()
    return dict(wall_s=time.perf_counter() - start, computed_tokens=computed)


# ---- driver ---------------------------------------------------------------------------------------------------------
def summary(runs: list[dict], ins: list[int], outs: list[int], bound_s: float) -> dict:
    """Medians and ranges of one system's timed runs."""
    walls = [r["wall_s"] for r in runs]

    def spread(values: list[float]) -> dict:
        return dict(median=statistics.median(values), min=min(values), max=max(values))

    out = dict(wall_s=spread(walls), output_tok_s=spread([sum(outs) / w for w in walls]),
               total_tok_s=spread([(sum(ins) + sum(outs)) / w for w in walls]),
               of_bound=spread([bound_s / w for w in walls]))  # fmt: skip
    if "ttft" in runs[0]:
        for key in ("ttft", "itl"):
            for q in (50, 90, 99):
                out[f"{key}_p{q}"] = spread([pct(r[key], q) for r in runs])
    if "computed_tokens" in runs[0]:
        out["computed_tokens"] = runs[0]["computed_tokens"]
    return out


def counted_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    dtype, cfg = getattr(torch, args.dtype), model_config(args.config)
    mach = machine(args.device, dtype, small=args.smoke)
    console.print(f"[dim]{mach['gpu'] or mach['cpu']}: read {mach['read_gbs']:.1f} GB/s, copy {mach['copy_gbs']:.1f} "
                  f"GB/s, matmul {mach['matmul_gflops']:.0f} GFLOP/s; building the model...[/]")  # fmt: skip
    hf, model = build(cfg, dtype, args.device)
    ins, outs = workload(args.requests, args.lo, args.hi)
    bound = lower_bound(model, ins, outs, mach["bound_gflops"] * 1e9, mach["bound_bandwidth_gbs"] * 1e9)
    vocab, page = cfg.vocab_size, 16
    cache_len = max(i + o for i, o in zip(ins, outs, strict=True))
    ecfg = EngineConfig(max_running=args.requests, max_step_tokens=args.step_tokens, compile=args.compile,
                        background=False, page_size=page, max_model_len=cache_len,
                        kv_budget_tokens=sum(ins) + sum(outs) + page * args.requests)  # fmt: skip
    groups = hf_batches(ins, outs, args.hf_batch)
    runs: dict[str, list[dict]] = {"astrai": [], **{b: [] for b in args.baseline}}
    compiles: dict[str, int] = dict.fromkeys(runs, 0)
    start = time.perf_counter()
    with Engine(model, ecfg) as engine:
        console.print(f"[dim]engine started in {time.perf_counter() - start:.1f} s; warm-up runs (compile)...[/]")
        warm = {}
        for name in runs:  # one untimed run of the whole workload per system, other token ids
            console.print(f"[dim]  warm-up: {name}...[/]")
            t0 = time.perf_counter()
            if name == "astrai":
                astrai_run(engine, prompts(ins, vocab, 10_000), outs)
            else:
                hf_run(hf, prompts(ins, vocab, 10_000), outs, groups, name, cache_len)
            warm[name] = time.perf_counter() - t0
        console.print("[dim]warm-up seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in warm.items()) + "[/]")
        for r in range(args.repeats):
            batch = prompts(ins, vocab, r)  # fresh ids each repeat: no radix hits across runs; same for both
            for name in runs:
                before = counted_graphs()
                if name == "astrai":
                    runs[name].append(astrai_run(engine, batch, outs))
                else:
                    runs[name].append(hf_run(hf, batch, outs, groups, name, cache_len))
                compiles[name] += counted_graphs() - before
            console.print(f"[dim]repeat {r + 1}/{args.repeats}: " + ", ".join(
                f"{k} {sum(outs) / v[-1]['wall_s']:.1f} out tok/s" for k, v in runs.items()) + "[/]")  # fmt: skip
    results = {name: summary(rs, ins, outs, bound["bound_s"]) for name, rs in runs.items()}
    for name in args.baseline:  # paired ratios: repeat r of astrai over repeat r of the baseline
        ratios = [b["wall_s"] / a["wall_s"] for a, b in zip(runs["astrai"], runs[name], strict=True)]
        results[name]["astrai_over_this"] = dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))
    if any(compiles.values()):
        console.print(f"[yellow]torch.compile compiled new graphs in timed runs: {compiles}")
    return dict(benchmark="bench_throughput", preset=args.preset, config=args.config, dtype=args.dtype,
                device=args.device, machine=mach, params=model.num_parameters, requests=args.requests,
                lengths=[args.lo, args.hi], input_tokens=sum(ins), output_tokens=sum(outs), max_output=max(outs),
                repeats=args.repeats, engine=dict(compile=args.compile, max_step_tokens=args.step_tokens,
                                                  background=False),
                hf=dict(batch=args.hf_batch, batches=len(groups), max_cache_len=cache_len),
                bound=bound, warmup_s=warm, timed_compiles=compiles, results=results)  # fmt: skip


def _range(s: dict, spec: str) -> str:
    return f"{s['median']:{spec}} ({s['min']:{spec}}..{s['max']:{spec}})"


def show(r: dict) -> None:
    m, b = r["machine"], r["bound"]
    rows, lat = [], []
    for name, s in r["results"].items():
        system = "astrai Engine" if name == "astrai" else f"transformers {name}"
        rows.append(dict(system=system, output_tok_s=_range(s["output_tok_s"], ".1f"),
                         total_tok_s=_range(s["total_tok_s"], ".1f"), wall_s=_range(s["wall_s"], ".2f"),
                         of_bound=_range(s["of_bound"], ".1%"),
                         astrai_x=_range(s["astrai_over_this"], ".2f") if "astrai_over_this" in s
                         else "-"))  # fmt: skip
        if "ttft_p50" in s:
            lat.append(dict(system=system, **{k: _range(s[k], ".3f") for k in s if k[:4] in ("ttft", "itl_")}))
    title = (f"{r['requests']} requests, input/output lengths uniform in [{r['lengths'][0]}, {r['lengths'][1]}] "
             f"({r['input_tokens']} in, {r['output_tokens']} out), {r['config']} {r['dtype']}, "
             f"{m['gpu'] or m['cpu']} ({m['threads']} threads); median (min..max) of {r['repeats']}")  # fmt: skip
    cols = [("system", ""), ("output_tok_s", ""), ("total_tok_s", ""), ("wall_s", ""), ("of_bound", ""),
            ("astrai_x", "")]  # fmt: skip
    console.print(table(title, rows, cols))
    keys = [f"{k}_p{q}" for k in ("ttft", "itl") for q in (50, 90, 99)]
    console.print(table("astrai per-request latency, seconds (TTFT from the common submit time)", lat,
                        [("system", ""), *((k, "") for k in keys)]))  # fmt: skip
    bound = [dict(flops=f"{b['flops']:.3g}", bytes=f"{b['bytes']:.3g}", compute_s=b["compute_s"],
                  memory_s=b["memory_s"], bound_s=b["bound_s"], bandwidth_gbs=m["bound_bandwidth_gbs"],
                  peak_gflops=m["bound_gflops"])]  # fmt: skip
    console.print(table("lower bound: max(FLOPs / peak, bytes / bandwidth)", bound,
                        [("flops", ""), ("bytes", ""), ("compute_s", ".3f"), ("memory_s", ".3f"),
                         ("bound_s", ".3f"), ("bandwidth_gbs", ".1f"), ("peak_gflops", ".0f")]))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--smoke", action="store_true", help="= --preset smoke (seconds)")
    parser.add_argument("--config", help="model: a name from configs/models.py or qwen3-cpu")
    parser.add_argument("--dtype")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--requests", type=int)
    parser.add_argument("--lo", type=int, help="shortest input/output length")
    parser.add_argument("--hi", type=int, help="longest input/output length")
    parser.add_argument("--hf-batch", type=int, help="transformers' padded batch size")
    parser.add_argument("--step-tokens", type=int, help="engine max_step_tokens")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, help="compiled engine decode")
    parser.add_argument("--baseline", nargs="+", choices=["static-compile", "eager", "none"],
                        help="transformers path(s) to run beside astrai")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if isinstance(args.baseline, str):
        args.baseline = [args.baseline]
    args.baseline = [b for b in args.baseline if b != "none"]
    report = run(args)
    show(report)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

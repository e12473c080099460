"""Prefill and single-stream decode speed of astrai vs transformers on the same random weights (CPU).

For each config (SmolLM2-135M-shaped, Qwen2.5-0.5B-shaped) and dtype it measures, side by side in one run:
- prefill tok/s of a `--prompt-len` prompt (both sides compute logits for the last row only:
  astrai via `logits_positions`, transformers via `logits_to_keep=1` as its `generate` does), astrai eager and
  compiled; the × column compares the path the engine runs on CPU (eager prefill, compiled decode), with the
  engine's oneDNN weight packs (`EngineConfig.pack_weights`);
- batch-1 greedy decode tok/s over `--decode-tokens` steps with a KV cache: transformers (DynamicCache), and
  its fastest path (`generate` with a static cache and `torch.compile`, warmed up), astrai eager `decode_step`,
  and astrai `torch.compile`d `decode_step` compiled as the engine compiles it (`step.SERVED_STEP_OPTIONS`: no
  guards on the parameters, no wrapper asserts);
- the decode roofline fraction: bytes of weights read per token x tok/s / measured memory read bandwidth. The
  box's bandwidth moves by ±30% between minutes, so besides the fraction against the probe taken at the start,
  each compiled decode run is paired with a probe taken just before it (best of 3 sums): the paired fractions'
  median and min-max are reported too.

Prints a rich table and writes JSON (also the last stdout line). `--smoke` runs a tiny config in seconds.
Usage: python benchmarks/bench_forward.py [--configs smollm2-135m qwen2.5-0.5b] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import hf_generate_kwargs
from rich.console import Console
from rich.table import Table

import astrai
from astrai.configs.models import NAMED
from astrai.inference.cache import init_kv_cache, make_attn_meta
from astrai.inference.runner import pack_cpu_weights
from astrai.inference.step import SERVED_STEP_OPTIONS, compile_step, decode_step, prefill_step
from astrai.io.hf import config_to_hf
from astrai.ops.attention import pages_needed

# SmolLM2-135M- and Qwen2.5-0.5B-shaped models (configs/models.py); `tiny` for --smoke.
CONFIGS = ("smollm2-135m", "qwen2.5-0.5b", "tiny")
console = Console()


def memory_bandwidth_gbs(size_mib: int = 1024, repeats: int = 10) -> float:
    """Measured read bandwidth: the best of `repeats` timed sums of a large fp32 tensor (the box is shared and
    noisy, so the best run is the closest to what the memory system can do)."""
    x = torch.ones(size_mib * 2**20 // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build(name: str, dtype: torch.dtype, folder: Path):
    """A random transformers model of the named config and the same weights loaded by astrai."""
    import transformers

    config = transformers.AutoConfig.for_model(**config_to_hf(NAMED[name]()))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)
    hf.save_pretrained(folder)
    return hf, astrai.load(folder, dtype=dtype)


def hf_prefill_decode(hf, prompt: torch.Tensor, steps: int, repeats: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of transformers with a DynamicCache, greedy."""
    from transformers.cache_utils import DynamicCache

    prefill_times, decode_rates = [], []
    for _ in range(repeats):
        cache = DynamicCache(config=hf.config)
        start = time.perf_counter()
        out = hf(prompt[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill_times.append(time.perf_counter() - start)
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            out = hf(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        decode_rates.append(steps / (time.perf_counter() - start))
    return prompt.numel() / statistics.median(prefill_times), statistics.median(decode_rates)


def hf_static_compile_decode(hf, prompt: torch.Tensor, steps: int, repeats: int) -> float:
    """Decode tok/s of transformers' fastest path, `generate` with a static cache and `torch.compile`, greedy:
    `steps - 1` tokens over the time of a `steps`-token generate minus a 1-token one (prefill and first token
    out). Warmed up first: the first calls compile."""
    extra = hf_generate_kwargs("static-compile", prompt.numel() + steps + 1)

    def seconds(new: int) -> float:
        start = time.perf_counter()
        hf.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, pad_token_id=0, **extra)  # fmt: skip
        return time.perf_counter() - start

    seconds(steps), seconds(1)
    return statistics.median((steps - 1) / (seconds(steps) - seconds(1)) for _ in range(repeats))


def astrai_prefill_decode(model, prompt: torch.Tensor, steps: int, repeats: int, compiled: bool, probe=None):
    """(prefill tok/s, decode tok/s, [(decode tok/s, GB/s probed just before)]) of astrai's paged steps, greedy;
    `compiled` wraps them in torch.compile with the engine's options. `probe` (a bandwidth probe, GB/s) runs
    before each counted decode run; the pairs list is empty without it."""
    cfg, page = model.config, 16
    pages = [list(range(1, 1 + pages_needed(prompt.numel() + steps + 2, page)))]
    if compiled:
        prefill = compile_step(prefill_step, cfg=cfg, options=SERVED_STEP_OPTIONS)
        decode = compile_step(decode_step, cfg=cfg, options=SERVED_STEP_OPTIONS)
    else:
        prefill, decode = (lambda *a: prefill_step(*a, cfg=cfg)), (lambda *a: decode_step(*a, cfg=cfg))
    n = prompt.numel()
    prefill_times, decode_rates, pairs = [], [], []
    for rep in range(repeats + (1 if compiled else 0)):  # one extra warm-up run pays the compile
        cache = init_kv_cache(cfg, len(pages[0]) + 1, page, dtype=model.dtype, device="cpu")
        meta = make_attn_meta(pages, [0], [n], page_size=page, device="cpu")
        start = time.perf_counter()
        logits = prefill(model.params, prompt, meta, cache, torch.tensor([n - 1]))
        elapsed = time.perf_counter() - start
        token = logits.argmax(-1)
        metas = [make_attn_meta(pages, [n + i], [1], page_size=page, device="cpu", decode=True) for i in range(steps)]
        counted = not (compiled and rep == 0)
        probed = probe() if probe is not None and counted else None
        start = time.perf_counter()
        for meta in metas:
            token = decode(model.params, token, meta, cache).argmax(-1)
        rate = steps / (time.perf_counter() - start)
        if counted:
            prefill_times.append(elapsed)
            decode_rates.append(rate)
            if probed is not None:
                pairs.append((rate, probed))
    return n / statistics.median(prefill_times), statistics.median(decode_rates), pairs


def decode_weight_bytes(model) -> int:
    """Bytes read per decode token: every weight once (the embedding table only as the tied LM head)."""
    total = model.nbytes
    if model.params.lm_head is not None:
        total -= model.params.embed_tokens.weight.numel() * model.params.embed_tokens.weight.element_size()
    return total


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    bandwidth = memory_bandwidth_gbs(256 if args.smoke else 1024)
    results = []
    with torch.inference_mode():
        for name in args.configs:
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                with tempfile.TemporaryDirectory() as tmp:
                    hf, model = build(name, dtype, Path(tmp))
                pack_cpu_weights(model)  # as the engine does on CPU (prefill products run on the packs)
                gen = torch.Generator().manual_seed(0)
                prompt = torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=gen)
                console.print(f"[dim]{name} {dtype_name}: transformers...[/]")
                hf_pre, hf_dec = hf_prefill_decode(hf, prompt, args.decode_tokens, args.repeats)
                console.print(
                    f"[dim]{name} {dtype_name}: transformers static cache + compile (includes a compile)...[/]"
                )
                hf_fast = hf_static_compile_decode(hf, prompt, args.decode_tokens, args.repeats)
                console.print(f"[dim]{name} {dtype_name}: astrai eager...[/]")
                ea_pre, ea_dec, _ = astrai_prefill_decode(model, prompt, args.decode_tokens, args.repeats, False)
                console.print(f"[dim]{name} {dtype_name}: astrai compiled (includes a compile)...[/]")
                probe = functools.partial(memory_bandwidth_gbs, 256 if args.smoke else 1024, 3)
                co_pre, co_dec, pairs = astrai_prefill_decode(
                    model, prompt, args.decode_tokens, args.repeats, True, probe=probe
                )
                weight_bytes = decode_weight_bytes(model)
                paired = [weight_bytes * rate / (gbs * 1e9) for rate, gbs in pairs]
                results.append(
                    dict(
                        config=name,
                        dtype=dtype_name,
                        params=model.num_parameters,
                        prompt_len=args.prompt_len,
                        hf_prefill_tok_s=hf_pre,
                        astrai_prefill_tok_s=ea_pre,
                        astrai_compiled_prefill_tok_s=co_pre,
                        hf_decode_tok_s=hf_dec,
                        hf_static_compile_decode_tok_s=hf_fast,
                        astrai_decode_tok_s=ea_dec,
                        astrai_compiled_decode_tok_s=co_dec,
                        decode_speedup=co_dec / hf_dec,  # the engine's path: compiled decode, eager prefill
                        decode_speedup_vs_static_compile=co_dec / hf_fast,
                        prefill_speedup=ea_pre / hf_pre,
                        weight_bytes_per_token=weight_bytes,
                        roofline_fraction=weight_bytes * co_dec / (bandwidth * 1e9),
                        hf_roofline_fraction=weight_bytes * hf_dec / (bandwidth * 1e9),
                        paired_runs=[dict(decode_tok_s=rate, read_gbs=gbs) for rate, gbs in pairs],
                        paired_roofline_fraction=dict(
                            median=statistics.median(paired), min=min(paired), max=max(paired)
                        ),
                    )
                )
                del hf, model
    return dict(
        benchmark="bench_forward",
        machine=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        memory_read_gbs=bandwidth,
        decode_tokens=args.decode_tokens,
        results=results,
    )


def print_table(report: dict) -> None:
    table = Table(
        title=f"astrai vs transformers, CPU ({report['threads']} threads, "
        f"read bandwidth {report['memory_read_gbs']:.1f} GB/s)"
    )
    for col in (
        "config",
        "dtype",
        "prefill HF",
        "prefill astrai",
        "×",
        "prefill compiled",
        "decode HF",
        "decode HF static+compile",
        "decode astrai",
        "decode compiled",
        "×",
        "× static",
        "roofline astrai",
        "paired (min-max)",
        "roofline HF",
    ):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(
            r["config"],
            r["dtype"],
            f"{r['hf_prefill_tok_s']:.0f}",
            f"{r['astrai_prefill_tok_s']:.0f}",
            f"{r['prefill_speedup']:.2f}",
            f"{r['astrai_compiled_prefill_tok_s']:.0f}",
            f"{r['hf_decode_tok_s']:.1f}",
            f"{r['hf_static_compile_decode_tok_s']:.1f}",
            f"{r['astrai_decode_tok_s']:.1f}",
            f"{r['astrai_compiled_decode_tok_s']:.1f}",
            f"{r['decode_speedup']:.2f}",
            f"{r['decode_speedup_vs_static_compile']:.2f}",
            f"{r['roofline_fraction']:.0%}",
            "{median:.0%} ({min:.0%}-{max:.0%})".format(**r["paired_roofline_fraction"]),
            f"{r['hf_roofline_fraction']:.0%}",
        )
    console.print(table)
    console.print(
        "[dim]tok/s; × = astrai as the engine runs it on CPU (eager prefill, compiled decode, packed "
        "weights) / transformers eager (× static: / its static cache + compile), measured side by side in this "
        "run; roofline: weight bytes per token x compiled decode tok/s / read bandwidth, against the probe at "
        "the start and, paired, each run against a probe taken just before it[/]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"], choices=CONFIGS)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny config, few tokens (seconds)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_forward.json"))
    args = parser.parse_args()
    if args.smoke:
        args.configs, args.dtypes, args.prompt_len, args.decode_tokens, args.repeats = ["tiny"], ["float32"], 32, 8, 1
    report = run(args)
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()

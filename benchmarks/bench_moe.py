"""MoE prefill speed of astrai vs transformers (CPU), and KV-cache bytes per token of GQA vs MLA models.

1. Prefill: a Qwen3-MoE-shaped random model (`--hidden`, `--layers`, `--experts` top-`--top-k`,
   `--moe-intermediate`, `--vocab`) is built with `astrai.init_params`, written with `astrai.save` (so the
   expert stacking/splitting of `astrai.io.hf.expert_hf_names` is exercised) and loaded into transformers'
   `Qwen3MoeForCausalLM` with `from_pretrained` (sdpa attention), twice: with transformers' default experts
   implementation (`hf_eager`; grouped_mm in 5.24) and with `experts_implementation="eager"`, its per-expert loop
   (`hf_eager_loop`). Before any timing, the full logits of astrai and of both HF models on the same random batch
   must agree (max abs diff <= `--atol` x max(1, |logits| max)), otherwise the script fails: the comparison would
   not be fair. Then each `--shapes` entry (BxT) is timed as one forward computing logits for the last position of
   each row only (astrai via `logits_positions`, transformers via `logits_to_keep=1`), four ways: astrai eager
   `astrai.models.decoder.forward`, astrai `torch.compile(functools.partial(forward, cfg=cfg), dynamic=False)`
   (warmed up, so the compile is untimed), and the two HF models (eager mode). Repeats are interleaved (astrai,
   compiled, HF, HF loop, astrai, ...) so drift on a shared machine hits all alike; we report the median tok/s
   and the ratio to `hf_eager` (also of the fastest runs, which a noisy shared machine disturbs least).
2. KV bytes per token (from configs, no model run), bf16, all layers: GQA models of configs.models
   (2 x K x D x layers x 2 bytes, `astrai.inference.cache.kv_bytes_per_token`) vs MLA's latent cache
   (`MLAConfig.latent_dim` = kv_lora_rank + qk_rope_head_dim per layer) for DeepSeek-V3 and DeepSeek-V2-Lite,
   and what those MLA models would cost with K/V materialised per head (H x (Dn + Dr + Dv) per layer).

Prints rich tables and writes JSON (also the last stdout line). `--smoke` runs tiny shapes in seconds.
Usage: python benchmarks/bench_moe.py [--shapes 1x512 4x128] [--experts 16] [--top-k 2] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from _common import console, emit, table

import astrai
from astrai.configs.models import NAMED
from astrai.inference.cache import kv_bytes_per_token
from astrai.io.model import Model
from astrai.models.config import ModelConfig, MoEConfig
from astrai.models.decoder import forward
from astrai.nn.mla import MLAConfig

RESULTS = Path(__file__).resolve().parent / "results" / "bench_moe.json"
VARIANTS = ("astrai", "astrai_compiled", "hf_eager", "hf_eager_loop")
GQA_MODELS = ("smollm2-135m", "qwen3-0.6b", "llama3.1-8b")
# Published attention shapes of the MLA models (config.json of deepseek-ai/DeepSeek-V3 and DeepSeek-V2-Lite).
MLA_MODELS: dict[str, tuple[int, MLAConfig]] = {
    "deepseek-v3": (61, MLAConfig(num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                  qk_rope_head_dim=64, v_head_dim=128)),
    "deepseek-v2-lite": (27, MLAConfig(num_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                                       qk_rope_head_dim=64, v_head_dim=128)),
}  # fmt: skip
KV_REF = "deepseek-v3"  # the KV table's ratio column is relative to this model's latent cache (its first MLA row)


def moe_config(args) -> ModelConfig:
    """A Qwen3-MoE-shaped config: every layer sparse, GQA with q/k norm, untied head."""
    heads = args.hidden // 64
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=64, qk_norm=True, max_position_embeddings=4096, tie_word_embeddings=False, ffn_type="moe",
        moe=MoEConfig(num_experts=args.experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True),
    )  # fmt: skip


def build(cfg: ModelConfig, dtype: torch.dtype, folder: Path):
    """(astrai Model, HF model with its default experts implementation, HF model with the per-expert loop), all
    holding the same random weights, via astrai.save + from_pretrained."""
    model = Model(config=cfg, params=astrai.init_params(cfg, seed=0))
    astrai.save(model, folder)
    hfs = []
    for experts in (None, "eager"):
        kw = {} if experts is None else dict(experts_implementation=experts)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa", **kw)
        if type(hf).__name__ != "Qwen3MoeForCausalLM":
            raise SystemExit(f"transformers loaded {type(hf).__name__}, expected Qwen3MoeForCausalLM")
        hfs.append(hf.eval())
    return astrai.load(folder, dtype=dtype), *hfs


def check_logits(model: Model, hfs: dict, ids: torch.Tensor, atol: float) -> dict:
    """Full logits of astrai and every HF model on `ids`; fail loudly unless each HF model agrees with astrai
    within atol x max(1, |logits| max)."""
    actual = forward(model.params, model.config, ids)
    abs_max = actual.abs().max().item()
    tol = atol * max(1.0, abs_max)
    diffs = {name: (actual - hf(ids).logits.float()).abs().max().item() for name, hf in hfs.items()}
    for name, diff in diffs.items():
        if not diff <= tol:
            raise SystemExit(f"logits differ from {name}: max abs diff {diff:.3g} > {tol:.3g}: unfair comparison")
    return dict(ok=True, max_abs_diff=max(diffs.values()), max_abs_diff_by_variant=diffs, tolerance=tol,
                logits_abs_max=abs_max, shape=list(ids.shape))  # fmt: skip


def prefill_fns(model: Model, hf, hf_loop, compiled, ids: torch.Tensor) -> dict:
    """No-argument callables, one per variant, each a prefill of `ids` [B, T] with last-position logits."""
    b, t = ids.shape
    last = torch.arange(b) * t + t - 1
    params, cfg = model.params, model.config
    return {
        "astrai": lambda: forward(params, cfg, ids, logits_positions=last),
        "astrai_compiled": lambda: compiled(params, tokens=ids, logits_positions=last),
        "hf_eager": lambda: hf(ids, logits_to_keep=1).logits,
        "hf_eager_loop": lambda: hf_loop(ids, logits_to_keep=1).logits,
    }


def bench_prefill(args, cfg: ModelConfig) -> dict:
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model, hf, hf_loop = build(cfg, dtype, Path(tmp))
    gen = torch.Generator().manual_seed(0)
    check_ids = torch.randint(0, cfg.vocab_size, (2, min(64, args.shapes[0][1])), generator=gen)
    check = check_logits(model, {"hf_eager": hf, "hf_eager_loop": hf_loop}, check_ids, args.atol)
    console.print(f"[dim]logits agree: max abs diff {check['max_abs_diff']:.2e} (|logits| max "
                  f"{check['logits_abs_max']:.3g}, tolerance {check['tolerance']:.2g})[/]")  # fmt: skip
    compiled = torch.compile(functools.partial(forward, cfg=cfg), dynamic=False)
    cases = []
    for b, t in args.shapes:
        ids = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
        fns = prefill_fns(model, hf, hf_loop, compiled, ids)
        start = time.perf_counter()
        outs = {name: fn() for name, fn in fns.items()}  # warm-up; the compile happens here
        warmup_s = time.perf_counter() - start
        ref = outs["hf_eager"].reshape(b, -1)
        last_diff = max((o.reshape(b, -1).float() - ref.float()).abs().max().item() for o in outs.values())
        cases.append(dict(batch=b, seq=t, fns=fns, times={n: [] for n in fns}, warmup_s=warmup_s, last_diff=last_diff))
    console.print(f"[dim]timing {args.repeats} interleaved repeats of {', '.join(VARIANTS)} per shape...[/]")
    for _ in range(args.repeats):
        for case in cases:
            for name, fn in case["fns"].items():
                start = time.perf_counter()
                fn()
                case["times"][name].append(time.perf_counter() - start)
    rows = []
    for case in cases:
        tokens = case["batch"] * case["seq"]
        rate = {n: tokens / statistics.median(ts) for n, ts in case["times"].items()}
        best = {n: min(ts) for n, ts in case["times"].items()}
        for name in VARIANTS:
            med = statistics.median(case["times"][name])
            rows.append(dict(shape=f"{case['batch']}x{case['seq']}", variant=name, ms=med * 1e3,
                             ms_min=min(case["times"][name]) * 1e3, tok_s=rate[name],
                             vs_hf_eager=rate[name] / rate["hf_eager"], min_vs_hf_eager=best["hf_eager"] / best[name],
                             last_logits_max_diff=case["last_diff"]))  # fmt: skip
    return dict(
        model=dict(vocab=cfg.vocab_size, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                   heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                   experts=cfg.moe.num_experts, top_k=cfg.moe.num_experts_per_tok,
                   moe_intermediate=cfg.moe.moe_intermediate_size),
        params=model.num_parameters,
        dtype=args.dtype,
        hf_experts_implementation=getattr(hf.config, "_experts_implementation", None),
        logits_check=check,
        prefill=rows,
    )  # fmt: skip


def kv_table() -> list[dict]:
    """KV-cache bytes per token (all layers, bf16) of GQA models and of MLA models (latent vs materialised)."""
    item = torch.empty((), dtype=torch.bfloat16).element_size()
    rows = []
    for name in GQA_MODELS:
        cfg = NAMED[name]()
        per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim
        rows.append(dict(model=name, layout=f"GQA K/V ({cfg.num_key_value_heads} x {cfg.head_dim})",
                         layers=cfg.num_hidden_layers, elements_per_layer=per_layer,
                         bytes_per_token=kv_bytes_per_token(cfg, torch.bfloat16)))  # fmt: skip
    for name, (layers, mla) in MLA_MODELS.items():
        materialised = mla.num_heads * (mla.qk_head_dim + mla.v_head_dim)
        rows.append(dict(model=name, layout=f"MLA latent ({mla.kv_lora_rank} + {mla.qk_rope_head_dim})",
                         layers=layers, elements_per_layer=mla.latent_dim,
                         bytes_per_token=mla.latent_dim * layers * item))  # fmt: skip
        rows.append(dict(model=name, layout=f"materialised K/V ({mla.num_heads} x ({mla.qk_head_dim} + "
                         f"{mla.v_head_dim}))", layers=layers, elements_per_layer=materialised,
                         bytes_per_token=materialised * layers * item))  # fmt: skip
    ref = next(row["bytes_per_token"] for row in rows if row["model"] == KV_REF)
    for row in rows:
        row["kib_per_token"] = row["bytes_per_token"] / 1024
        row["vs_v3_latent"] = row["bytes_per_token"] / ref
    return rows


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = moe_config(args)
    with torch.inference_mode():
        prefill = bench_prefill(args, cfg)
    return dict(
        benchmark="bench_moe",
        machine=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        repeats=args.repeats,
        **prefill,
        kv_bytes=kv_table(),
    )


def show(r: dict) -> None:
    m = r["model"]
    title = (f"MoE prefill, qwen3_moe-shaped ({r['params'] / 1e6:.1f}M params: E {m['hidden']}, {m['layers']} layers, "
             f"{m['experts']} experts top-{m['top_k']}, F {m['moe_intermediate']}, V {m['vocab']}) {r['dtype']}, "
             f"{r['threads']} threads, median of {r['repeats']} interleaved")  # fmt: skip
    cols = [
        ("shape", ""),
        ("variant", ""),
        ("ms", ".1f"),
        ("ms_min", ".1f"),
        ("tok_s", ".0f"),
        ("vs_hf_eager", ".2f"),
        ("min_vs_hf_eager", ".2f"),
    ]
    console.print(table(title, r["prefill"], cols))
    c = r["logits_check"]
    impl = r["hf_experts_implementation"]
    console.print(
        f"[dim]logits check {c['shape']}: max abs diff {c['max_abs_diff']:.2e} <= {c['tolerance']:.2g} (ok)[/]"
    )
    console.print(f"[dim]hf_eager: transformers' default experts implementation ({impl}); hf_eager_loop: "
                  "experts_implementation='eager' (per-expert loop)[/]")  # fmt: skip
    console.print("[dim]vs_hf_eager: ratio of median tok/s; min_vs_hf_eager: ratio of best-run tok/s[/]")
    cols = [("model", ""), ("layout", ""), ("layers", ""), ("elements_per_layer", ","), ("bytes_per_token", ","),
            ("kib_per_token", ".1f"), ("vs_v3_latent", ".2f")]  # fmt: skip
    console.print(table("KV-cache bytes per token, all layers, bf16", r["kv_bytes"], cols))
    console.print("[dim]vs_v3_latent = bytes / DeepSeek-V3's MLA latent bytes per token[/]")


def _shape(text: str) -> tuple[int, int]:
    b, t = text.lower().split("x")
    return int(b), int(t)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=_shape, default=[(1, 512), (4, 128)], help="BxT prefills")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--atol", type=float, default=1e-4, help="logits check: atol x max(1, |logits| max)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.hidden, args.layers, args.experts, args.top_k = [(1, 32), (2, 16)], 128, 2, 4, 2
        args.moe_intermediate, args.vocab, args.repeats = 64, 256, 2
    report = run(args)
    show(report)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training-step speed and peak memory: astrai `TrainStep` vs transformers eager and compiled (CPU, fp32).

One optimizer step = forward + backward + global-norm clipping (1.0) + AdamW, on the same model config, the same
random weights and the same batch, three ways:
- astrai: `TrainStep(cfg, StepOptions(compile=True, max_grad_norm=1.0), AdamWConfig(foreach=True), ...)` over an
  `LMBatch` (loss_mask all ones, positions = arange: one document per row);
- transformers eager: `LlamaForCausalLM` (sdpa attention) built from `config_to_hf(cfg)` with astrai's weights
  loaded by name; `model(ids, labels=targets, shift_labels=targets).loss` (mean over all tokens, the same
  normalisation as astrai's sum / trained tokens), `clip_grad_norm_(1.0)`, `torch.optim.AdamW(foreach=True)` with
  the same hyperparameters and decay groups (astrai's rule: >= 2-D and no "norm"/"bias"/"embed" in the name),
  `zero_grad(set_to_none=True)`;
- transformers compiled: the same, with `model = torch.compile(model)`.

Speed: all three live in one process; each is warmed up (the compiles happen there, untimed), then repeats are
interleaved (astrai, HF eager, HF compiled, astrai, ...) so drift on a shared machine hits all three alike. We
report the median step time, tokens/s and the ratio to HF eager. Step-1 and step-2 losses of the three must agree
(same weights, same batch, same optimizer), otherwise the script fails: the comparison would not be fair.

Peak memory: each variant runs alone in its own subprocess (`--variant NAME`), so peaks do not mix.
- baseline: RSS after the imports (torch + transformers + astrai, the same in every variant), before any model.
- incl. compile: `VmHWM` (/proc/self/status) after building and the warm-up steps (compile included).
- step peak: the peak RSS is then reset (`echo 5 > /proc/self/clear_refs`, Linux) and `--mem-steps` more steps run;
  `VmHWM` after them is the most resident memory a steady-state step needs (weights, grads, AdamW moments,
  activations, compiled code, allocator caches). This is the figure the goal compares.
Not `ru_maxrss`: Linux carries the parent's peak into a forked child. Inductor's compile workers are separate
processes and are not counted.

Prints a rich table and writes JSON (also the last stdout line). `--smoke` runs a tiny config in seconds.
Usage: python benchmarks/bench_train.py [--config bench] [--batch 2] [--seq 512] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from _common import console, emit, table

from astrai.configs.models import NAMED
from astrai.data.batch import LMBatch
from astrai.io.hf import IGNORED_HF_TENSORS, astrai_to_hf_name, config_to_hf
from astrai.models.config import ModelConfig
from astrai.models.decoder import init_params
from astrai.train.optim import NO_DECAY_KEYWORDS, AdamWConfig
from astrai.train.step import StepOptions, TrainStep, init_train_state
from astrai.tree import count, named_tensors

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "cpu_bench_train.json"
VARIANTS = ("astrai", "hf_eager", "hf_compiled")
OPTIM = AdamWConfig(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
MEMORY_KEYS = ("step_peak_mib", "peak_incl_compile_mib", "baseline_mib")
SPEEDUP_GOAL = 1.3  # the goal: astrai >= 1.3x HF eager tokens/s at <= its peak memory


def bench_config() -> ModelConfig:
    """The default benchmark shape: a ~36M-parameter llama (E 512, 8 layers, 8 heads, vocab 8192, untied head)."""
    return ModelConfig(
        model_type="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip


CONFIGS: dict[str, Callable[[], ModelConfig]] = {"bench": bench_config, **NAMED}


def _status_kib(field: str) -> int:
    """A memory field (VmRSS, VmHWM) of this process from /proc/self/status, in KiB."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux clear_refs value 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def make_batch(cfg: ModelConfig, batch: int, seq: int, seed: int = 0) -> LMBatch:
    """Random next-token rows: tokens = ids[:, :T], targets = ids[:, 1:], every target trained."""
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(seq).expand(batch, seq).contiguous()
    return LMBatch(tokens=ids[:, :-1].contiguous(), targets=ids[:, 1:].contiguous(),
                   loss_mask=torch.ones(batch, seq), positions=positions)  # fmt: skip


def _decays(name: str, p: torch.Tensor) -> bool:
    """astrai's weight-decay rule (`astrai.train.optim.decay_mask`) applied to an HF parameter name."""
    return p.dim() >= 2 and not any(k in name.lower() for k in NO_DECAY_KEYWORDS)


def build_hf(cfg: ModelConfig, weights: dict[str, torch.Tensor]):
    """A transformers causal LM of `cfg` (sdpa, fp32, train mode) holding `weights` (astrai names)."""
    config = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).train()
    missing, unexpected = model.load_state_dict({astrai_to_hf_name(k): v for k, v in weights.items()}, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = [k for k in missing if k not in tied and not IGNORED_HF_TENSORS.fullmatch(k)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto the HF model: missing {missing}, unexpected {unexpected}")
    return model


def make_hf_step(cfg: ModelConfig, weights: dict[str, torch.Tensor], batch: LMBatch, compiled: bool):
    """A no-argument callable running one HF step (returns the loss as a float)."""
    model = build_hf(cfg, weights)
    named = list(model.named_parameters())
    groups = [
        dict(params=[p for n, p in named if _decays(n, p)], weight_decay=OPTIM.weight_decay),
        dict(params=[p for n, p in named if not _decays(n, p)], weight_decay=0.0),
    ]
    opt = torch.optim.AdamW(groups, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, foreach=True)
    params = [p for _, p in named]
    fwd = torch.compile(model) if compiled else model

    def step() -> float:
        loss = fwd(input_ids=batch.tokens, labels=batch.targets, shift_labels=batch.targets).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def make_astrai_step(cfg: ModelConfig, params, batch: LMBatch):
    """A no-argument callable running one astrai `TrainStep` (returns the loss as a float)."""
    state = init_train_state(params, OPTIM)
    train_step = TrainStep(cfg, StepOptions(compile=True, max_grad_norm=1.0), OPTIM, trainable=state.trainable)
    return lambda: train_step(state, [batch], OPTIM.lr)["loss"].item()


def make_step(variant: str, cfg: ModelConfig, batch: LMBatch, seed: int = 0):
    """The step callable of `variant`, starting from `init_params(cfg, seed)`."""
    params = init_params(cfg, seed=seed)
    if variant == "astrai":
        return make_astrai_step(cfg, params, batch)
    return make_hf_step(cfg, named_tensors(params), batch, compiled=variant == "hf_compiled")


def check_losses(losses: dict[str, list[float]], rtol: float) -> None:
    """Fail loudly unless every variant's loss at each warm-up step matches astrai's within `rtol`."""
    ref = losses["astrai"]
    for name, values in losses.items():
        for i, (a, b) in enumerate(zip(ref, values, strict=True)):
            if abs(a - b) > rtol * abs(a):
                raise SystemExit(f"loss mismatch at step {i + 1}: astrai {a:.6f} vs {name} {b:.6f}: unfair comparison")


def measure_memory(args) -> dict:
    """Child-process mode: build one variant, warm up, reset the peak, run steps; RSS figures in MiB."""
    cfg = CONFIGS[args.config]()
    gc.collect()
    baseline = _status_kib("VmRSS")
    step = make_step(args.variant, cfg, make_batch(cfg, args.batch, args.seq))
    losses = [step() for _ in range(args.warmup)]
    peak_incl_compile = _status_kib("VmHWM")
    gc.collect()
    _reset_peak_rss()
    for _ in range(args.mem_steps):
        step()
    return dict(variant=args.variant, baseline_mib=baseline / 1024, step_peak_mib=_status_kib("VmHWM") / 1024,
                peak_incl_compile_mib=peak_incl_compile / 1024, losses=losses)  # fmt: skip


def memory_in_subprocess(variant: str, args) -> dict:
    """Run `measure_memory` for `variant` in a fresh interpreter and parse its JSON line."""
    cmd = [sys.executable, __file__, "--variant", variant, "--config", args.config, "--batch", str(args.batch),
           "--seq", str(args.seq), "--warmup", str(args.warmup), "--mem-steps", str(args.mem_steps),
           "--threads", str(torch.get_num_threads())]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"memory run of {variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = CONFIGS[args.config]()
    batch = make_batch(cfg, args.batch, args.seq)
    tokens = args.batch * args.seq
    steps, losses, compile_s = {}, {}, {}
    for name in VARIANTS:
        console.print(f"[dim]{name}: build + {args.warmup} warm-up steps (includes any compile)...[/]")
        steps[name] = make_step(name, cfg, batch)
        start = time.perf_counter()
        losses[name] = [steps[name]() for _ in range(args.warmup)]
        compile_s[name] = time.perf_counter() - start
        console.print(f"[dim]  losses {', '.join(f'{x:.6f}' for x in losses[name])}[/]")
    check_losses(losses, args.rtol)
    console.print(f"[dim]timing {args.repeats} interleaved repeats of {', '.join(VARIANTS)}...[/]")
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name in VARIANTS:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    del steps
    gc.collect()
    memory = {}
    if args.memory:
        for name in args.memory_variants:
            console.print(f"[dim]{name}: peak memory in a subprocess...[/]")
            memory[name] = memory_in_subprocess(name, args)
        check_losses({"astrai": losses["astrai"], **{k: v["losses"] for k, v in memory.items()}}, args.rtol)
    hf_tok_s = tokens / statistics.median(times["hf_eager"])
    results = []
    for name in VARIANTS:
        med = statistics.median(times[name])
        mem = memory.get(name, {})
        results.append(dict(variant=name, step_ms=med * 1e3, step_ms_min=min(times[name]) * 1e3,
                            tok_s=tokens / med, vs_hf_eager=tokens / med / hf_tok_s,
                            warmup_s=compile_s[name], step1_loss=losses[name][0],
                            **{k: mem.get(k) for k in MEMORY_KEYS}))  # fmt: skip
    by = {r["variant"]: r for r in results}
    speedup = by["astrai"]["vs_hf_eager"]
    mem_ratio = by["astrai"]["step_peak_mib"] / by["hf_eager"]["step_peak_mib"] if memory else None
    return dict(
        benchmark="bench_train",
        config=args.config,
        model=dict(
            vocab=cfg.vocab_size,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            tied=cfg.tie_word_embeddings,
        ),  # fmt: skip
        params=count(init_params(cfg)),
        dtype="float32",
        batch=args.batch,
        seq=args.seq,
        tokens_per_step=tokens,
        warmup=args.warmup,
        repeats=args.repeats,
        machine=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        losses=losses,
        results=results,
        goal=dict(
            speedup_target=SPEEDUP_GOAL,
            speedup=speedup,
            memory_ratio=mem_ratio,
            met=speedup >= SPEEDUP_GOAL and mem_ratio is not None and mem_ratio <= 1.0,
        ),  # fmt: skip
    )


def show(r: dict) -> None:
    cols = [("variant", ""), ("step_ms", ".0f"), ("step_ms_min", ".0f"), ("tok_s", ".0f"), ("vs_hf_eager", ".2f"),
            ("step_peak_mib", ".0f"), ("peak_incl_compile_mib", ".0f"), ("baseline_mib", ".0f"),
            ("warmup_s", ".1f"), ("step1_loss", ".5f")]  # fmt: skip
    title = (f"train step, {r['config']} ({r['params'] / 1e6:.1f}M params) fp32, batch {r['batch']} x {r['seq']}, "
             f"{r['threads']} threads, median of {r['repeats']} interleaved")  # fmt: skip
    console.print(table(title, r["results"], cols))
    g = r["goal"]
    mem = "not measured" if g["memory_ratio"] is None else f"{g['memory_ratio']:.2f}x HF eager peak memory"
    verdict = "[green]met[/]" if g["met"] else "[red]not met[/]"
    console.print(f"goal astrai >= {g['speedup_target']}x HF eager tok/s at <= its peak memory: "
                  f"{g['speedup']:.2f}x, {mem}: {verdict}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="bench", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compiles); losses checked on these")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mem-steps", type=int, default=2, help="steps after the peak reset in a memory run")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True, help="per-variant peaks")
    parser.add_argument("--rtol", type=float, default=1e-4, help="allowed relative loss difference")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # memory child-process mode
    parser.add_argument("--smoke", action="store_true", help="tiny config, short rows (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.memory_variants = VARIANTS
    if args.smoke:  # the memory child processes compile again: skip the compiled-HF one to keep the smoke short
        args.config, args.batch, args.seq, args.warmup, args.repeats, args.mem_steps = "tiny", 2, 32, 2, 2, 1
        args.memory_variants = ("astrai", "hf_eager")
    if args.variant:
        torch.set_num_threads(args.threads or torch.get_num_threads())
        print(json.dumps(measure_memory(args)), flush=True)
        return 0
    report = run(args)
    show(report)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Profile one engine step: a mixed step (R decoding rows + one prefill of P new tokens) and a pure decode step.

Issue 16 item 1 asks where a step's time goes: on the H200 a decode step replays from CUDA graphs in ~3.5 ms,
while every step that carries prefill cost ~43 ms whatever its size. This script runs the engine the way
`astrai serve` does (`Engine`, compiled decode, CUDA graphs on CUDA), warms each step shape, then records one
step of each kind under `torch.profiler` and reports:

- the step's wall time (median of `--repeats` unprofiled steps of the same shape, each with a fresh prefill);
- with compiled steps, each mixed step twice: through the compiled prefill step (what the engine runs on CUDA)
  and the eager one (what it runs on CPU by default; `prefill` column). The runs alternate, so both see the
  same load on a shared machine;
- its GEMM time: the device time of the matrix-multiply kernels (CUDA: kernel names with gemm / matmul /
  cutlass / xmma; CPU: self time of aten::mm / addmm / bmm and oneDNN's packed linear), so `step / GEMM` says
  how much of the step is not GEMM (the issue's goal: <= 1.5x at >= 512 new tokens, <= 6 ms at 128 on the
  135M model on an H100/H200);
- kernels launched per step (CUDA: kernel events, graph-replayed ones included) or aten ops (CPU);
  `--fuse-projections on/off` compares the decode step with q/k/v and gate/up fused or not (issue 16 item 1);
- `--tuner-launch-at N`: mixed steps of N new tokens timed twice more, with the autotuned Triton kernels launched
  through `triton.autotune`'s per-call lookup as well as from their remembered configs (`triton_kernels/_launch.py`),
  in the same round robin;
- the top operators by self time, and a Chrome trace per step in `--trace-dir` (open in Perfetto).

Prints rich tables and the JSON report as the last stdout line. `--smoke`: a tiny config in seconds (CI).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from _common import console, emit, table, timed
from torch.profiler import ProfilerActivity, profile

import astrai
from astrai.configs.models import NAMED
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.io.model import Model, save
from astrai.models.decoder import init_params
from astrai.triton_kernels import _launch

RESULTS = Path(__file__).resolve().parent / "results" / "profile_step.json"
GEMM_KERNEL = re.compile(r"gemm|matmul|cutlass|xmma|wgmma", re.I)
FUSE = {"auto": None, "on": True, "off": False}
GEMM_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::_weight_int8pack_mm",
    "mkldnn::_linear_pointwise",
    "astrai::cpu_matvec",
}


def build(name: str, dtype: torch.dtype, device: str) -> Model:
    """Random weights of a named config (`astrai.configs.models.NAMED`), loaded the way users load a folder."""
    cfg = NAMED[name]()
    model = Model(config=cfg, params=init_params(cfg, seed=0), tokenizer=None, eos_token_ids=())
    with tempfile.TemporaryDirectory(prefix="profile_step_") as folder:  # removed after loading (up to ~1 GB)
        save(model, Path(folder))
        return astrai.load(folder, dtype=dtype, device=device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Workload:
    """R long-running decode rows; `mixed()` adds a P-token prompt and runs the step that prefills it."""

    def __init__(self, engine: Engine, rows: int, device: str) -> None:
        cfg = engine.model.config
        self.engine, self.vocab, self.device, self.seed = engine, cfg.vocab_size, device, 0
        # long enough for every step this script runs (a few dozen), within the context
        long = SamplingParams(max_tokens=min(1024, cfg.max_position_embeddings - 17), temperature=0.0, ignore_eos=True)
        self.decoders = [engine.submit(self._prompt(16), long) for _ in range(rows)]
        # prefill the rows (in chunks of the step budget) until every row has sampled, then decode a little:
        # every row decodes from here on
        running = engine.scheduler.running
        for _ in range(rows * 16 + 100):  # bounded: each step prefills at least one token
            if len(running) == rows and all(seq.outputs for seq in running):
                break
            engine.step()
        else:
            raise RuntimeError(f"the {rows} rows did not all start decoding")
        for _ in range(2):
            engine.step()

    def _prompt(self, n: int) -> list[int]:
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(3, self.vocab, (n,), generator=g).tolist()

    def mixed(self, new_tokens: int) -> None:
        """One step with the decode rows and a fresh (never cached) prompt of `new_tokens` tokens."""
        self.engine.submit(self._prompt(new_tokens), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        self.engine.step()
        _sync(self.device)

    def decode(self) -> None:
        self.engine.step()
        _sync(self.device)


def profiled(fn, device: str, trace: Path | None) -> dict:
    """Run `fn` once under the profiler: GEMM device time, kernel (or op) count, top operators."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.events()
    if device == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        gemm_us = sum(e.device_time_total for e in kernels if GEMM_KERNEL.search(e.name))
        device_us = sum(e.device_time_total for e in kernels)
        count = len(kernels)
        key = "self_device_time_total"
    else:
        ops = [e for e in events if e.name.startswith(("aten::", "mkldnn::"))]
        gemm_us = sum(e.self_cpu_time_total for e in ops if e.name in GEMM_OPS)
        device_us = None
        count = len(ops)
        key = "self_cpu_time_total"
    averages = sorted(prof.key_averages(), key=lambda a: getattr(a, key), reverse=True)
    top = [{"op": a.key[:60], "calls": a.count, "self_ms": getattr(a, key) / 1e3} for a in averages[:12]]
    return {"gemm_ms": gemm_us / 1e3, "device_ms": None if device_us is None else device_us / 1e3,
            "launches": count, "top": top}  # fmt: skip


def run(args) -> dict:
    device, dtype = args.device, getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.config, dtype, device)
    trace_dir = args.trace_dir
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
    config = EngineConfig(background=False, max_running=args.rows + 4, max_step_tokens=max(args.prefill) + args.rows,
                          kv_budget_tokens=args.rows * 1024 + 4 * max(args.prefill), prefix_cache=False,
                          compile=not args.no_compile, compile_prefill=not args.eager_prefill,
                          fuse_projections=FUSE[args.fuse_projections])  # fmt: skip
    rows = []
    with Engine(model, config) as engine:
        work = Workload(engine, args.rows, device)
        runner, compiled = engine.runner, engine.runner.compiled_prefill
        modes = ["compiled", "eager"] if compiled is not None else ["eager"]

        cache_configs = _launch.CACHE_CONFIGS

        def step_mode(shape: tuple) -> None:
            # the prefill path, and how autotuned Triton kernels launch (remembered config or the tuner's lookup)
            runner.compiled_prefill = compiled if shape[2] == "compiled" else None
            _launch.CACHE_CONFIGS = shape[3] == "cached"

        shapes = [("decode", 0, "-", "cached")]
        for p in args.prefill:
            launches = ("cached", "tuner") if p in args.tuner_launch_at else ("cached",)
            shapes += [("mixed", p, m, launch) for m in modes for launch in launches]
        times = {shape: [] for shape in shapes}
        steps = {shape: work.decode if shape[0] == "decode" else (lambda n=shape[1]: work.mixed(n)) for shape in shapes}
        for shape in shapes:  # compile, autotune, capture
            step_mode(shape)
            for _ in range(args.warmup):
                steps[shape]()
        for _ in range(args.repeats):  # round robin: every shape sees the machine's load of the same minutes
            for shape in shapes:
                step_mode(shape)
                times[shape].append(timed(steps[shape], 1)[0])
        for shape in shapes:
            kind, new, mode, launch = shape
            step_mode(shape)
            name = f"step_{kind}_{new}_{mode}" + ("_tuner" if launch == "tuner" else "")
            trace = trace_dir / f"{name}.json" if trace_dir is not None else None
            prof = profiled(steps[shape], device, trace)
            ms = statistics.median(times[shape])
            rows.append({"step": kind, "new_tokens": new, "decode_rows": args.rows, "prefill": mode, "launch": launch,
                         "ms": ms, "ms_min": min(times[shape]), "ms_max": max(times[shape]), **prof,
                         "x_gemm": ms / prof["gemm_ms"] if prof["gemm_ms"] else None,
                         "trace": str(trace) if trace else None})  # fmt: skip
        runner.compiled_prefill, _launch.CACHE_CONFIGS = compiled, cache_configs
        fused = engine.runner.model is not engine.model  # the engine serves a fused copy
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"benchmark": "profile_step", "config": args.config, "device": name, "dtype": args.dtype,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "compiled": not args.no_compile,
            "fused_projections": fused, "kernels_per_decode_step": next(r["launches"] for r in rows),
            "repeats": args.repeats, "rows": rows}  # fmt: skip


def show(r: dict) -> None:
    layout = "q/k/v and gate/up fused" if r["fused_projections"] else "projections apart"
    title = f"one engine step, {r['config']} {r['dtype']} on {r['device']}, {layout} (median of {r['repeats']})"
    console.print(table(title,
                        r["rows"], [("step", "s"), ("new_tokens", "d"), ("decode_rows", "d"), ("prefill", "s"),
                                    ("launch", "s"), ("ms", ".2f"), ("gemm_ms", ".2f"), ("x_gemm", ".2f"),
                                    ("launches", "d")]))  # fmt: skip
    for row in r["rows"]:
        title = f"top operators by self time: {row['step']} step, {row['new_tokens']} new tokens"
        title += f", {row['prefill']} prefill" if row["step"] == "mixed" else ""
        title += ", launched through the autotuner" if row["launch"] == "tuner" else ""
        console.print(table(title, row["top"], [("op", "s"), ("calls", "d"), ("self_ms", ".3f")]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, default=8, help="decoding sequences in every step")
    parser.add_argument("--prefill", type=int, nargs="+", default=[128, 512, 2048], help="new tokens of a mixed step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true", help="eager steps (EngineConfig(compile=False))")
    parser.add_argument("--eager-prefill", action="store_true", help="mixed steps through the eager prefill only")
    parser.add_argument(
        "--fuse-projections",
        choices=sorted(FUSE),
        default="auto",
        help="q/k/v and gate/up as one GEMM each (EngineConfig.fuse_projections; auto: on CUDA)",
    )
    parser.add_argument(
        "--tuner-launch-at",
        type=int,
        nargs="*",
        default=[],
        help="also time mixed steps of these new-token counts with every autotuned Triton kernel launched through "
        "triton.autotune's per-call lookup (ASTRAI_TRITON_TUNED_LAUNCH=0), against the remembered config (CUDA)",
    )
    parser.add_argument("--trace-dir", type=Path, default=None, help="write one Chrome trace per step kind here")
    parser.add_argument("--smoke", action="store_true", help="tiny config, few tokens (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.smoke:
        args.config, args.rows, args.prefill, args.warmup, args.repeats = "tiny", 2, [16], 1, 2
    report = run(args)
    show(report)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

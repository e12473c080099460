"""Run every GPU fast path's start check on a device, confirmed or not, and record the results as JSON.

The engine checks the fast paths no GPU run has confirmed (`astrai.inference.fast_paths`: the fused rotary + KV
store, the tuned launch, fused projections, the compiled prefill) once at start on CUDA and falls back when one
fails. This script runs the same checks verbosely, on random models of real widths (2 layers of each named
config, a 4096-token vocabulary), changing no switch: each path's confirmed and fast variants on the probe, their
relative error against the tolerance, and the wall time of a first pass (Triton JIT compiles and autotuning
included) and of a second (what an engine start pays once the kernels are cached). When every check of a path
passes, the report's `records` holds the `Confirmation(date, gpu, commit)` to copy into its `FastPath` entry
(and docs/inference.md's table), after which engines stop checking it. `benchmarks/run_gpu_perf.sh` runs it first.
On a CPU only fused projections (and, without --no-compile, the compiled prefill) are checked: the kernel paths
need the Triton backend.

    python benchmarks/check_fast_paths.py --device cuda --out benchmarks/results/fast_paths.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import attrs
import torch
from _common import console, emit, table

from astrai.configs.models import NAMED
from astrai.inference import fast_paths
from astrai.inference.runner import ModelRunner
from astrai.io.model import Model
from astrai.models.decoder import init_params
from astrai.ops.attention import pages_needed
from astrai.tree import tree_map

RESULTS = Path(__file__).resolve().parent / "results" / "fast_paths.json"
ROOT = Path(__file__).resolve().parent.parent


def build(name: str, *, layers: int, vocab: int, dtype: torch.dtype, device: str) -> Model:
    """Random weights of `name`'s widths with `layers` layers and a `vocab`-token vocabulary."""
    cfg = attrs.evolve(NAMED[name](), num_hidden_layers=layers, vocab_size=vocab)
    params = tree_map(lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype),
                      init_params(cfg, seed=0))  # fmt: skip
    return Model(config=cfg, params=params, tokenizer=None, eos_token_ids=())


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return out.stdout.strip() + ("+local-changes" if dirty else "") if out.returncode == 0 else None
    except OSError:
        return None


def check(model: Model, *, page_size: int, compile_prefill: bool) -> list[dict]:
    """Two passes of every check on `model` (the second times a warm start); one row per path."""
    runner = None
    if compile_prefill:
        pages = 4 * len(fast_paths.PROBE_LENGTHS) * pages_needed(max(fast_paths.PROBE_LENGTHS), page_size) + 1
        runner = ModelRunner(model, num_pages=pages, page_size=page_size, compile=True, compile_prefill=True,
                             max_running=4, max_model_len=64, cuda_graphs=False)  # fmt: skip
    first = fast_paths.confirm(model, page_size=page_size, runner=runner)
    second = fast_paths.confirm(model, page_size=page_size, runner=runner)
    rows = []
    for a, b in zip(first, second, strict=True):
        rows.append({**attrs.asdict(b), "ok": a.ok and b.ok, "detail": a.detail if not a.ok else b.detail,
                     "first_ms": a.ms, "ms": b.ms})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--configs", nargs="+", default=["qwen3-0.6b", "smollm2-135m"], choices=sorted(NAMED),
                        help="widths to check (qwen3: qk-norm in the fused store; smollm2: head_dim 64)")  # fmt: skip
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--compile-prefill-on", nargs="*", default=None,
                        help="configs whose compiled prefill step is checked (compiles it: ~10-30 s each on a GPU); "
                        "default: the first of --configs")  # fmt: skip
    parser.add_argument("--no-compile", action="store_true", help="check no compiled prefill step")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    compiled = [] if args.no_compile else args.compile_prefill_on or args.configs[:1]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {
        "date": datetime.date.today().isoformat(), "device": device_name, "commit": commit(),
        "torch": torch.__version__, "triton": _triton_version(), "page_size": args.page_size, "results": [],
    }  # fmt: skip
    for name in args.configs:
        for dtype in args.dtypes:
            model = build(name, layers=args.layers, vocab=args.vocab, dtype=getattr(torch, dtype), device=args.device)
            for row in check(model, page_size=args.page_size, compile_prefill=name in compiled):
                report["results"].append({"config": name, "dtype": dtype, **row})
            args.out.parent.mkdir(parents=True, exist_ok=True)  # kept after each model: a timeout leaves what ran
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    paths = {r["name"] for r in report["results"]}
    passed = sorted(p for p in paths if all(r["ok"] for r in report["results"] if r["name"] == p))
    report["failed"] = sorted(paths - set(passed))
    report["not_checked"] = sorted({p.name for p in fast_paths.FAST_PATHS} - paths)
    report["records"] = {p: {"date": report["date"], "gpu": device_name, "commit": report["commit"]}
                         for p in passed} if args.device == "cuda" else {}  # fmt: skip
    columns = [("config", ""), ("dtype", ""), ("name", ""), ("ok", ""), ("error", ".2e"), ("tolerance", ".0e"),
               ("first_ms", ".1f"), ("ms", ".1f"), ("detail", "")]  # fmt: skip
    console.print(table(f"GPU fast path checks on {device_name}", report["results"], columns))
    emit(report, args.out)
    return 1 if report["failed"] else 0


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())

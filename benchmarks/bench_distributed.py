"""FSDP and tensor parallel on CPU (gloo, 2 ranks): per-rank parameter memory and step time, whole-model gather vs
per block (`astrai.train.fsdp`) vs tensor parallel (`astrai.train.tp`).

The script spawns its own 2 rank processes (plain `python`, gloo on 127.0.0.1; no torchrun). Every rank builds the
same random decoder (`--preset`), shards it (`shard_tree`: every leaf `Shard(0)`) and runs one `TrainStep` per
mode on the same global batches (`--batch` rows of `--seq` tokens per rank, fp32 AdamW, clipping 1.0, eager):
- `model`: `fsdp_unit="model"`, the whole tree all-gathered at the start of each micro-batch;
- `block`: `fsdp_unit="block"`, each unit (embedding, every block, final norm + LM head) gathered just for its
  call and again for its backward, the next block's gather issued while the current one computes (prefetch,
  the default: two blocks alive at the peak);
- `block_no_prefetch`: the same, one unit at a time (`--no-fsdp-prefetch`);
- `block_bf16`: per block with the shards cast to bf16 before the all-gather (`fsdp_param_dtype`), bf16 autocast
  compute, gradients reduce-scattered in fp32 (a different compute dtype: its step time is not comparable on CPU);
- `tp`: tensor parallel over the same 2 ranks (`--tp 2`): each rank holds half of every matrix (norms replicated)
  and runs the whole global batch (both ranks' rows); nothing is gathered, activations are all-reduced instead.
  Its losses must equal the whole-model gather's (<= 1e-4), otherwise the script fails.
Repeats are interleaved (model, block, block_no_prefetch, block_bf16, model, ...) after one warm-up step each, so
drift on a shared machine hits all alike; we report the median step time.

Memory, per rank: `shard MiB` is this rank's share of the weights (1/R of each leaf, padded); `peak gathered MiB`
is the most full-size gathered parameter storage alive at once during a step (`track_gathered`: weak references to
every gathered storage, sampled after each all-gather), the figure per-block gathering bounds by the largest unit;
`param peak MiB` is their sum. Gradients and AdamW moments are sharded alike in every mode and left out.
The per-block and whole-model losses must agree (<= 1e-5), otherwise the script fails.

Prints a rich table and writes JSON (also the last stdout line). `--smoke` runs a tiny model in seconds.
Usage: python benchmarks/bench_distributed.py [--preset small|medium] [--steps 5] [--batch 2] [--seq 128]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import console, emit, table

from astrai.data.batch import LMBatch
from astrai.models.config import ModelConfig
from astrai.models.decoder import init_params
from astrai.train.optim import AdamWConfig
from astrai.train.step import StepOptions, TrainStep, init_train_state
from astrai.tree import leaves

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "cpu_bench_distributed.json"
WORLD = 2
MODES = {  # name -> (fsdp unit, gather dtype, prefetch)
    "model": ("model", None, False),
    "block": ("block", None, True),
    "block_no_prefetch": ("block", None, False),
    "block_bf16": ("block", torch.bfloat16, True),
}
PRESETS = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "smoke": (64, 128, 2, 2, 1, 256),
    "small": (256, 768, 8, 4, 2, 4096),
    "medium": (512, 1536, 12, 8, 4, 16384),
}
MIB = 2**20


def model_config(preset: str) -> ModelConfig:
    hidden, inter, layers, heads, kv, vocab = PRESETS[preset]
    return ModelConfig(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads, max_position_embeddings=2048,
        tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip


def unit_mib(cfg: ModelConfig) -> dict[str, float]:
    """Full fp32 MiB of the whole model, its largest block and its embedding / head units (padded to 2 shards)."""
    params = init_params(cfg, seed=0)

    def size(tree: object) -> float:
        return sum(math.ceil(t.shape[0] / WORLD) * WORLD * t[0].numel() * t.element_size() for t in leaves(tree)) / MIB

    head = size(params.norm) + size(params.lm_head if params.lm_head is not None else params.embed_tokens)
    return {"model": size(params), "largest_block": max(size(b) for b in params.blocks),
            "embedding": size(params.embed_tokens), "head": head}  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def batches(cfg: ModelConfig, rows: int, seq: int, count: int, rank: int) -> list[LMBatch]:
    """This rank's rows of `count` global batches (the same on every run)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        every = torch.randint(0, cfg.vocab_size, (rows * WORLD, seq + 1), generator=gen)
        tokens = every[rank * rows : (rank + 1) * rows]
        out.append(LMBatch(tokens=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=torch.ones(rows, seq),
                           positions=torch.arange(seq).repeat(rows, 1)))  # fmt: skip
    return out


def rank_main(args: argparse.Namespace) -> None:
    """One rank: every mode's step, interleaved; writes this rank's measurements to `args.rank_out`."""
    import torch.distributed as dist

    from astrai.models.tp import shard_params
    from astrai.train.fsdp import make_mesh, shard_tree, track_gathered
    from astrai.train.tp import TPTrain, make_layout

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = model_config(args.preset)
    mesh = make_mesh(torch.device("cpu"))
    optim = AdamWConfig(lr=1e-3)
    runs = {}
    for name, (unit, dtype, prefetch) in MODES.items():
        state = init_train_state(shard_tree(init_params(cfg, seed=0), mesh), optim)
        opts = StepOptions(max_grad_norm=1.0, compile=False, autocast_dtype=dtype)
        step = TrainStep(cfg, opts, optim, trainable=state.trainable, sharded=True, fsdp_unit=unit,
                         fsdp_param_dtype=dtype, fsdp_prefetch=prefetch)  # fmt: skip
        runs[name] = (step, state)
    # tensor parallel over the same 2 ranks: each rank runs the whole global batch on half of every matrix
    layout = make_layout(WORLD, rank, WORLD, torch.device("cpu"))
    state = init_train_state(shard_params(init_params(cfg, seed=0), cfg, layout.tp), optim)
    step = TrainStep(cfg, StepOptions(max_grad_norm=1.0, compile=False), optim, trainable=state.trainable,
                     tp=TPTrain(cfg, layout.tp, sharded=False), dp_group=layout.dp_group)  # fmt: skip
    runs["tp"] = (step, state)
    names = [*MODES, "tp"]
    shard_mib = {name: sum(_local(t).untyped_storage().nbytes() for t in leaves(state.trainable)) / MIB
                 for name, (_, state) in runs.items()}  # fmt: skip
    data = batches(cfg, args.batch, args.seq, args.steps + 1, rank)
    everyone = [batches(cfg, args.batch, args.seq, args.steps + 1, r) for r in range(WORLD)]
    fields = ("tokens", "targets", "loss_mask", "positions")
    whole = [LMBatch(*(torch.cat([getattr(b[i], f) for b in everyone]) for f in fields))
             for i in range(args.steps + 1)]  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, int] = dict.fromkeys(names, 0)
    losses: dict[str, list[float]] = {name: [] for name in names}
    for i, batch in enumerate(data):
        for name, (step, state) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            with track_gathered() as stats:
                metrics = step(state, [whole[i] if name == "tp" else batch], 1e-3)
            loss = metrics["loss"].item()
            elapsed = time.perf_counter() - t0
            peaks[name] = max(peaks[name], stats.peak_bytes)
            losses[name].append(loss)
            if i > 0:  # the first step of each mode is its warm-up
                times[name].append(elapsed)
    result = {"rank": rank, "shard_mib": shard_mib, "peak_gathered_mib": {k: v / MIB for k, v in peaks.items()},
              "step_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "losses": losses}  # fmt: skip
    Path(args.rank_out).with_suffix(f".{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def spawn(args: argparse.Namespace) -> list[dict]:
    """Run the 2 ranks; their measurements, rank order."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        stem = Path(tmp) / "rank"
        sizes = ["--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)]
        cmd = [sys.executable, __file__, "--worker", "--rank-out", str(stem), "--preset", args.preset, *sizes,
               "--threads", str(args.threads)]  # fmt: skip
        env = {**os.environ, "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": str(args.threads)}  # fmt: skip
        procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE,
                                  text=True) for r in range(WORLD)]  # fmt: skip
        try:
            errs = [p.communicate(timeout=args.timeout)[1] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for p, err in zip(procs, errs, strict=True):
            if p.returncode != 0:
                raise RuntimeError(f"a rank failed (exit {p.returncode}):\n{err[-3000:]}")
        return [json.loads(stem.with_suffix(f".{r}.json").read_text()) for r in range(WORLD)]


def run(args: argparse.Namespace) -> dict:
    cfg = model_config(args.preset)
    per_rank = spawn(args)
    ref, got = per_rank[0]["losses"]["model"], per_rank[0]["losses"]["block"]
    worst = max(abs(a - b) for a, b in zip(ref, got, strict=True))
    if worst > 1e-5:
        raise RuntimeError(f"per-block and whole-model losses differ by {worst}: the comparison would not be fair")
    units = unit_mib(cfg)
    tp_worst = max(abs(a - b) for a, b in zip(ref, per_rank[0]["losses"]["tp"], strict=True))
    if tp_worst > 1e-4:
        raise RuntimeError(f"tensor-parallel and whole-model losses differ by {tp_worst}")
    rows = []
    for name in [*MODES, "tp"]:
        peak = max(r["peak_gathered_mib"][name] for r in per_rank)
        shard = max(r["shard_mib"][name] for r in per_rank)
        rows.append({"mode": name, "shard_mib": shard, "peak_gathered_mib": peak, "param_peak_mib": shard + peak,
                     "step_ms": max(r["step_ms"][name] for r in per_rank)})  # fmt: skip
    return {
        "benchmark": "bench_distributed",
        "preset": args.preset,
        "world_size": WORLD,
        "backend": "gloo",
        "model": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size},
        "units_mib": units,
        "batch_per_rank": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "threads_per_rank": args.threads,
        "results": rows,
        "losses": {name: per_rank[0]["losses"][name] for name in [*MODES, "tp"]},
        "max_loss_diff_block_vs_model": worst,
        "max_loss_diff_tp_vs_model": tp_worst,
        "host": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
    }


def show(report: dict) -> None:
    u = report["units_mib"]
    title = (
        f"FSDP and TP on {report['world_size']} gloo ranks, preset {report['preset']}: "
        f"full model {u['model']:.2f} MiB, largest block {u['largest_block']:.2f}, "
        f"embedding {u['embedding']:.2f}, head {u['head']:.2f}"
    )
    cols = [("mode", ""), ("shard_mib", ".2f"), ("peak_gathered_mib", ".2f"), ("param_peak_mib", ".2f"),
            ("step_ms", ".1f")]  # fmt: skip
    console.print(table(title, report["results"], cols))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode (after one warm-up)")
    parser.add_argument("--batch", type=int, default=2, help="rows per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--smoke", action="store_true", help="a tiny model (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        rank_main(args)
        return 0
    if args.smoke:
        args.preset, args.steps, args.batch, args.seq = "smoke", 2, 1, 32
    report = run(args)
    show(report)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

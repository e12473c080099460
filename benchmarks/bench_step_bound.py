"""What a bf16 single-stream CPU decode step costs without the framework around it (issue 16 item 4).

Item 4 asks bf16 batch-1 decode to run at >= 60% of its read roofline (every weight byte once per token at the
probed memory bandwidth). astrai's compiled decode step reaches that only when the box's memory is in its slow state
(docs/benchmarks.md). This script measures how close a step with no Python, Dynamo, inductor wrapper, per-product op
dispatch or per-product thread start-up gets: `prototypes/whole_step_bf16.c` runs every layer and the LM head in
one call, in one OpenMP region. It is a prototype: its rotation uses a fixed angle, its weights are random, and its
output is not checked against a model. It has the shapes, bytes and about the arithmetic of the real step.

Both arms take the same config and context (`--context` tokens cached, then `--steps` decode steps per round):
- `astrai compiled`: `decode_step` compiled as the engine compiles it (`step.SERVED_STEP_OPTIONS`), on random bf16
  weights, over the paged cache;
- `whole-step prototype`: the C call on random bf16 weights of the same shapes (q/k/v and gate/up stacked).

Rounds alternate between the arms, each preceded by a bandwidth probe (best of 3 sums of 1 GiB of fp32): per-round
roofline fractions against the round's probe, medians with min-max. Prints a rich table, then the JSON report as
the last stdout line. `--smoke`: the tiny config, a few steps.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import torch
from _common import console, emit, table
from bench_forward import _timed, memory_bandwidth_gbs
from profile_step import build

from astrai.configs.models import NAMED
from astrai.cpu_kernels import library, matvec
from astrai.inference.cache import init_kv_cache, make_attn_meta
from astrai.inference.step import SERVED_STEP_OPTIONS, compile_step, decode_step, prefill_step
from astrai.ops.attention import pages_needed

RESULTS = Path(__file__).resolve().parent / "results" / "bench_step_bound.json"
SOURCE = Path(__file__).resolve().parent / "prototypes" / "whole_step_bf16.c"
PAGE = 16


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("qkv", "o", "gate_up", "down", "attn_norm", "mlp_norm",
                                                      "k_cache", "v_cache")]  # fmt: skip


def prototype(cfg, context: int, steps: int):
    """The prototype's step as a zero-argument callable, and the tensors it reads (kept alive with it)."""
    lib = ctypes.CDLL(str(library._build(library._compiler(), sources=(SOURCE,), stem="whole_step_prototype",
                                         flags=("-O3", "-fopenmp", "-shared", "-fPIC", "-lm"))))  # fmt: skip
    E, F, H, KH, D = _dims(cfg)
    kept = []

    def weights(*shape: int, scale: float = 0.02) -> int:
        kept.append((torch.randn(*shape) * scale).bfloat16())
        return kept[-1].data_ptr()

    layers = (_Layer * cfg.num_hidden_layers)()
    for i in range(cfg.num_hidden_layers):
        layers[i] = _Layer(weights((H + 2 * KH) * D, E), weights(E, H * D), weights(2 * F, E), weights(E, F),
                           weights(E, scale=1.0), weights(E, scale=1.0), weights(context + steps, KH, D, scale=1.0),
                           weights(context + steps, KH, D, scale=1.0))  # fmt: skip
    head = weights(cfg.vocab_size, E)
    x, logits = torch.randn(E), torch.zeros(cfg.vocab_size)
    scratch, half = torch.zeros((H + 2 * KH) * D + 2 * F + E), torch.zeros(2 * (E + F + H * D), dtype=torch.bfloat16)
    kept += [x, logits, scratch, half]
    threads = torch.get_num_threads()

    def run() -> None:
        for i in range(steps):
            lib.whole_step(layers, cfg.num_hidden_layers, ctypes.c_void_p(head), ctypes.c_long(cfg.vocab_size),
                           ctypes.c_void_p(x.data_ptr()), ctypes.c_long(E), ctypes.c_long(F), H, KH, D,
                           ctypes.c_long(context + i), ctypes.c_void_p(logits.data_ptr()),
                           ctypes.c_void_p(scratch.data_ptr()), ctypes.c_void_p(half.data_ptr()), threads)  # fmt: skip
            x.clamp_(-4, 4)  # random weights: keep the residual stream finite

    return run, kept


def compiled_astrai(model, context: int, steps: int):
    """astrai's compiled decode step over `steps` positions after a `context`-token prefill, as a callable."""
    cfg = model.config
    pages = [list(range(1, 1 + pages_needed(context + steps + 1, PAGE)))]
    cache = init_kv_cache(cfg, len(pages[0]) + 1, PAGE, dtype=model.dtype, device="cpu")
    prompt = torch.randint(0, cfg.vocab_size, (context,))
    meta = make_attn_meta(pages, [0], [context], page_size=PAGE, device="cpu")
    token = prefill_step(model.params, prompt, meta, cache, torch.tensor([context - 1]), cfg=cfg).argmax(-1)
    decode = compile_step(decode_step, cfg=cfg, options=SERVED_STEP_OPTIONS)
    metas = [make_attn_meta(pages, [context + i], [1], page_size=PAGE, device="cpu", decode=True) for i in range(steps)]

    def run() -> None:
        nonlocal token
        for m in metas:  # the same positions every round: the same attention work
            token = decode(model.params, token, m, cache).argmax(-1)

    return run


def _dims(cfg) -> tuple[int, int, int, int, int]:
    return cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim


def weight_bytes(cfg) -> int:
    """bf16 bytes a decode step reads: every layer's weights and the LM head (norm gains included)."""
    E, F, H, KH, D = _dims(cfg)
    per_layer = (H + 2 * KH) * D * E + E * H * D + 3 * F * E + 2 * E
    return 2 * (cfg.num_hidden_layers * per_layer + cfg.vocab_size * E)


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = NAMED[args.config]()
    if not matvec.supports(torch.bfloat16):  # the prototype needs what the bf16 matvec kernel needs
        return {"benchmark": "bench_step_bound", "skipped": matvec.unavailable_reason(torch.bfloat16), "results": []}
    with torch.inference_mode():
        model = build(args.config, torch.bfloat16, "cpu")
        proto, _tensors = prototype(cfg, args.context, args.steps)  # the tensors stay alive while the C reads them
        arms = {"astrai compiled": compiled_astrai(model, args.context, args.steps), "whole-step prototype": proto}
        for fn in arms.values():  # compile, warm caches
            fn()
        rounds = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, fn in arms.items():
                gbs = memory_bandwidth_gbs(256 if args.smoke else 1024, 3)  # bench_forward's paired probe
                rounds[name].append((_timed(fn) / args.steps * 1e3, gbs))
    nbytes = weight_bytes(cfg)
    rows = []
    for name, pairs in rounds.items():
        ms = [m for m, _ in pairs]
        fractions = [nbytes / (gbs * 1e9) * 1e3 / m for m, gbs in pairs]
        rows.append({"arm": name, "ms": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                     "roofline": statistics.median(fractions), "roofline_min": min(fractions),
                     "roofline_max": max(fractions),
                     "rounds": [{"ms": m, "probe_gbs": g} for m, g in pairs]})  # fmt: skip
    return {"benchmark": "bench_step_bound", "config": args.config, "dtype": "bfloat16", "context": args.context,
            "steps": args.steps, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "weight_bytes": nbytes, "results": rows,
            "speedup": rows[0]["ms"] / rows[1]["ms"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--context", type=int, default=512, help="tokens in the cache before the timed steps")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="the tiny config, a few steps (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.context, args.steps, args.rounds = "tiny", 16, 2, 2
    report = run(args)
    if report.get("skipped"):
        console.print(f"skipped: {report['skipped']}")
        emit(report, args.out)
        return 0
    title = (f"bf16 decode step, {report['config']}, {report['context']} tokens of context "
             f"(median of {args.rounds} rounds; roofline against each round's probe)")  # fmt: skip
    console.print(table(title, report["results"], [("arm", "s"), ("ms", ".2f"), ("ms_min", ".2f"), ("ms_max", ".2f"),
                                                   ("roofline", ".0%"), ("roofline_min", ".0%"),
                                                   ("roofline_max", ".0%")]))  # fmt: skip
    console.print(f"prototype / astrai: {report['speedup']:.2f}x faster")
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Structured output on CPU: what a JSON schema costs a batch of 16 requests, and the per-token mask time.

One engine (compiled decode, stepped on this thread as in bench_engine.py) serves `--requests` requests of
`--prompt-len` random tokens, sampling at temperature 0.8 with one seed per request, in two modes, `--repeats`
times each after a warm-up of both:
- json_schema: `response_format`-style JSON schema (an order object: strings with a pattern and an enum,
  integers with bounds, an array of items), `--new` tokens at most; a finished grammar ends the request (and
  budget-aware closing steers the ends of long ones);
- free: no constraint, and each request generates exactly as many tokens as the same request did under the
  schema in that repeat (`ignore_eos`, max_tokens = that length), so both modes do the same work with the same
  batch shape over time and the throughput ratio is the cost of the constraint alone.
Per mode: output tok/s (tokens actually generated / wall), TTFT p50 and inter-token latency p50/p99; for the
schema mode, the share of outputs that parse and validate (jsonschema), and finish reasons. The ratio
json_schema / free is the throughput cost of constraining every row. Then the mask time alone: the schema
outputs' tokens replayed through fresh matchers, one `fill_bitmask` per token (one row), and the 16 rows of a
step at once (`fill_bitmask_batch`, llguidance's thread pool), in microseconds.

The model is SmolLM2-135M-shaped with random weights; its vocabulary is a byte-level BPE of the same size
(49,152 tokens) trained locally (bench_grammar.py's corpus, cached under $TMPDIR/astrai_bench_grammar).
Usage: python benchmarks/bench_structured.py [--repeats 3]; `--smoke` (tiny model, 4k vocabulary) in seconds.
Prints rich tables, then the JSON report as the last stdout line (also written to results/bench_structured.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import jsonschema
import torch
from _common import console, emit, table
from bench_engine import engine_run, pct, prompts
from bench_grammar import build_tokenizer

from astrai.configs.models import NAMED
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.grammar import accept, allocate_bitmask, fill_bitmask, fill_bitmask_batch, new_matcher
from astrai.inference.params import GrammarSpec, SamplingParams
from astrai.io.model import Model
from astrai.models.decoder import init_params

RESULTS = Path(__file__).resolve().parent / "results" / "bench_structured.json"
SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "pattern": "^[A-Za-z ]{1,40}$"},
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 999}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "note": {"type": "string"},
    },
    "required": ["customer", "status", "items"],
    "additionalProperties": False,
}


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def build(args) -> Model:
    """The named config with random weights and a locally trained BPE of its vocabulary size."""
    cfg = NAMED[args.config]()
    tok = build_tokenizer(args.vocab or cfg.vocab_size, Path(tempfile.gettempdir()) / "astrai_bench_grammar")
    cfg = attrs.evolve(cfg, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_ids)
    return Model(config=cfg, params=init_params(cfg, seed=0), tokenizer=tok, eos_token_ids=tok.eos_token_ids)


def _params(mode: str, args, seed: int, length: int) -> SamplingParams:
    base = SamplingParams(max_tokens=length, temperature=0.8, seed=seed)
    if mode == "free":
        return attrs.evolve(base, ignore_eos=True)
    return attrs.evolve(base, grammar=GrammarSpec(kind="json_schema", source=json.dumps(SCHEMA)))


def measure(engine: Engine, batch: list[list[int]], mode: str, args, seed: int, lengths: list[int]) -> dict:
    params = [_params(mode, args, seed + i, n) for i, n in enumerate(lengths)]
    run = engine_run(engine, batch, args.new, params)
    outs = [o for c in run["completions"] for o in c.outputs]
    reasons: dict[str, int] = {}
    for o in outs:
        reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
    return dict(tok_s=run["tok_s"], tokens=run["tokens"], wall_s=run["wall_s"], ttft_p50=pct(run["ttft"], 50),
                itl_p50=pct(run["itl"], 50), itl_p99=pct(run["itl"], 99), finish=reasons,
                valid=sum(_valid(o.text) for o in outs if o.finish_reason == "stop"),
                steered=sum(o.stop_reason == "budget" for o in outs),
                outputs=[o.token_ids for o in outs])  # fmt: skip


def mask_times(engine: Engine, outputs: list[tuple[int, ...]]) -> dict:
    """Microseconds per mask: the schema outputs replayed token by token, one row at a time and all rows at once."""
    grammar = engine.compile_grammar(GrammarSpec(kind="json_schema", source=json.dumps(SCHEMA)))
    view = grammar.view
    single, batched = [], []
    matchers = [new_matcher(grammar) for _ in outputs]
    bitmask = allocate_bitmask(len(outputs), view.vocab_size)
    for step in range(max(map(len, outputs))):
        live = [(m, r) for r, (m, out) in enumerate(zip(matchers, outputs, strict=True)) if step < len(out)]
        start = time.perf_counter()
        fill_bitmask_batch(view, live, bitmask)
        batched.append((time.perf_counter() - start) / len(live) * 1e6)
        for m, r in live:
            start = time.perf_counter()
            fill_bitmask(m, bitmask[r])
            single.append((time.perf_counter() - start) * 1e6)
            accept(m, outputs[r][step])
    return dict(vocab=view.vocab_size, single_us_p50=pct(single, 50), single_us_p99=pct(single, 99),
                batched_us_per_row_p50=pct(batched, 50), masks=len(single))  # fmt: skip


def _summary(runs: list[dict]) -> dict:
    rates = [r["tok_s"] for r in runs]
    keys = ("ttft_p50", "itl_p50", "itl_p99")
    return dict(tok_s=statistics.median(rates), tok_s_min=min(rates), tok_s_max=max(rates),
                **{k: statistics.median(r[k] for r in runs) for k in keys},
                tokens=statistics.median(r["tokens"] for r in runs))  # fmt: skip


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model = build(args)
    engine = Engine(model, EngineConfig(max_running=args.requests, background=False, compile=not args.eager,
                                        kv_budget_tokens=args.requests * (args.prompt_len + args.new) * 2))  # fmt: skip
    grammar_s = time.perf_counter()
    engine.prepare_grammar()
    grammar_s = time.perf_counter() - grammar_s
    batch = prompts(args.requests, args.prompt_len, model.config.vocab_size, 5)
    full = [args.new] * len(batch)
    for mode in ("free", "json_schema"):  # warm-up: compile the decode step, compile the schema
        measure(engine, batch, mode, args, 0, full)
    runs: dict[str, list[dict]] = {"free": [], "json_schema": []}
    for r in range(args.repeats):
        engine.invalidate_prefix_cache()  # every run prefills its prompts (no radix hits across runs)
        runs["json_schema"].append(measure(engine, batch, "json_schema", args, 1000 * (r + 1), full))
        lengths = [max(len(o), 1) for o in runs["json_schema"][-1]["outputs"]]
        engine.invalidate_prefix_cache()
        runs["free"].append(measure(engine, batch, "free", args, 1000 * (r + 1), lengths))
    schema_runs = runs["json_schema"]
    outputs = schema_runs[-1]["outputs"]
    masks = mask_times(engine, [o for o in outputs if o])
    engine.shutdown()
    rows = []
    for mode, rs in (("free", runs["free"]), ("json_schema", runs["json_schema"])):
        row = dict(mode=mode, **_summary(rs))
        if mode == "json_schema":
            stops = sum(r["finish"].get("stop", 0) for r in rs)
            row.update(valid=sum(r["valid"] for r in rs), finished=stops, outputs=args.requests * len(rs),
                       steered=sum(r["steered"] for r in rs), finish=schema_runs[-1]["finish"])  # fmt: skip
        rows.append(row)
    rows[1]["vs_free"] = rows[1]["tok_s"] / rows[0]["tok_s"]
    return dict(benchmark="bench_structured", config=args.config, vocab=model.config.vocab_size,
                threads=torch.get_num_threads(), machine=platform.processor() or platform.machine(),
                torch=torch.__version__, requests=args.requests, prompt_len=args.prompt_len, new_tokens=args.new,
                repeats=args.repeats, compiled=not args.eager, grammar_view_s=grammar_s, rows=rows,
                masks=masks)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--vocab", type=int, default=0, help="tokenizer size (default: the config's)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--eager", action="store_true", help="no torch.compile of the decode step")
    parser.add_argument("--smoke", action="store_true", help="tiny config, 4k vocabulary, few tokens (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.vocab, args.requests, args.prompt_len, args.new, args.repeats = "tiny", 4096, 4, 8, 16, 1
        args.eager = True
    report = run(args)
    cols = [("mode", ""), ("tok_s", ".1f"), ("tok_s_min", ".1f"), ("tok_s_max", ".1f"), ("vs_free", ".3f"),
            ("tokens", ".0f"), ("ttft_p50", ".3f"), ("itl_p50", ".4f"), ("itl_p99", ".4f"), ("valid", "d"),
            ("finished", "d"), ("steered", "d"), ("outputs", "d")]  # fmt: skip
    console.print(table(f"{report['requests']} concurrent requests, {report['config']} (vocab {report['vocab']:,}), "
                        f"{report['prompt_len']}-token prompts, up to {report['new_tokens']} new, temperature 0.8; "
                        f"median of {report['repeats']}", report["rows"], cols))  # fmt: skip
    m = report["masks"]
    console.print(f"mask time at {m['vocab']:,} tokens: one row p50 {m['single_us_p50']:.1f} us (p99 "
                  f"{m['single_us_p99']:.1f}), batched {m['batched_us_per_row_p50']:.1f} us per row "
                  f"({m['masks']} masks); grammar view built in {report['grammar_view_s']:.2f} s")  # fmt: skip
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

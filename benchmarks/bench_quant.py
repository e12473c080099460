"""int8 weight-only quantization on CPU: decode speed and what it costs in quality.

Speed (random weights of a named config, SmolLM2-135M by default; the same weights on every row): single-stream
greedy decode through `astrai.generate_ids`, the notebook path, on its cached compiled engine, for the model in
fp32 and bf16, each unquantized and `quantize="int8"`. Per row: first call (engine build + compile), then the
median tok/s of `--repeats` whole calls with min/max (the calls alternate between the variants, round by
round), the weight bytes one decode step reads and the GB/s that makes (the machine's read bandwidth is measured
in the same run), and the ratio to fp32. transformers `generate` (eager, fp32, same weights) is the context row.

Batched decode (`--step-rows R [R ...]`): the engine's compiled decode step with R requests decoding, for the
same four weight variants, each on its own `Engine` (`background=False`) in this process: after a warm-up, `--rounds`
rounds of 12 steps per variant, the variants in alternating order, so each sees the same minutes of a shared
machine. Per variant and R: the median of the round medians in ms (min-max), and the ratio to fp32.

Quality (`--quality-model`, default `runs/quickstart/model`, the model `make run` trains, when it exists), on
the quickstart's held-out problems, unquantized vs int8: perplexity of the whole chats through `astrai eval
ppl`'s code (`astrai.eval.ppl.evaluate`); perplexity of the answers given their questions (the tokens the SFT
model was trained on: the question tokens were masked out of its loss, so the whole-chat figure is dominated by
them) through the same scorer; and greedy exact-match accuracy. Random weights say nothing about quality, so
this part needs trained weights; it is skipped (and says so) when the folder is missing.

Usage: python benchmarks/bench_quant.py [--config smollm2-135m] [--new 64] [--repeats 5]; `--smoke` in seconds.
Prints rich tables, then the JSON report as the last stdout line (also written to results/bench_quant.json).
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

import torch
from _common import console, emit, table
from bench_engine import build, hf_generate, prompts
from bench_forward import memory_bandwidth_gbs

import astrai
from astrai.configs.models import NAMED
from astrai.io.model import Model
from astrai.models.quantize import quantize_params

RESULTS = Path(__file__).resolve().parent / "results" / "bench_quant.json"
QUICKSTART_MODEL = Path(__file__).resolve().parent.parent / "runs" / "quickstart" / "model"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_bytes(model: Model) -> int:
    """Weight bytes one decode step reads: every tensor but the embedding table (one row is looked up), which
    counts once more when it is also the (tied) LM head."""
    tied = model.params.lm_head is None
    embed = model.params.embed_tokens
    table_bytes = embed.weight.nbytes + (0 if embed.scale is None else embed.scale.nbytes)
    return model.nbytes - (0 if tied else table_bytes)


def speed_rows(base: Model, prompt: list[list[int]], args, hf_tok_s: float) -> list[dict]:
    variants = [("float32", None), ("float32", "int8"), ("bfloat16", None), ("bfloat16", "int8")]
    variants = variants[:2] if args.smoke else variants  # smoke: each variant compiles its own engine
    models, rows = [], []
    for dtype, quantize in variants:
        params = base.params if dtype == "float32" else astrai.tree.tree_map(lambda t: t.to(torch.bfloat16),
                                                                              base.params)  # fmt: skip
        if quantize:
            params = quantize_params(params, quantize)
        models.append(Model(config=base.config, params=params, tokenizer=base.tokenizer,
                            eos_token_ids=base.eos_token_ids))  # fmt: skip

    def call(m: Model) -> list[list[int]]:
        return astrai.generate_ids(m, prompt, max_tokens=args.new, stop_token_ids=[])

    first = [_timed(lambda m=m: call(m)) for m in models]  # each builds and compiles its cached engine
    # then `repeats` rounds over every variant, in alternating order: a shared box's slow and fast minutes (its
    # bandwidth moves between ~44 and ~76 GB/s) fall on all of them, not on whichever ran last
    seconds: list[list[float]] = [[] for _ in models]
    for r in range(args.repeats):
        order = range(len(models)) if r % 2 == 0 else reversed(range(len(models)))
        for i in order:
            seconds[i].append(_timed(lambda m=models[i]: call(m)))
    for (dtype, quantize), model, first_s, times in zip(variants, models, first, seconds, strict=True):
        rates = [args.new / s for s in times]
        nbytes = decode_bytes(model)
        rows.append(dict(weights=f"{dtype}{' + int8' if quantize else ''}", first_call_s=first_s,
                         tok_s=statistics.median(rates), tok_s_min=min(rates), tok_s_max=max(rates),
                         decode_mib=nbytes / 2**20, gbs=nbytes * statistics.median(rates) / 1e9,
                         tokens=call(model)[0]))  # fmt: skip
    for model in models:
        astrai.release_engines(model)
    fp32 = rows[0]["tok_s"]
    for row in rows:
        row["vs_fp32"] = row["tok_s"] / fp32
        row["vs_hf"] = row["tok_s"] / hf_tok_s
    return rows


def step_rows(base: Model, args) -> list[dict]:
    """ms per compiled decode step with R decoding requests, per weight variant (see the module docstring)."""
    from profile_step import Workload

    from astrai.inference.engine import Engine, EngineConfig

    variants = {}
    for dtype in ("float32", "bfloat16"):
        params = base.params if dtype == "float32" else astrai.tree.tree_map(lambda t: t.to(torch.bfloat16),
                                                                              base.params)  # fmt: skip
        for quantize in (None, "int8"):
            name = f"{dtype}{' + int8' if quantize else ''}"
            variants[name] = Model(config=base.config, params=quantize_params(params, quantize) if quantize else params,
                                   tokenizer=None, eos_token_ids=())  # fmt: skip
    rows_out = []
    for rows in args.step_rows:
        cfg = EngineConfig(background=False, max_running=rows + 4, max_step_tokens=256, prefix_cache=False)
        engines = {name: Engine(model, cfg) for name, model in variants.items()}
        try:
            loads = {name: Workload(engine, rows, "cpu") for name, engine in engines.items()}
            for load in loads.values():  # compiles this row count's graph
                for _ in range(3):
                    load.decode()
            rounds: dict[str, list[float]] = {name: [] for name in loads}
            for r in range(args.rounds):
                for name in list(loads) if r % 2 == 0 else list(loads)[::-1]:
                    times = []
                    for _ in range(12):
                        start = time.perf_counter()
                        loads[name].decode()
                        times.append(1e3 * (time.perf_counter() - start))
                    rounds[name].append(statistics.median(times))
        finally:
            for engine in engines.values():
                engine.shutdown()
        fp32 = statistics.median(rounds["float32"])
        for name, values in rounds.items():
            ms = statistics.median(values)
            rows_out.append(dict(weights=name, rows=rows, step_ms=ms, step_ms_min=min(values), step_ms_max=max(values),
                                 vs_fp32=fp32 / ms))  # fmt: skip
        summary = ", ".join(f"{n} {statistics.median(v):.1f} ms" for n, v in rounds.items())
        console.print(f"[dim]{rows} rows: {summary}")
    return rows_out


def quality_rows(folder: Path, args) -> list[dict]:
    import math

    from astrai.eval import ppl
    from astrai.eval.scoring import Request, score
    from astrai.quickstart.evaluate import evaluate
    from astrai.quickstart.task import split_problems, to_chat

    _, held_out = split_problems("add2", seed=0)
    held_out = held_out[: args.problems]
    tok = astrai.load(folder).tokenizer
    chats = [tok.apply_chat_template(to_chat(p), add_generation_prompt=False, tokenize=True) for p in held_out]
    questions = [len(tok.apply_chat_template(to_chat(p, with_answer=False), tokenize=True)) for p in held_out]
    answers = [Request(tokens=c, start=q) for c, q in zip(chats, questions, strict=True)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "heldout.jsonl"
        data.write_text("".join(json.dumps({"text": tok.decode(c, skip_special_tokens=False)}) + "\n"
                                for c in chats))  # fmt: skip
        for quantize in (None, "int8"):
            report = ppl.evaluate(ppl.Config(model=str(folder), data=data, quantize=quantize, device="cpu"))
            model = astrai.load(folder, quantize=quantize)
            scores = score(model, answers, batch_size=64)
            answer_nll = -sum(s.logprobs.sum().item() for s in scores) / sum(len(s.logprobs) for s in scores)
            result = evaluate(model, held_out)
            astrai.release_engines(model)
            rows.append(dict(weights="float32" + (" + int8" if quantize else ""), mib=model.nbytes / 2**20,
                             ppl=report.metrics["ppl"], tokens=report.metrics["tokens"],
                             answer_ppl=math.exp(answer_nll), answer_tokens=sum(len(s.logprobs) for s in scores),
                             accuracy=result.accuracy, correct=result.correct, problems=result.n))  # fmt: skip
    rows[1]["ppl_change"] = rows[1]["ppl"] / rows[0]["ppl"] - 1
    rows[1]["answer_ppl_change"] = rows[1]["answer_ppl"] / rows[0]["answer_ppl"] - 1
    return rows


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    bandwidth = memory_bandwidth_gbs(256 if args.smoke else 1024)
    with tempfile.TemporaryDirectory() as tmp:
        hf, model = build(args.config, torch.float32, Path(tmp), "cpu")
    prompt = prompts(1, args.prompt_len, model.config.vocab_size, 1)
    hf_generate(hf, prompt, 4)  # warm-up
    hf_rates = [args.new / hf_generate(hf, prompt, args.new) for _ in range(args.repeats)]
    hf_tok_s = statistics.median(hf_rates)
    del hf
    speed = speed_rows(model, prompt, args, hf_tok_s)
    speed.insert(0, dict(weights="transformers generate, float32 (eager)", tok_s=hf_tok_s, tok_s_min=min(hf_rates),
                         tok_s_max=max(hf_rates), vs_fp32=hf_tok_s / speed[0]["tok_s"], vs_hf=1.0))  # fmt: skip
    fp32_tokens, int8_tokens = speed[1]["tokens"], speed[2]["tokens"]
    # random weights give near-tied logits, so greedy paths part after a while: report where
    agree = next((i for i, (a, b) in enumerate(zip(fp32_tokens, int8_tokens, strict=True)) if a != b), len(fp32_tokens))
    for row in speed:
        row.pop("tokens", None)
    steps = step_rows(model, args) if args.step_rows else []
    folder = args.quality_model
    quality = quality_rows(folder, args) if folder is not None and (folder / "config.json").is_file() else []
    return dict(benchmark="bench_quant", config=args.config, threads=torch.get_num_threads(),
                machine=platform.processor() or platform.machine(), torch=torch.__version__,
                memory_read_gbs=bandwidth, prompt_len=args.prompt_len, new_tokens=args.new, repeats=args.repeats,
                int8_greedy_tokens_before_divergence=agree, speed=speed, steps=steps,
                quality_model=str(folder) if quality else None, quality=quality)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m", choices=sorted(NAMED))
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--quality-model", type=Path, default=QUICKSTART_MODEL)
    parser.add_argument("--problems", type=int, default=810, help="held-out quickstart problems scored")
    parser.add_argument("--step-rows", type=int, nargs="*", default=[], help="batched decode: ms per engine step")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per --step-rows entry")
    parser.add_argument("--smoke", action="store_true", help="tiny config, few tokens (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.prompt_len, args.new, args.repeats, args.problems = "tiny", 8, 8, 2, 32
    report = run(args)
    cols = [("weights", ""), ("first_call_s", ".1f"), ("tok_s", ".1f"), ("tok_s_min", ".1f"), ("tok_s_max", ".1f"),
            ("vs_fp32", ".2f"), ("vs_hf", ".2f"), ("decode_mib", ".1f"), ("gbs", ".1f")]  # fmt: skip
    console.print(table(f"single-stream decode, {report['config']}, {report['prompt_len']}-token prompt, "
                        f"{report['new_tokens']} new, {report['threads']} threads, astrai.generate_ids (cached "
                        f"compiled engine); median of {report['repeats']}; read bandwidth "
                        f"{report['memory_read_gbs']:.1f} GB/s", report["speed"], cols))  # fmt: skip
    if report["steps"]:
        scols = [("weights", ""), ("rows", "d"), ("step_ms", ".2f"), ("step_ms_min", ".2f"), ("step_ms_max", ".2f"),
                 ("vs_fp32", ".2f")]  # fmt: skip
        console.print(table(f"compiled decode step, R requests decoding, median of {args.rounds} alternating rounds "
                            "(min-max); vs_fp32 > 1 is faster", report["steps"], scols))  # fmt: skip
    if report["quality"]:
        qcols = [("weights", ""), ("mib", ".2f"), ("ppl", ".4f"), ("tokens", "d"), ("ppl_change", "+.3%"),
                 ("answer_ppl", ".5f"), ("answer_tokens", "d"), ("answer_ppl_change", "+.3%"), ("accuracy", ".4f"),
                 ("correct", "d"), ("problems", "d")]  # fmt: skip
        console.print(table(f"quality: {report['quality_model']} on held-out quickstart problems",
                            report["quality"], qcols))  # fmt: skip
    else:
        console.print(f"[yellow]quality skipped: no model at {args.quality_model} (run `make run` first)")
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

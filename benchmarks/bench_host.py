"""Engine host overhead per step, without model compute: metadata, the sampling batch, scheduling + delivery.

On a GPU a decode step of a small model takes a few milliseconds (2.8 ms for 64 rows of a 135M model on an
H200, docs/benchmarks.md), so the Python around the step sets the throughput. This measures that Python on any
machine (CPU tensors; on a GPU the same code adds host-to-device copies):
  meta      `ModelRunner._host_meta`: tokens, positions, slots, lengths and block table of R decode rows whose
            contexts hold C tokens.
  sampling  `make_sampling_batch` for R rows that have generated G tokens, over a V-token vocabulary: plain
            (temperature), with frequency + presence penalties ([R, V] counts), and with a repetition penalty
            (which also reads the prompt into an [R, V] mask).
  detok     one token per step into R incremental detokenizers (a byte-level BPE tokenizer trained locally).
  engine    whole `Engine.step` calls (scheduler, runner bookkeeping, delivery; no tokenizer) with the model step
            stubbed out: R requests decoding, contexts of C tokens.
Medians of repeated calls, in microseconds per step. Prints rich tables, then the JSON report as the last line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch
from _common import console, emit, table

from astrai.configs.models import tiny
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.inference.plan import SampledToken, ScheduledSeq
from astrai.inference.runner import ModelRunner
from astrai.inference.sampling_batch import make_sampling_batch
from astrai.inference.seq import Seq
from astrai.io.model import Model
from astrai.models.decoder import init_params

RESULTS = Path(__file__).resolve().parent / "results" / "bench_host.json"
PAGE = 16


def median_us(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def tiny_model(context: int) -> Model:
    cfg = attrs.evolve(tiny(), max_position_embeddings=context + 256)
    return Model(config=cfg, params=init_params(cfg))


def decoding_requests(rows: int, context: int, generated: int, params: SamplingParams) -> list[Seq]:
    """`rows` requests of `context` tokens (prompt + `generated` outputs) with their pages assigned."""
    out = []
    for i in range(rows):
        prompt = [(i + j) % 500 + 1 for j in range(context - generated)]
        req = Seq(id=str(i), index=0, prompt=prompt, params=params, seed=i, arrival=i)
        req.outputs += [7] * generated
        req.pages = list(range(1 + i * (context // PAGE + 1), 1 + (i + 1) * (context // PAGE + 1)))
        out.append(req)
    return out


def bench_meta(rows: int, context: int, repeats: int) -> dict:
    runner = ModelRunner(tiny_model(context), num_pages=2, page_size=PAGE, compile=False, max_running=rows,
                         max_model_len=context + 256)  # fmt: skip
    reqs = decoding_requests(rows, context, 1, SamplingParams())
    plan = [ScheduledSeq(seq=r, start=r.num_tokens - 1, num_new=1, sample=True) for r in reqs]
    width = max(len(r.pages) for r in reqs)
    us = median_us(lambda: runner._host_meta(plan, decode=True, rows=rows, width=width), repeats)
    return dict(component="meta", rows=rows, context=context, generated=None, variant="decode", us_per_step=us)


def bench_sampling(rows: int, context: int, generated: int, vocab: int, repeats: int) -> list[dict]:
    variants = {
        "plain": SamplingParams(temperature=0.7, ignore_eos=True),
        "frequency+presence": SamplingParams(frequency_penalty=0.5, presence_penalty=0.2, ignore_eos=True),
        "repetition": SamplingParams(repetition_penalty=1.1, ignore_eos=True),
    }
    out = []
    for name, params in variants.items():
        reqs = decoding_requests(rows, context, generated, params)

        def build(reqs=reqs, params=params):
            for r in reqs:  # one more token per step, as in decoding
                r.outputs.append(7)
            make_sampling_batch([params] * rows, seeds=[r.seed for r in reqs], steps=[len(r.outputs) for r in reqs],
                                vocab_size=vocab, device="cpu", prompts=[r.prompt_array() for r in reqs],
                                outputs=[r.output_array() for r in reqs], stop_ids=[[0]] * rows)  # fmt: skip

        out.append(dict(component="sampling", rows=rows, context=context, generated=generated, variant=name,
                        us_per_step=median_us(build, repeats)))  # fmt: skip
    return out


def bench_detokenize(rows: int, repeats: int) -> dict:
    from astrai.io.tokenizer import train_tokenizer

    text = "the quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. " * 8
    tok = train_tokenizer([text], vocab_size=400)
    ids = tok.encode(text * 4)
    streams = [tok.detokenizer(prompt_ids=ids[:8]) for _ in range(rows)]
    position = iter(range(10**9))

    def step():
        token = ids[next(position) % len(ids)]
        for stream in streams:
            stream.add(token)

    us = median_us(step, repeats)
    return dict(component="detok", rows=rows, context=None, generated=None, variant="add one token",
                us_per_step=us)  # fmt: skip


def bench_engine_steps(rows: int, context: int, repeats: int) -> dict:
    model = tiny_model(context)
    config = EngineConfig(
        max_running=rows,
        compile=False,
        background=False,
        page_size=PAGE,
        kv_budget_tokens=rows * (context + 2 * repeats + 64),
        max_step_tokens=rows * context,
    )
    params = SamplingParams(max_tokens=2 * repeats + 8, temperature=0.0, ignore_eos=True)
    with Engine(model, config) as engine:
        engine.runner.execute = lambda plan, vocab_size: {i: SampledToken(1) for i, it in enumerate(plan) if it.sample}
        for i in range(rows):
            engine.submit([(i + j) % 500 + 1 for j in range(context)], params)  # distinct prompts: no prefix hits
        engine.step()  # the prefill step (stubbed too): everyone is decoding afterwards
        us = median_us(engine.step, repeats)
        while engine.step():
            pass
    return dict(component="engine", rows=rows, context=context, generated=None, variant="decode step",
                us_per_step=us)  # fmt: skip


def run(args) -> dict:
    torch.set_num_threads(1)
    results = []
    for rows in args.rows:
        for context in args.contexts:
            results.append(bench_meta(rows, context, args.repeats))
            results.append(bench_engine_steps(rows, context, args.repeats))
        results += bench_sampling(rows, args.contexts[-1], args.generated, args.vocab, args.repeats)
        results.append(bench_detokenize(rows, args.repeats))
    return dict(benchmark="bench_host", torch=torch.__version__, batch_sizes=args.rows, contexts=args.contexts,
                generated=args.generated, vocab=args.vocab, results=results)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--generated", type=int, default=1000, help="tokens generated so far (sampling section)")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary of the sampling batch (SmolLM2's)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="small sizes, few repeats (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.contexts, args.generated, args.repeats = [4], [64], 32, 3
    report = run(args)
    console.print(table("engine host time per step (µs, median)", report["results"],
                        [("component", ""), ("variant", ""), ("rows", ""), ("context", ""), ("generated", ""),
                         ("us_per_step", ".0f")]))  # fmt: skip
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speculative decoding (n-gram prompt lookup) against the same engine without it, alternating, batch 1 and 4.

Method. One random model of the named shape (SmolLM2-135M by default) with a trained tokenizer
(`bench_serve.build_model`); two engines on it, compiled, foreground stepping, one with
`speculative={"method": "ngram", ...}`. Each round times `Engine.run_batch` on both, alternating which goes
first; the table reports the median tok/s of each with its min-max, the ratio of medians, the tokens per verified
round (mean acceptance length + 1), the acceptance rate and the roofline fraction *equivalent* (tok/s x weight
bytes / measured read bandwidth, the bandwidth probed once per round). Outputs must be token-identical in every
run (the script exits 1 otherwise).

Workloads (random weights cannot edit text, so these bound what the method can do on this machine):
- `repeat`: greedy; a random model's greedy output falls into a loop, so nearly every guess passes: the upper
  bound of the speed-up, and what the verify step costs when it always wins.
- `nothing`: seeded sampling at temperature 1 from a random prompt: nothing to copy, guesses nearly always fail:
  the cost of trying (goal >= 0.95x, held by the adaptive k).
Not yet here (issue 43): the edit workload on a trained model and the distilled draft pair.

Prints a rich table and the JSON report as the last stdout line.
Usage: python benchmarks/bench_spec.py [--config smollm2-135m] [--rounds 3] [--new-tokens 128] [--k 4]
       [--lookup 5 5] [--batch 1 4] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "bench_spec.json"


def _measure(engine, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = engine.run_batch(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, [o.outputs[0].token_ids for o in outs]


def run(args: argparse.Namespace) -> dict:
    import torch
    from bench_forward import memory_bandwidth_gbs
    from bench_serve import build_model

    from astrai.inference.engine import Engine, EngineConfig
    from astrai.inference.params import SamplingParams

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args.config, args.vocab)
    weight_bytes = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(model.params))
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup[0],
            "prompt_lookup_max": args.lookup[1]}  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    workloads = {
        "repeat": (SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True),
                   lambda: list(range(10, 10 + args.prompt // 2)) * 2),
        "nothing": (SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=7, ignore_eos=True),
                    lambda: torch.randint(3, model.config.vocab_size, (args.prompt,), generator=gen).tolist()),
    }  # fmt: skip
    results, identical = [], True
    for name, (params, make_prompt) in workloads.items():
        for batch in args.batch:
            prompts = [make_prompt() for _ in range(batch)]
            engines = {arm: Engine(model, EngineConfig(compile=True, kv_budget_tokens=8192, max_running=max(4, batch),
                                                       background=False, speculative=spec if arm == "ngram" else None))
                       for arm in ("plain", "ngram")}  # fmt: skip
            try:
                for engine in engines.values():
                    engine.run_batch(prompts, params)  # compiles and warms
                rates: dict[str, list[float]] = {"plain": [], "ngram": []}
                bandwidths = []
                before = engines["ngram"].stats()
                for r in range(args.rounds):
                    bandwidths.append(memory_bandwidth_gbs(1024, 3))
                    order = ("plain", "ngram") if r % 2 == 0 else ("ngram", "plain")
                    outputs = {}
                    for arm in order:
                        rate, outputs[arm] = _measure(engines[arm], prompts, params)
                        rates[arm].append(rate)
                    identical &= outputs["plain"] == outputs["ngram"]
                after = engines["ngram"].stats()
            finally:
                for engine in engines.values():
                    engine.shutdown()
            drafts = after.spec_drafts - before.spec_drafts
            proposed = after.spec_draft_tokens - before.spec_draft_tokens
            accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
            bw = statistics.median(bandwidths)
            row = dict(workload=name, batch=batch, k=args.k,
                       plain_tok_s=statistics.median(rates["plain"]), plain_range=[min(rates["plain"]),
                       max(rates["plain"])], ngram_tok_s=statistics.median(rates["ngram"]),
                       ngram_range=[min(rates["ngram"]), max(rates["ngram"])],
                       tokens_per_round=(accepted + drafts) / drafts if drafts else 0.0,
                       acceptance=accepted / proposed if proposed else 0.0, bandwidth_gbs=bw)  # fmt: skip
            row["ratio"] = row["ngram_tok_s"] / row["plain_tok_s"]
            # per-stream equivalent: a batch of B reads the weights once per step for B streams
            row["roofline_equiv"] = row["ngram_tok_s"] / batch * weight_bytes / (bw * 1e9)
            results.append(row)
    return dict(benchmark="bench_spec", config=args.config, threads=args.threads, rounds=args.rounds, spec=spec,
                new_tokens=args.new_tokens, prompt_tokens=args.prompt, weight_bytes=weight_bytes,
                identical=identical, results=results)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--lookup",
        type=int,
        nargs=2,
        default=[5, 5],
        metavar=("MIN", "MAX"),
        help="prompt_lookup_min and _max (vLLM's defaults: 5 and 5)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 round, 16 tokens, batch 1 (CI)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.vocab, args.rounds, args.new_tokens, args.prompt, args.batch = "tiny", 300, 1, 16, 32, [1]
    from _common import console, emit, table

    report = run(args)
    cols = [
        ("workload", ""),
        ("batch", ""),
        ("plain_tok_s", ".1f"),
        ("ngram_tok_s", ".1f"),
        ("ratio", ".2f"),
        ("tokens_per_round", ".2f"),
        ("acceptance", ".2f"),
        ("roofline_equiv", ".2f"),
        ("bandwidth_gbs", ".1f"),
    ]
    console.print(table(f"n-gram speculation vs plain decoding ({report['config']}, median of {args.rounds})",
                        report["results"], cols))  # fmt: skip
    emit(report, args.out)
    if not report["identical"]:
        print("outputs differ between the engines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speculative decoding (n-gram prompt lookup and draft models) against the same engine without it, alternating.

Method. Two engines on the same weights, compiled, foreground stepping, one with `speculative=...`. Each round
times `Engine.run_batch` on both, alternating which goes first; the table reports the median tok/s of each with
its min-max, the ratio of medians and the median of the round-by-round ratios, the tokens per verified round
(mean acceptance length + 1), the acceptance rate and the roofline fraction *equivalent* (tok/s x weight bytes /
measured read bandwidth, the bandwidth probed once per round; a draft's weights are not counted). Outputs must be
token-identical in every run (the script exits 1 otherwise).

Workloads (`--workloads`):
- `repeat` (ngram, random SmolLM2-135M-shaped weights): greedy; a random model's greedy output falls into a
  loop, so nearly every guess passes: the method's upper bound, and what the verify step costs when it wins.
- `nothing` (ngram, same weights): seeded sampling at temperature 1 from a random prompt: nothing to copy, guesses
  nearly always fail: the cost of trying (goal >= 0.95x, held by the adaptive k).
- `prefix-draft` (draft, same shape): the target's blocks after the first `--prefix-layers` damped 100x and the
  draft = those first blocks (shared embeddings and head; >= 4x fewer weight bytes): the draft's guesses mostly
  pass, so this bounds what the draft machinery gives on a bandwidth-bound target (synthetic, like `repeat`).
- `edit` (ngram): a small model trained through the quickstart machinery to rename a variable in a code snippet
  (`spec_edit_task.py`, trained once into runs/spec_edit): real acceptance on output that copies its prompt.
- `edit-draft` (draft): the same model with a draft distilled from it (`astrai train distill`, >= 4x smaller,
  runs/spec_edit/draft), on the same prompts.

Prints a rich table and the JSON report as the last stdout line.
Usage: python benchmarks/bench_spec.py [--workloads repeat nothing prefix-draft edit edit-draft] [--rounds 3]
       [--new-tokens 128] [--k 4] [--lookup 5 5] [--batch 1 4] [--draft DIR] [--draft-steps stepwise]
       [--device cuda --dtype bfloat16] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "bench_spec.json"
WORKLOADS = ("repeat", "nothing", "prefix-draft", "edit", "edit-draft")


def _measure(engine, groups, params) -> tuple[float, list]:
    """Output tok/s over `groups` (lists of prompts, each group run as one batch, one after another)."""
    start, outs = time.perf_counter(), []
    for prompts in groups:
        run = engine.run_batch if isinstance(prompts[0], list) else engine.generate
        outs += run(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, [o.outputs[0].token_ids for o in outs]


def _weight_bytes(model) -> int:
    import torch

    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(model.params))


def compare(model, prompts, params, spec: dict, *, rounds: int, batch: int, name: str, stepwise: bool = False
            ) -> tuple[dict, bool]:  # fmt: skip
    """One workload row: a plain and a speculating engine on `model`, `rounds` alternating timed runs each;
    `stepwise`: a draft model's steps run one compiled call each instead of one graph per round (for comparison)."""
    from bench_forward import memory_bandwidth_gbs

    from astrai.inference.engine import Engine, EngineConfig

    if model.device.type == "cuda":  # the GPU's read bandwidth from the peaks table (or one measured copy)
        import torch
        from _common import device_peaks

        peak = device_peaks(torch.cuda.get_device_name())[0] / 1e9

        def memory_bandwidth_gbs(*_args) -> float:
            return peak

    engines = {arm: Engine(model, EngineConfig(compile=True, kv_budget_tokens=8192, max_running=max(4, batch),
                                               background=False, speculative=spec if arm == "spec" else None))
               for arm in ("plain", "spec")}  # fmt: skip
    if stepwise and engines["spec"].draft is not None:
        engines["spec"].draft.chained = None  # `DraftProposer._propose` then steps
    identical = True
    try:
        for engine in engines.values():
            _measure(engine, prompts, params)  # compiles and warms
        rates: dict[str, list[float]] = {"plain": [], "spec": []}
        bandwidths = []
        before = engines["spec"].stats()
        for r in range(rounds):
            bandwidths.append(memory_bandwidth_gbs(1024, 3))
            outputs = {}
            for arm in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
                rate, outputs[arm] = _measure(engines[arm], prompts, params)
                rates[arm].append(rate)
            identical &= outputs["plain"] == outputs["spec"]
        after = engines["spec"].stats()
    finally:
        for engine in engines.values():
            engine.shutdown()
    drafts = after.spec_drafts - before.spec_drafts
    proposed = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    bw = statistics.median(bandwidths)
    row = dict(workload=name, method=spec.get("method", "draft"), batch=batch, k=spec["num_speculative_tokens"],
               draft_steps=("stepwise" if stepwise else "chained") if "model" in spec else None,
               plain_tok_s=statistics.median(rates["plain"]), plain_range=[min(rates["plain"]), max(rates["plain"])],
               spec_tok_s=statistics.median(rates["spec"]), spec_range=[min(rates["spec"]), max(rates["spec"])],
               tokens_per_round=(accepted + drafts) / drafts if drafts else 0.0,
               acceptance=accepted / proposed if proposed else 0.0, bandwidth_gbs=bw, identical=identical)  # fmt: skip
    row["ratio"] = row["spec_tok_s"] / row["plain_tok_s"]
    # round by round (each round runs both arms back to back): steadier than the ratio of medians on a noisy box
    paired = [s / p for p, s in zip(rates["plain"], rates["spec"], strict=True)]
    row["ratio_by_round"] = dict(median=statistics.median(paired), min=min(paired), max=max(paired), runs=paired)
    # per-stream equivalent: a batch of B reads the weights once per step for B streams
    row["roofline_equiv"] = row["spec_tok_s"] / batch * _weight_bytes(model) / (bw * 1e9)
    return row, identical


def _prefix_pair(model, layers: int, folder: Path):
    """`model` with its blocks after the first `layers` damped 100x, and its first `layers` blocks saved as a
    draft in `folder` (the same tokenizer, embeddings and head)."""
    import attrs
    import torch

    from astrai.io.model import Model, save

    with torch.no_grad():
        for block in model.params.blocks[layers:]:
            block.attn.o_proj.weight.mul_(0.01)
            block.mlp.down_proj.weight.mul_(0.01)
    draft = Model(config=attrs.evolve(model.config, num_hidden_layers=layers),
                  params=attrs.evolve(model.params, blocks=model.params.blocks[:layers]), tokenizer=model.tokenizer,
                  eos_token_ids=model.eos_token_ids)  # fmt: skip
    return str(save(draft, folder)), _weight_bytes(draft)


def run(args: argparse.Namespace) -> dict:
    import tempfile

    import attrs
    import torch
    from bench_serve import build_model

    import astrai
    from astrai.inference.params import SamplingParams
    from astrai.tree import cast, to_device

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup[0],
             "prompt_lookup_max": args.lookup[1]}  # fmt: skip
    # the edit workload's own lookup (`--edit-k`, `--edit-lookup`): the best measured for copying text (docs)
    edit_ngram = {"num_speculative_tokens": args.edit_k, "prompt_lookup_min": args.edit_lookup[0],
                  "prompt_lookup_max": args.edit_lookup[1]}  # fmt: skip
    if args.edit_disable_by_batch_size:
        edit_ngram["disable_by_batch_size"] = args.edit_disable_by_batch_size
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    results, identical, info = [], True, {}

    def add(name, model, make_prompts, params, spec, batches):
        nonlocal identical
        for batch in batches:
            groups = make_prompts(batch)
            groups = groups if isinstance(groups, tuple) else (groups,)  # a tuple: batches run one after another
            row, same = compare(model, groups, params, spec, rounds=args.rounds, batch=batch, name=name,
                                stepwise=args.draft_steps == "stepwise")  # fmt: skip
            results.append(row)
            identical &= same

    random_names = {"repeat", "nothing", "prefix-draft"} & set(args.workloads)
    if random_names:
        model = build_model(args.config, args.vocab)
        model = attrs.evolve(model, params=to_device(cast(model.params, dtype), args.device))
        info["random_weight_bytes"] = _weight_bytes(model)
        if "repeat" in args.workloads:
            add("repeat", model, lambda b: [list(range(10, 10 + args.prompt // 2)) * 2 for _ in range(b)], greedy,
                ngram, args.batch)  # fmt: skip
        if "nothing" in args.workloads:
            sampled = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=7, ignore_eos=True)
            add("nothing", model, lambda b: [torch.randint(3, model.config.vocab_size, (args.prompt,),
                                                           generator=gen).tolist() for _ in range(b)],
                sampled, ngram, args.batch)  # fmt: skip
        if "prefix-draft" in args.workloads:
            with tempfile.TemporaryDirectory() as tmp:
                draft_dir, info["prefix_draft_weight_bytes"] = _prefix_pair(model, args.prefix_layers, Path(tmp))
                spec = {"model": draft_dir, "num_speculative_tokens": args.k}
                add("prefix-draft", model, lambda b: [torch.randint(3, model.config.vocab_size, (args.prompt,),
                                                                    generator=gen).tolist() for _ in range(b)],
                    greedy, spec, [1])  # fmt: skip
    if {"edit", "edit-draft"} & set(args.workloads):
        from spec_edit_draft import build_edit_draft
        from spec_edit_task import build_edit_model, edit_prompts

        model_dir = build_edit_model(args.edit_dir)
        model = astrai.load(model_dir, dtype=dtype, device=args.device)
        info["edit_weight_bytes"] = _weight_bytes(model)
        answer = SamplingParams(max_tokens=args.edit_tokens, temperature=0.0)  # the answer ends with EOS
        # never trained on; the same prompts at every batch size, in batches of b run one after another (one
        # prompt's acceptance is not the workload's: it ranged 2.5-3.7 tokens per round between prompts)
        count = max(args.edit_prompts, max(args.batch))
        prompts = edit_prompts(count, seed=0)

        def batches(b: int) -> tuple[list[str], ...]:
            return tuple(prompts[i : i + b] for i in range(0, count - count % b or b, b))

        if "edit" in args.workloads:
            add("edit", model, batches, answer, {**ngram, **edit_ngram}, args.batch)
        if "edit-draft" in args.workloads:
            draft_dir = args.draft or build_edit_draft(args.edit_dir)
            info["edit_draft_weight_bytes"] = _weight_bytes(astrai.load(draft_dir, dtype=dtype))
            add("edit-draft", model, batches, answer,
                {"model": str(draft_dir), "num_speculative_tokens": args.k}, [1])  # fmt: skip
    return dict(benchmark="bench_spec", config=args.config, device=args.device, dtype=args.dtype,
                threads=args.threads, rounds=args.rounds, ngram=ngram,
                edit_ngram=edit_ngram,
                new_tokens=args.new_tokens, prompt_tokens=args.prompt, identical=identical, results=results,
                **info)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--config", default="smollm2-135m")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prefix-layers", type=int, default=7, help="prefix-draft: the draft's blocks")
    parser.add_argument("--edit-dir", type=Path, default=Path("runs/spec_edit"), help="edit: trained once here")
    parser.add_argument("--edit-tokens", type=int, default=260, help="edit: max_tokens (answers end with EOS)")
    parser.add_argument("--lookup", type=int, nargs=2, default=[5, 5], metavar=("MIN", "MAX"),
                        help="prompt_lookup_min and _max (vLLM's defaults: 5 and 5)")  # fmt: skip
    parser.add_argument("--edit-prompts", type=int, default=8, help="edit: held-out prompts, in batches of b")
    parser.add_argument("--edit-k", type=int, default=7, help="edit (ngram): num_speculative_tokens")
    parser.add_argument("--edit-lookup", type=int, nargs=2, default=[2, 16], metavar=("MIN", "MAX"),
                        help="edit (ngram): prompt_lookup_min / max")  # fmt: skip
    parser.add_argument("--edit-disable-by-batch-size", type=int, default=None, metavar="N",
                        help="edit (ngram): vLLM's disable_by_batch_size (no guesses while N run)")  # fmt: skip
    parser.add_argument("--draft", type=Path, default=None, help="edit-draft: this draft folder instead of the "
                        "edit dir's distilled one (e.g. an earlier distillation)")  # fmt: skip
    parser.add_argument("--draft-steps", choices=("chained", "stepwise"), default="chained",
                        help="draft methods: the k + 1 draft steps as one compiled graph (the engine's) or one "
                        "compiled call each (the engine before it chained them)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 round, 16 tokens, batch 1 (CI)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.vocab, args.rounds, args.new_tokens, args.prompt, args.batch = "tiny", 300, 1, 16, 32, [1]
        args.prefix_layers, args.lookup = 1, [1, 3]  # a 16-token output: short n-grams, or nothing matches
        args.workloads = [w for w in args.workloads if not w.startswith("edit")]
    from _common import console, emit, table

    report = run(args)
    for row in report["results"]:
        row["ratio_rounds"] = row["ratio_by_round"]["median"]
    cols = [("workload", ""), ("method", ""), ("batch", ""), ("plain_tok_s", ".1f"), ("spec_tok_s", ".1f"),
            ("ratio", ".2f"), ("ratio_rounds", ".2f"), ("tokens_per_round", ".2f"), ("acceptance", ".2f"),
            ("roofline_equiv", ".2f"), ("bandwidth_gbs", ".1f"), ("identical", "")]  # fmt: skip
    console.print(table(f"speculation vs plain decoding (median of {args.rounds})", report["results"], cols))
    emit(report, args.out)
    if not report["identical"]:
        print("outputs differ between the engines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

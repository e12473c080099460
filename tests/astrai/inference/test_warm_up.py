"""No request compiles after the engine's warm-up (issue 41 item 2, DESIGN fact F9).

The slow test counts Dynamo's compiled graphs (`torch._dynamo.utils.counters["stats"]["unique_graphs"]`), not
time: after `ModelRunner.warm_up` (what `astrai serve` runs before printing `serving`), a second request, n=2,
penalties, logprobs, logit_bias, min_tokens, top_p and a grammar compile nothing; the negative control is the same
requests on an engine that skipped the warm-up, where the counter moves. The fast tests hold the sampler's
mapping onto its few compiled variants to the draws of the unmapped batch (eager, no compile).
"""

import functools
import json

import pytest
import torch
from torch._dynamo.utils import counters

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import GrammarSpec, SamplingParams
from astrai.inference.sampler import sample
from astrai.inference.sampler_variants import VARIANTS, SamplerVariants, variant
from astrai.inference.sampling_batch import general_batch, make_sampling_batch, pad_rows
from helpers import tiny_model_dir

V = 300
SCHEMA = GrammarSpec(kind="json_schema", source=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                             "required": ["a"]}))  # fmt: skip

# one of each kind of request a server can be sent (each changes the decode batch size or the sampler's branches)
KINDS = {
    "second": [SamplingParams(max_tokens=3, temperature=0.0)],
    "n=2": [SamplingParams(max_tokens=3, temperature=1.0, n=2)],
    "top_p": [SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9)],
    "penalties": [
        SamplingParams(max_tokens=3, temperature=1.0, repetition_penalty=1.3, min_p=0.1, frequency_penalty=0.5)
    ],  # fmt: skip
    "logprobs": [SamplingParams(max_tokens=3, temperature=1.0, logprobs=True, top_logprobs=2)],
    "bias+min_tokens": [SamplingParams(max_tokens=3, temperature=0.0, logit_bias=((5, 2.0),), min_tokens=2)],
    "grammar": [SamplingParams(max_tokens=12, temperature=1.0, grammar=SCHEMA)],
    "mixed batch": [SamplingParams(max_tokens=3, temperature=0.0), SamplingParams(max_tokens=3, top_k=5)],
}


def _params() -> list[tuple[str, SamplingParams]]:
    return [
        ("greedy", SamplingParams(temperature=0.0)),
        ("sample", SamplingParams(temperature=0.8, min_p=0.05)),
        ("sort", SamplingParams(temperature=1.2, top_k=7, top_p=0.8)),
        ("penalty", SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.7)),
        ("bias", SamplingParams(temperature=0.0, logit_bias=((3, 5.0), (9, -100.0)))),
        ("min_tokens", SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=(4, 6))),
    ]


@pytest.mark.parametrize("rows", [[0], [1], [2], [0, 1], [1, 2], [3], [4], [5], [0, 3, 4, 5], [1, 2, 3, 4, 5]])
def test_variants_draw_the_tokens_of_the_unmapped_batch(rows):
    """`SamplerVariants` (eager here) draws what `sample` draws on the batch as built, logprobs included."""
    gen = torch.Generator().manual_seed(len(rows))
    named = _params()
    params = [named[r][1] for r in rows]
    logits = torch.randn(len(rows), V, generator=gen) * 4
    prompts = [torch.randint(0, V, (9,), generator=gen).tolist() for _ in rows]
    outputs = [torch.randint(0, V, (4,), generator=gen).tolist() for _ in rows]
    batch = make_sampling_batch(params, seeds=list(range(len(rows))), steps=[4] * len(rows), vocab_size=V,
                                device="cpu", prompts=prompts, outputs=outputs, stop_ids=[[1]] * len(rows))  # fmt: skip
    want = sample(logits, batch, top_logprobs=3)
    got = SamplerVariants(compiled=False)(logits, batch, top_logprobs=3)
    assert torch.equal(got.tokens, want.tokens)
    for name in ("logprobs", "top_ids", "top_logprobs"):
        assert torch.equal(getattr(got, name), getattr(want, name))
    # the general batch alone (every field present, both flags general) draws the same tokens
    assert torch.equal(sample(logits, general_batch(batch, V)).tokens, want.tokens)
    # and padding a row changes no row's draw
    padded = sample(torch.cat([logits, logits[:1]]), pad_rows(batch, len(rows) + 1)).tokens
    assert torch.equal(padded[: len(rows)], want.tokens)


def test_every_batch_maps_onto_a_warmed_variant():
    named = dict(_params())
    expected = {"greedy": "greedy", "sample": "sample", "sort": "sample+sort", "penalty": "general",
                "bias": "general", "min_tokens": "general"}  # fmt: skip
    for name, params in named.items():
        batch = make_sampling_batch([params], seeds=[0], steps=[0], vocab_size=V, device="cpu", stop_ids=[[1]])
        assert variant(batch) == expected[name], name
    bitmask = torch.full((1, -(-V // 32)), -1, dtype=torch.int32)
    batch = make_sampling_batch([named["greedy"]], seeds=[0], steps=[0], vocab_size=V, device="cpu",
                                grammar_bitmask=bitmask)  # fmt: skip
    assert variant(batch) == "general"
    assert set(expected.values()) == set(VARIANTS)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("warm") / "m"))


def _graphs_compiled_by(engine: Engine) -> dict[str, int]:
    """For each request kind, in order, the graphs Dynamo compiled while it ran."""
    compiled = {}
    for kind, params in KINDS.items():
        before = counters["stats"]["unique_graphs"]
        for handle in [engine.submit("hello world", p) for p in params]:
            handle.result()
        compiled[kind] = counters["stats"]["unique_graphs"] - before
    return compiled


@pytest.mark.slow  # cold compiles of the decode step and the sampler variants: minutes on a loaded 2-core box
def test_no_request_compiles_after_warm_up(model):
    cfg = EngineConfig(compile=True, background=False, max_running=2, kv_budget_tokens=2048, page_size=4)
    # no graph left from other tests (the compiled sampler is shared by every engine in the process): the warm-up
    # must compile what the requests meet, and the control must meet it uncompiled
    torch._dynamo.reset()
    with Engine(model, cfg) as engine:
        done = engine.runner.warm_up()
        assert (done["decode"], done["sampler"]) == ([1, 2], list(VARIANTS))
        compiled = _graphs_compiled_by(engine)
    assert compiled == dict.fromkeys(KINDS, 0), compiled
    torch._dynamo.reset()
    with Engine(model, cfg) as cold:  # negative control: the same requests without the warm-up
        moved = _graphs_compiled_by(cold)
    assert moved["second"] > 0 and moved["n=2"] > 0 and moved["penalties"] > 0, moved


@pytest.mark.slow  # two engines' compiles: a minute on a loaded 2-core box
def test_a_request_on_fewer_threads_compiles_nothing_after_the_warm_up(model):
    """`EngineConfig.share_cpu_cores` lowers the thread count beside a busy program: after `astrai serve`'s one
    warm-up at two threads, a request at one thread compiles nothing (`thread_count.AnyThreadCount`; Dynamo's own
    guard would recompile the decode step and the sampler at the new count), and the decode step runs at one thread.
    Negative control: without the warm-up the counter moves (what compiles then compiles at two threads)."""
    from astrai.cli import serve_start

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for warm in (True, False):
            torch._dynamo.reset()
            with Engine(model, EngineConfig(compile=True, background=False, kv_budget_tokens=512,
                                            share_cpu_cores=True)) as engine:  # fmt: skip
                assert engine.cores is not None
                if warm:
                    serve_start.warm_up(engine)
                torch.set_num_threads(1)  # what the monitor sets beside a busy process
                before, runs = counters["stats"]["unique_graphs"], []
                step = engine.runner.compiled_decode  # `thread_count.AnyThreadCount`
                step.compiled = functools.partial(_counting, runs, step.compiled)
                engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
                assert (counters["stats"]["unique_graphs"] > before) == (not warm)
                assert set(runs) == ({1} if warm else {1, 2}), runs  # cold: refused at one thread, run at two
                torch.set_num_threads(2)
    finally:
        torch.set_num_threads(threads)


def _counting(runs: list[int], fn, *args, **kwargs):
    """`fn`, noting the torch thread count it runs at."""
    runs.append(torch.get_num_threads())
    return fn(*args, **kwargs)

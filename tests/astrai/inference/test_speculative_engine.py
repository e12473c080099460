"""Speculative decoding in the engine (issue 43): n-gram guesses verified against the target's own draws give the
very tokens a run without speculation gives, and a rejected guess leaves no trace in the pool or the radix cache.

The reference is the same engine with `speculative=None` on the same random weights (a plain decode step per
token). Every identity test also asserts that guesses were proposed and accepted, so it cannot pass because
nothing was speculated (the prompts repeat themselves, so prompt lookup finds something). The rollback test drives
the scheduler by hand with guesses it knows will be rejected and checks pages and `num_computed` exactly; the
end-state test compares the radix cache's pages and their K/V content with the plain run's.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import astrai
from astrai.inference import engine_cache
from astrai.inference.engine import EngineConfig
from astrai.inference.engine_config import EngineStats
from astrai.inference.params import GrammarSpec, SamplingParams
from astrai.inference.plan import SampledToken
from astrai.inference.pool import PagePool
from astrai.inference.radix import RadixCache
from astrai.inference.scheduler import Scheduler
from astrai.inference.seq import split_n
from astrai.inference.speculative import AdaptiveK
from astrai.ops.attention import pages_needed
from helpers import spec_engine, tiny_model_dir

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [list(range(5, 25)) * 3, [7, 8, 9, 10] * 8, list(range(30, 90)), [3, 4] * 20 + list(range(100, 120))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("spec") / "m"))


_engine = spec_engine


def _run(model, spec, params: SamplingParams, prompts=PROMPTS, **config):
    with _engine(model, spec, **config) as engine:
        outs = engine.run_batch(prompts, params)
        return outs, engine.stats()


def _tokens(outs) -> list[list[tuple[int, ...]]]:
    return [[o.token_ids for o in c.outputs] for c in outs]


def _assert_speculated(stats) -> None:
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens > 0, stats
    assert sum(stats.spec_accepted_hist) == stats.spec_drafts


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2),
        # seeded sampling: the same noise at the same output index, so the same tokens
        SamplingParams(max_tokens=48, temperature=0.05, top_p=0.9, seed=11, n=2, ignore_eos=True),
        # penalties that favour repeats (so guesses pass): a guessed row counts the guesses before it
        SamplingParams(max_tokens=48, temperature=0.05, seed=5, ignore_eos=True, repetition_penalty=0.9,
                       frequency_penalty=-0.5, presence_penalty=-0.2),
    ],
    ids=["greedy", "greedy-logprobs", "seeded-n2", "seeded-penalties"],
)  # fmt: skip
def test_output_is_token_identical_to_plain_decoding(model, params):
    plain, _ = _run(model, None, params)
    spec, stats = _run(model, SPEC, params)
    assert _tokens(spec) == _tokens(plain)
    assert [[o.text for o in c.outputs] for c in spec] == [[o.text for o in c.outputs] for c in plain]
    _assert_speculated(stats)
    if params.logprobs:
        for a, b in zip(spec, plain, strict=True):
            torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs),
                                       atol=1e-4, rtol=1e-4)  # fmt: skip
            assert [[t for t, _ in row] for row in a.outputs[0].top_logprobs] == [
                [t for t, _ in row] for row in b.outputs[0].top_logprobs]  # fmt: skip


def test_disable_by_batch_size_pauses_guesses_while_the_batch_is_that_large(model):
    """vLLM's `disable_by_batch_size`: the four prompts run together, so with 2 no step guesses and the tokens are
    the plain run's; one prompt alone under the same config speculates (the negative control)."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    paused_spec = {**SPEC, "disable_by_batch_size": 2}
    plain, _ = _run(model, None, params)
    paused, stats = _run(model, paused_spec, params)
    assert _tokens(paused) == _tokens(plain) and stats.spec_drafts == 0, stats
    alone, stats = _run(model, paused_spec, params, prompts=PROMPTS[:1])
    assert _tokens(alone) == _tokens(plain)[:1]
    _assert_speculated(stats)


def test_stop_strings_cut_where_plain_decoding_cuts(model):
    # stop strings taken from seven places in each plain output: some complete in the middle of a round that kept
    # several tokens, whose tokens after the stop must go (without that cut, six of these differ)
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain, _ = _run(model, None, greedy)
    requests = []
    for prompt, c in zip(PROMPTS, plain, strict=True):
        text = c.outputs[0].text
        requests += [(prompt, text[at : at + 3]) for at in range(0, len(text) - 3, max(1, len(text) // 7))]
    results = {}
    for spec in (None, SPEC):
        with _engine(model, spec) as engine:
            handles = [engine.submit(prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                                            stop=[stop])) for prompt, stop in requests]  # fmt: skip
            results[spec is None] = [h.result().outputs[0] for h in handles]
            stats = engine.stats()
    shape = [[(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in results[key]] for key in (True, False)]
    assert shape[1] == shape[0]
    assert sum(o.finish_reason == "stop" for o in results[True]) >= len(requests) - 2  # the stops were reached
    _assert_speculated(stats)


def test_preemption_and_prefix_hits_keep_the_tokens(model):
    # a 256-token pool for five requests of ~100 tokens: sequences are preempted and recomputed; the repeated
    # prompt hits the prefix cache
    prompts = [*PROMPTS, PROMPTS[0]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, plain_stats = _run(model, None, params, prompts, kv_budget_tokens=256, max_running=5)
    spec, stats = _run(model, SPEC, params, prompts, kv_budget_tokens=256, max_running=5)
    assert plain_stats.preemptions > 0 and stats.preemptions > 0 and stats.prefix_hit_rate > 0
    assert _tokens(spec) == _tokens(plain)
    _assert_speculated(stats)


FIELDS = {"name": {"type": "string"}, "id": {"type": "integer"}}
ITEM = {"type": "object", "required": ["name", "id"], "properties": FIELDS}
ITEMS_SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": ITEM}}}


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_constrained_requests_speculate_within_their_grammar(model, temperature):
    """Guesses the grammar forbids are cut before the verify step, each guessed row draws under the grammar's
    state after the guesses before it, and the matcher advances by the kept tokens only: the same valid JSON as
    plain decoding, with guesses accepted (the budget is far from budget-aware closing's window for ~90 tokens)."""
    schema = GrammarSpec(kind="json_schema", source=json.dumps(ITEMS_SCHEMA))
    params = SamplingParams(max_tokens=160, temperature=temperature, seed=3, grammar=schema)
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs, stats = {}, {}
    for spec in (None, SPEC):
        with _engine(model, spec) as engine:
            handles = [engine.submit(p, params) for p in ([5, 6, 7], [9, 10, 11, 12])]
            handles.append(engine.submit(PROMPTS[1], free))  # an unconstrained sequence in the same steps
            outs[spec is None] = [h.result().outputs[0] for h in handles]
            stats[spec is None] = engine.stats()
    assert [o.token_ids for o in outs[False]] == [o.token_ids for o in outs[True]]
    for out in outs[False][:2]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), ITEMS_SCHEMA)
    _assert_speculated(stats[False])
    if temperature == 0.0:  # the constrained sequences' own guesses passed, not only the free one's
        with _engine(model, SPEC) as engine:
            engine.run_batch([[5, 6, 7]], params)
            _assert_speculated(engine.stats())


def test_the_radix_cache_holds_what_plain_decoding_leaves(model):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    state = {}
    for spec in (None, SPEC):
        with _engine(model, spec) as engine:
            outs = engine.run_batch(PROMPTS, params)
            rows = []
            for prompt, c in zip(PROMPTS, outs, strict=True):
                tokens = list(prompt) + list(c.outputs[0].token_ids)
                pages = engine.radix.cached_pages(tokens)
                k = torch.stack([torch.cat([layer.view(-1, engine.pool.page_size, *layer.shape[1:])[p]
                                            for p in pages]) for layer in engine.runner.cache.k])  # fmt: skip
                rows.append((len(pages), k))
            state[spec is None] = (rows, engine.stats().kv_pages_used, engine.stats().kv_pages_cached)
            if spec is not None:
                _assert_speculated(engine.stats())
    (plain_rows, plain_used, plain_cached), (spec_rows, spec_used, spec_cached) = state[True], state[False]
    assert (spec_used, spec_cached) == (plain_used, plain_cached) and spec_used == 0
    for (n_plain, k_plain), (n_spec, k_spec) in zip(plain_rows, spec_rows, strict=True):
        assert n_spec == n_plain > 0  # the same pages cached: no rejected guess reached the radix
        torch.testing.assert_close(k_spec, k_plain, atol=1e-4, rtol=1e-4)  # by content, not only by count


def _scheduled_seq(page_size: int):
    pool = PagePool(64, page_size)
    scheduler = Scheduler(pool, RadixCache(pool), max_running=4, max_step_tokens=64, max_model_len=200)
    scheduler.propose = lambda seq, k: [1, 2, 3, 4][:k]
    [seq] = split_n(list(range(10, 17)), SamplingParams(max_tokens=20), "r", 0, 0, frozenset())
    seq.spec = AdaptiveK(k_max=4)
    scheduler.add([seq])
    [prefill] = scheduler.schedule()
    scheduler.update([prefill], {0: SampledToken(9)})  # 7 prompt tokens, 1 output: 8 tokens, 7 with K/V
    return pool, scheduler, seq


@pytest.mark.parametrize(("draws", "outputs"), [((5, 0, 0, 0, 0), [9, 5]), ((1, 2, 7, 0, 0), [9, 1, 2, 7])],
                         ids=["all-rejected", "two-accepted"])  # fmt: skip
def test_a_rejected_guess_is_rolled_back(draws, outputs):
    pool, scheduler, seq = _scheduled_seq(page_size=2)
    [item] = scheduler.schedule()
    assert item.draft == (1, 2, 3, 4) and item.num_new == 5 and len(seq.pages) == pages_needed(12, 2) == 6
    scheduler.update([item], {0: [SampledToken(t) for t in draws]})
    assert seq.outputs == outputs
    assert seq.num_computed == seq.num_tokens - 1  # the kept tokens have K/V; the last draw is the next input
    assert len(seq.pages) == pages_needed(seq.num_computed + 1, 2) == pool.num_used  # the rest went back
    accepted = len(outputs) - 2
    assert scheduler.spec_stats.accepted_hist[accepted] == 1 and scheduler.spec_stats.draft_tokens == 4
    [after] = scheduler.schedule()  # the next round starts from the kept state
    assert after.start == seq.num_tokens - 1 and after.num_new == 1 + len(after.draft)


def test_a_guessed_row_draws_what_a_plain_row_draws_after_the_guesses(model):
    """The sampler row at guess position i must equal a plain sequence's row whose outputs already hold the first
    i guesses: same output index (the noise), same penalty counts."""
    engine = _engine(model, None)
    try:
        runner, vocab = engine.runner, model.config.vocab_size
        draft = (11, 12, 14)
        logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
        logits[:, list(draft)] += 12  # the guessed tokens lead, so the penalties decide among them
        for seed in range(16):
            params = SamplingParams(temperature=1.0, seed=seed, frequency_penalty=1.5, presence_penalty=0.5,
                                    max_tokens=64)  # fmt: skip
            [seq] = split_n([5, 6, 7], params, "r", seed, 0, frozenset())
            seq.outputs += [11, 12, 11, 13]
            seq.in_flight = 1
            guessed = runner._launch_sample(logits, [(seq, draft[:i]) for i in range(4)], vocab).tokens.tolist()
            plain = []
            for i in range(4):
                [twin] = split_n([5, 6, 7], params, "r", seed, 0, frozenset())
                twin.outputs += seq.outputs + list(draft[:i])
                twin.in_flight = 1
                plain.append(int(runner._launch_sample(logits[i : i + 1], [(twin, ())], vocab).tokens[0]))
            assert guessed == plain, seed
    finally:
        engine.shutdown()


def test_bad_configs_are_refused_at_start(model):
    with pytest.raises(ValueError, match="overlap_schedule off"):
        EngineConfig(speculative=SPEC, overlap_schedule=True)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        EngineConfig(speculative={"method": "ngram", "num_speculative_tokens": 0})


def test_the_generate_facade_takes_vllms_config(model):
    prompts = [[7, 8, 9, 10] * 8, list(range(5, 25)) * 3]
    plain = astrai.generate(model, prompts, max_tokens=32)
    spec = astrai.generate(model, prompts, max_tokens=32, speculative=json.dumps(SPEC))  # a new engine: spec on
    assert spec == plain and engine_cache._slots[id(model)].engine.stats().spec_accepted_tokens > 0
    astrai.release_engines(model)


def test_spec_counters_reach_metrics_with_vllms_names():
    from prometheus_client.parser import text_string_to_metric_families

    from astrai.serve.metrics import Metrics

    stats = EngineStats(running=0, waiting=0, kv_pages_total=8, kv_pages_used=0, kv_pages_cached=0, kv_pages_free=8,
                        prefix_hit_rate=0.0, prompt_tokens=0, generated_tokens=0, generation_tokens_per_s=0.0,
                        preemptions=0, steps=3, spec_drafts=5, spec_draft_tokens=17, spec_accepted_tokens=8,
                        spec_accepted_hist=(1, 1, 2, 1))  # fmt: skip
    families = {f.name: f for f in text_string_to_metric_families(Metrics().render(stats))}
    value = {name: families[name].samples[0].value for name in ("vllm:spec_decode_num_drafts",
             "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}  # fmt: skip
    assert value == {"vllm:spec_decode_num_drafts": 5, "vllm:spec_decode_num_draft_tokens": 17,
                     "vllm:spec_decode_num_accepted_tokens": 8}  # fmt: skip
    per_pos = {s.labels["position"]: s.value for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert per_pos == {"0": 4, "1": 3, "2": 1}  # rounds whose guess at that position passed
    assert sum(per_pos.values()) == 8  # they add up to the accepted tokens


def test_on_cpu_speculation_compiles_the_verify_step_by_default():
    spec = EngineConfig(speculative=SPEC)
    assert spec.resolved_compile_prefill("cpu") is True  # the extend path is every round's verify step
    assert spec.resolved_compile_prefill("cuda") is None  # CUDA's own default (compiled once its check passes)
    assert EngineConfig(speculative=SPEC, compile_prefill=False).resolved_compile_prefill("cpu") is False
    assert EngineConfig().resolved_compile_prefill("cpu") is None


@pytest.mark.slow  # ~30 s: compiles the decode and prefill steps twice; the eager identity tests above run in CI
def test_compiled_engines_give_the_same_tokens(model):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = _run(model, None, params, compile=True)
    spec, stats = _run(model, SPEC, params, compile=True)
    assert _tokens(spec) == _tokens(plain)
    _assert_speculated(stats)

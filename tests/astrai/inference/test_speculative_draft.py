"""Speculative decoding with a draft model (issue 43, `astrai.inference.draft`): the draft's greedy guesses,
verified against the target's own draws, give the very tokens a run without speculation gives; the draft's K/V
follows the target's page for page, so after rejections, preemptions and prefix hits both pools hold what a
plain computation of the kept tokens holds.

The pair (`helpers.draft_pair_dirs`): a tiny 2-layer random target whose second block is damped, and its 1-layer
prefix as the draft (same tokenizer), so most guesses pass and every identity test can assert that guesses were
proposed *and* accepted (it cannot pass because nothing was speculated). The reference is the same engine with
`speculative=None` on the same weights.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import attrs
import pytest
import torch

import astrai
from astrai.inference import engine_cache
from astrai.inference.params import GrammarSpec, SamplingParams
from astrai.inference.speculative import AdaptiveK
from astrai.io.model import save
from astrai.io.tokenizer import train_tokenizer
from helpers import draft_pair_dirs, spec_engine, tiny_model_dir

PROMPTS = [list(range(5, 25)) * 3, [7, 8, 9, 10] * 8, list(range(30, 90)), [3, 4] * 20 + list(range(100, 120))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = draft_pair_dirs(tmp_path_factory.mktemp("draft"))
    return astrai.load(target_dir), draft_dir


def _spec(draft_dir: str, k: int = 4) -> dict:
    return {"model": draft_dir, "num_speculative_tokens": k}  # vLLM's JSON: "model" alone means method "draft"


_engine = spec_engine


def _run(model, spec, params: SamplingParams, prompts=PROMPTS, **config):
    with _engine(model, spec, **config) as engine:
        outs = engine.run_batch(prompts, params)
        return [[o.token_ids for o in c.outputs] for c in outs], engine.stats()


def _assert_speculated(stats, *, rate: float = 0.0) -> None:
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens > 0, stats
    assert stats.spec_accepted_tokens >= rate * stats.spec_draft_tokens, stats


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.05, top_p=0.9, seed=11, n=2, ignore_eos=True),
        # penalties the draft does not apply: fewer guesses pass, the same tokens come out
        SamplingParams(max_tokens=40, temperature=0.05, seed=5, ignore_eos=True, repetition_penalty=1.05,
                       frequency_penalty=0.1, presence_penalty=0.1),
    ],
    ids=["greedy", "greedy-logprobs", "seeded-n2", "seeded-penalties"],
)  # fmt: skip
def test_output_is_token_identical_to_plain_decoding(pair, params):
    model, draft_dir = pair
    plain, _ = _run(model, None, params)
    spec, stats = _run(model, _spec(draft_dir), params)
    assert spec == plain
    _assert_speculated(stats)


def test_most_guesses_of_a_close_draft_pass(pair):
    # the draft is the target without its (damped) second block: its guesses are mostly the target's argmax. A
    # draft whose K/V fell behind the target's (a prompt it never saw, a position written twice) would guess worse
    model, draft_dir = pair
    _, stats = _run(model, _spec(draft_dir), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    _assert_speculated(stats, rate=0.8)


def test_stop_strings_grammar_preemption_and_prefix_hits(pair):
    model, draft_dir = pair
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = _run(model, None, greedy)
    texts = [model.tokenizer.decode(list(out[0])) for out in plain]
    schema = GrammarSpec(kind="json_schema", source='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    requests = [(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[t[at : at + 3]]))
                for p, t in zip(PROMPTS, texts, strict=True) for at in (9, 30)]  # fmt: skip
    requests += [(p, greedy) for p in PROMPTS[2:]]
    requests += [([5, 6, 7], SamplingParams(max_tokens=24, temperature=0.0, grammar=schema)),
                 (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=2))]  # fmt: skip
    results = {}
    for spec in (None, _spec(draft_dir)):
        # a 256-token pool for ~13 sequences of ~100 tokens: preemptions; PROMPTS[0] again: a prefix hit
        with _engine(model, spec, kv_budget_tokens=256, max_running=8) as engine:
            handles = [engine.submit(prompt, params) for prompt, params in requests]
            results[spec is None] = [[(o.token_ids, o.text, o.finish_reason) for o in h.result().outputs]
                                     for h in handles]  # fmt: skip
            stats = engine.stats()
    assert results[False] == results[True]
    assert sum(out[0][2] == "stop" for out in results[True][:8]) >= 6  # the stop strings were reached
    assert stats.preemptions > 0 and stats.prefix_hit_rate > 0
    _assert_speculated(stats)


def test_a_constrained_request_keeps_the_draft_guesses_its_grammar_allows(pair):
    # the draft guesses without the grammar; `fill` cuts its guesses at the first one the grammar forbids (the
    # sequence's num_computed given back for the cut ones) and the verify rows draw under the grammar
    model, draft_dir = pair
    source = (
        '{"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", '
        '"properties": {"name": {"type": "string"}}, "required": ["name"]}}}, "required": ["items"]}'
    )
    params = SamplingParams(max_tokens=160, temperature=0.0, grammar=GrammarSpec(kind="json_schema", source=source))
    plain, _ = _run(model, None, params, prompts=[[5, 6, 7], [9, 10, 11, 12]])
    spec, stats = _run(model, _spec(draft_dir), params, prompts=[[5, 6, 7], [9, 10, 11, 12]])
    assert spec == plain
    _assert_speculated(stats)


def _pages_k(cache_k, pages, page_size) -> torch.Tensor:
    return torch.stack([torch.cat([layer.view(-1, page_size, *layer.shape[1:])[p] for p in pages])
                        for layer in cache_k])  # fmt: skip


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_both_pools_hold_what_plain_computation_leaves(pair):
    """After rejected guesses, the radix cache's pages hold, for the target and for the draft, the K of a fresh
    computation of the kept tokens (by content), and the same pages are cached as in a plain run."""
    model, draft_dir = pair
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    draft_model = astrai.load(draft_dir)
    with _engine(model, None) as plain, _engine(model, _spec(draft_dir)) as spec:
        outs = plain.run_batch(PROMPTS, params)
        assert [[o.token_ids for o in c.outputs] for c in spec.run_batch(PROMPTS, params)] == [
            [o.token_ids for o in c.outputs] for c in outs
        ]
        stats = spec.stats()
        assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 0  # some guesses were rejected
        assert (stats.kv_pages_used, stats.kv_pages_cached) == (0, plain.stats().kv_pages_cached)
        for prompt, c in zip(PROMPTS, outs, strict=True):
            tokens = list(prompt) + list(c.outputs[0].token_ids)
            pages, plain_pages = spec.radix.cached_pages(tokens), plain.radix.cached_pages(tokens)
            assert len(pages) == len(plain_pages) > 0
            _close(_pages_k(spec.runner.cache.k, pages, 16), _pages_k(plain.runner.cache.k, plain_pages, 16))
            with _engine(draft_model, None) as fresh:  # the draft alone, prefilling the kept tokens
                fresh.run_batch([tokens], SamplingParams(max_tokens=1, ignore_eos=True))
                fresh_pages = fresh.radix.cached_pages(tokens)
                assert len(fresh_pages) == len(pages)
                _close(_pages_k(spec.draft.runner.cache.k, pages, 16), _pages_k(fresh.runner.cache.k, fresh_pages, 16))


def _recording(calls: list, fn):
    def record(items):
        guesses = fn(items)
        calls.append([(len(item.draft), guess) for item, guess in zip(items, guesses, strict=True)])
        return guesses

    return record


def test_the_chained_steps_guess_and_store_what_the_stepwise_ones_do(pair, monkeypatch):
    """The compiled engine runs a round's draft steps as one graph (`draft.chained_steps`), with the entries that
    need fewer guesses as padding rows past their k + 1st step. Run here eagerly, with each sequence's k drawn from
    a fixed cycle (so rounds mix k = 1 to 8): round by round the same guesses as the step-by-step loop, the same
    tokens, and the same draft K/V for the kept tokens."""
    model, draft_dir = pair
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    spec, rounds, outs = _spec(draft_dir, k=8), {"stepwise": [], "chained": []}, {}
    with _engine(model, spec, background=False) as stepwise, _engine(model, spec, background=False) as chained:
        assert chained.draft.chained is None  # eager engines step; the graph's logic runs eagerly below
        chained.draft.chained = chained.draft._eager
        stepwise.draft._propose = _recording(rounds["stepwise"], stepwise.draft._propose)
        chained.draft._propose = _recording(rounds["chained"], chained.draft._propose_chained)
        for name, engine in (("stepwise", stepwise), ("chained", chained)):
            cycle = itertools.cycle([8, 2, 5, 1, 3, 7])
            monkeypatch.setattr(AdaptiveK, "next_k", lambda self, cycle=cycle: min(self.k_max, next(cycle)))
            outs[name] = [[o.token_ids for o in c.outputs] for c in engine.run_batch(PROMPTS, params)]
        assert outs["chained"] == outs["stepwise"]
        assert rounds["chained"] == rounds["stepwise"]
        ks = [sorted(k for k, _ in entries) for entries in rounds["chained"]]
        assert sum(r[0] + 1 < r[-1] for r in ks) > 3 and any(r[-1] < 8 for r in ks), ks  # padding rows and steps
        for prompt, c in zip(PROMPTS, outs["stepwise"], strict=True):  # the kept tokens' draft K, by cached page
            tokens = list(prompt) + list(c[0])
            pages, chained_pages = stepwise.radix.cached_pages(tokens), chained.radix.cached_pages(tokens)
            assert len(pages) == len(chained_pages) > 0
            torch.testing.assert_close(_pages_k(chained.draft.runner.cache.k, chained_pages, 16),
                                       _pages_k(stepwise.draft.runner.cache.k, pages, 16), atol=0, rtol=0)  # fmt: skip
        _assert_speculated(chained.stats())


def test_bad_drafts_are_refused_at_start(pair, tmp_path):
    model, draft_dir = pair
    with pytest.raises(ValueError, match="cannot load the draft model"):
        _engine(model, _spec(str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="not smaller than the target"):
        _engine(model, _spec(str(Path(draft_dir).parent / "target")))  # the target as its own draft
    other = astrai.load(tiny_model_dir(tmp_path / "other"))
    other_tok = train_tokenizer(["a different corpus gives a different vocabulary"] * 4, vocab_size=280)
    save(attrs.evolve(other, tokenizer=other_tok), tmp_path / "other-vocab")
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        _engine(model, _spec(str(tmp_path / "other-vocab")))


def test_the_generate_facade_takes_a_draft(pair):
    model, draft_dir = pair
    prompts = [[7, 8, 9, 10] * 8, list(range(5, 25)) * 3]
    plain = astrai.generate(model, prompts, max_tokens=32)
    spec = astrai.generate(model, prompts, max_tokens=32, speculative=_spec(draft_dir))
    assert spec == plain and engine_cache._slots[id(model)].engine.stats().spec_accepted_tokens > 0
    astrai.release_engines(model)


@pytest.mark.slow  # ~40 s: compiles the target's and the draft's steps
def test_compiled_engines_give_the_same_tokens(pair):
    model, draft_dir = pair
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = _run(model, None, params, compile=True)
    spec, stats = _run(model, _spec(draft_dir), params, compile=True)
    assert spec == plain
    _assert_speculated(stats, rate=0.8)


@pytest.mark.slow  # compiles the draft's chained graph at each warm-up batch size
def test_a_warmed_draft_compiles_nothing_while_serving(pair):
    """`DraftProposer.warm_up` (called by `astrai serve` before it says `serving`) compiles the chained graph at
    every batch size the rounds meet: requests at 1 to 4 speculating sequences, every k, compile nothing after."""
    from torch._dynamo.utils import counters

    model, draft_dir = pair
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # no graph left from other tests (the compiled sampler is shared by every engine in the process), as
    # test_warm_up does: the warm-up must compile what the requests meet
    torch._dynamo.reset()
    with _engine(model, _spec(draft_dir), compile=True, max_running=4) as engine:
        engine.runner.warm_up()
        done = engine.draft.warm_up()
        assert done["chained"] == [1, 2, 4], done  # fp32: 1, 2, one past the row-reduce bound (also max_running)
        before = counters["stats"]["unique_graphs"]
        for batch in (1, 2, 3, 4):
            engine.run_batch(PROMPTS[:batch], params)
        assert counters["stats"]["unique_graphs"] == before
        assert engine.draft.stats.rounds > 0 and engine.stats().spec_accepted_tokens > 0

"""`astrai.generate`'s per-model engines: reused, sized up, keyed by the model object, never stale, released."""

import contextlib
import gc
import threading
import weakref

import attrs
import pytest
import torch

import astrai
from astrai.inference import engine_cache
from astrai.inference.engine import Engine
from astrai.inference.params import SamplingParams
from astrai.tree import tree_map
from helpers import tiny_model_dir

PROMPTS = [[5, 6, 7], list(range(10, 50)), [9] * 20]  # the 40-token one fills full KV pages (radix-cacheable)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return [tiny_model_dir(tmp_path_factory.mktemp(f"m{seed}"), seed=seed) for seed in (0, 1)]


@pytest.fixture(autouse=True)
def builds(monkeypatch):
    """Eager engines (fast tests; one test compiles) and a count of the engines built; none left after."""
    counter = []  # one entry per cached engine built (never the engine itself: the test of release needs it gone)

    class Counting(engine_cache.Engine):
        def __init__(self, *args, **kwargs):
            counter.append(None)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_cache, "COMPILE", False)
    monkeypatch.setattr(engine_cache, "Engine", Counting)
    monkeypatch.setattr(engine_cache, "run_once", _run_once)
    yield counter
    astrai.release_engines()


def _run_once(model, prompts, params):
    """engine_cache.run_once on the real Engine class (not counted)."""
    kv, rows = engine_cache._needs(prompts, params)
    with Engine(model, engine_cache._config(kv, rows, compile=False)) as engine:
        return engine_cache._generate(engine, prompts, params)


def greedy(model, prompts=PROMPTS, max_tokens=8):
    return astrai.generate_ids(model, prompts, max_tokens=max_tokens, stop_token_ids=[])


def uncached(model, prompts=PROMPTS, max_tokens=8, n=1):
    params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, ignore_eos=True)
    return [[list(o.token_ids) for o in c.outputs] for c in engine_cache.run_once(model, prompts, params)]


def engine_of(model):
    return engine_cache._slots[id(model)].engine


def test_second_call_reuses_the_engine_and_equals_the_uncached_path(folders, builds):
    model = astrai.load(folders[0])
    first = greedy(model)
    engine = engine_of(model)
    assert greedy(model) == first and engine_of(model) is engine and len(builds) == 1
    assert [[ids] for ids in first] == uncached(model)
    params = SamplingParams(max_tokens=6, n=2, temperature=0.0, ignore_eos=True)  # n > 1 shares each prompt's prefill
    sampled = [[list(o.token_ids) for o in c.outputs] for c in engine_cache.run(model, PROMPTS, params)]
    assert sampled == uncached(model, max_tokens=6, n=2) and len(builds) == 2  # 6 rows > 4: sized up once


def test_a_bigger_call_builds_a_bigger_engine_with_the_same_outputs(folders, builds, monkeypatch):
    monkeypatch.setattr(engine_cache, "MIN_KV_TOKENS", 64)
    model = astrai.load(folders[0])
    greedy(model, PROMPTS[:1], max_tokens=4)
    small = engine_of(model).config
    more = PROMPTS + [[1, 2, 3, 4]] * 3  # 6 rows, longer completions
    assert greedy(model, more, max_tokens=40) == [ids for [ids] in uncached(model, more, max_tokens=40)]
    big = engine_of(model).config
    assert len(builds) == 2 and big.max_running == 8 > small.max_running
    assert big.kv_budget_tokens > small.kv_budget_tokens
    greedy(model, PROMPTS[:2], max_tokens=4)  # fits the bigger engine: no rebuild back down
    assert len(builds) == 2


def test_reloads_and_dtype_changes_get_their_own_engines(folders, builds):
    a, b = astrai.load(folders[0]), astrai.load(folders[1])
    out_a = greedy(a)
    assert greedy(b) != out_a  # negative control: an engine shared by identity-blind keys would fail below
    assert greedy(b) == [ids for [ids] in uncached(b)]
    again = astrai.load(folders[0])  # same folder, new object: a new engine, same output
    assert greedy(again) == out_a and engine_of(again) is not engine_of(a)
    half = astrai.load(folders[0], dtype=torch.bfloat16)
    cast = attrs.evolve(a, params=tree_map(lambda t: t.to(torch.bfloat16), a.params))
    for model in (half, cast):
        assert greedy(model) == [ids for [ids] in uncached(model)]
        assert engine_of(model).model.dtype == torch.bfloat16
    assert len(builds) == 5


def test_weights_changed_in_place_are_read_and_no_prefix_kv_is_stale(folders):
    model = astrai.load(folders[0])
    before = greedy(model)
    with torch.no_grad():
        for block in model.params.blocks:  # an "optimizer step": same tensors, new values
            block.attn.k_proj.weight.add_(torch.randn_like(block.attn.k_proj.weight))
            block.attn.v_proj.weight.add_(torch.randn_like(block.attn.v_proj.weight))
    after = greedy(model)
    assert after != before and after == [ids for [ids] in uncached(model)]


def test_engines_go_with_their_model(folders):
    model = astrai.load(folders[0])
    greedy(model, PROMPTS[:1], max_tokens=2)
    engine, start = weakref.ref(engine_of(model)), engine_cache.cached_engines()
    del model
    gc.collect()
    assert engine_cache.cached_engines() == start - 1 and engine() is None
    kept = astrai.load(folders[0])
    greedy(kept, PROMPTS[:1], max_tokens=2)
    astrai.release_engines(kept)
    assert id(kept) not in engine_cache._slots


def test_a_rejected_prompt_keeps_the_engine_and_aborts_the_rest(folders, builds):
    model = astrai.load(folders[0])
    greedy(model)
    with pytest.raises(ValueError, match="empty"):
        greedy(model, [[1, 2], []])
    assert greedy(model) == greedy(model) and len(builds) == 1 and not engine_of(model).scheduler.has_work()


def test_two_threads_take_turns_on_one_engine(folders, monkeypatch):
    model = astrai.load(folders[0])
    expected = greedy(model)
    inside, overlap = [0], []
    step = engine_of(model).step

    def guarded_step():
        inside[0] += 1
        overlap.append(inside[0])
        try:
            return step()
        finally:
            inside[0] -= 1

    monkeypatch.setattr(engine_of(model), "step", guarded_step)
    results = [None, None]

    def worker(i):
        results[i] = greedy(model)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected, expected] and max(overlap) == 1


def test_the_spinner_shows_only_on_calls_that_compile(folders, monkeypatch):
    monkeypatch.setattr(engine_cache, "COMPILE", True)
    shown = []

    @contextlib.contextmanager
    def status(message):
        shown.append(message)
        yield

    monkeypatch.setattr(engine_cache, "_status", status)
    model = astrai.load(folders[0])
    one = greedy(model, PROMPTS[1:2], max_tokens=6)
    assert shown == [engine_cache.COMPILING] and engine_of(model).config.compile
    assert one == [ids for [ids] in uncached(model, PROMPTS[1:2], max_tokens=6)]
    greedy(model, PROMPTS[1:2], max_tokens=6)
    assert len(shown) == 1  # reused: nothing compiles, no spinner

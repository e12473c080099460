"""The overlap schedule (issue 16 item 2): step N+1 is planned and launched before step N's tokens are read.

Each sequence's tokens must not depend on it: the same tokens, log-probs, texts and finish reasons with overlap on
and off, under staggered arrivals, chunked prefill, prefix hits, preemption (a small KV pool), n > 1, seeded
sampling (its noise is keyed on the draw count), stop tokens (a wasted row in the next step), stop strings, length
limits, and sequences whose sampling reads their tokens on the host (penalties, grammars: collected first).
"""

import pytest
import torch

import astrai
from astrai.inference import runner as runner_module
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import GrammarSpec, SamplingParams
from helpers import DEVICE, tiny_model_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("m"), max_position_embeddings=512), device=DEVICE)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 290, (20,), generator=gen).tolist()
    lengths = [6, 33, 2, 15, 1, 48, 4, 25, 9, 12, 7, 3]
    tails = [torch.randint(3, 290, (n,), generator=gen).tolist() for n in lengths]
    return [shared + t if i % 3 == 1 else t for i, t in enumerate(tails)]  # every third one: a prefix hit


def _params(i: int) -> SamplingParams:
    common = dict(max_tokens=[16, 6, 24, 4, 12, 3][i % 6], logprobs=True, top_logprobs=2)  # penalties: short, as
    # every step that holds one is collected before the next is planned
    kinds = [
        dict(temperature=0.0, ignore_eos=True),
        dict(temperature=0.9, top_k=40, seed=11 + i, ignore_eos=True),  # the noise reads the draw count
        dict(temperature=0.0, ignore_eos=True, stop_token_ids=list(range(3, 300, 9)), min_tokens=2),  # ends early
        dict(temperature=0.8, seed=7, n=2, ignore_eos=True),  # n > 1: the follower waits for the leader's prompt
        dict(temperature=0.0, ignore_eos=True, stop=["y", "N"]),  # a stop string: the engine's text stage ends it
        dict(temperature=0.7, seed=5, frequency_penalty=0.8, repetition_penalty=1.3, ignore_eos=True),  # host reads
    ]
    return SamplingParams(**common, **kinds[i % len(kinds)])


def _run(model, prompts, *, overlap: bool, kv_tokens: int = 4096, extra=()) -> tuple[list, Engine]:
    cfg = EngineConfig(compile=False, overlap_schedule=overlap, page_size=4, max_step_tokens=32, max_running=6,
                       kv_budget_tokens=kv_tokens, background=False, seed=0)  # fmt: skip
    with Engine(model, cfg) as engine:
        handles = [engine.submit(prompts[0], _params(0))]
        engine.step()
        handles += [engine.submit(p, _params(i + 1)) for i, p in enumerate(prompts[1:5])]
        for _ in range(4):  # the first prompts are mid-prefill or decoding when the next ones arrive
            engine.step()
        handles += [engine.submit(p, _params(i + 5)) for i, p in enumerate(prompts[5:])]
        handles += [engine.submit(p, q) for p, q in extra]
        return [h.result() for h in handles], engine


def _summary(completions) -> list:
    return [[(o.token_ids, o.text, o.finish_reason) for o in c.outputs] for c in completions]


def _logprobs(completions) -> list[float]:
    return [lp for c in completions for o in c.outputs for lp in (*o.logprobs, *(a for s in o.top_logprobs
                                                                                for _, a in s))]  # fmt: skip


@pytest.mark.parametrize("kv_tokens", [4096, 96], ids=["roomy", "preempting"])
def test_overlap_on_equals_off(model, prompts, monkeypatch, kv_tokens):
    off, plain = _run(model, prompts, overlap=False, kv_tokens=kv_tokens)
    resolved = []
    original = runner_module.resolve_placeholders

    def spy(tokens, previous):
        resolved.append(int((tokens < 0).sum()))
        return original(tokens, previous)

    monkeypatch.setattr(runner_module, "resolve_placeholders", spy)
    on, overlapped = _run(model, prompts, overlap=True, kv_tokens=kv_tokens)
    assert _summary(on) == _summary(off)
    diff = max(abs(a - b) for a, b in zip(_logprobs(on), _logprobs(off), strict=True))
    assert diff <= 1e-5, f"log-probs differ by {diff}"
    # not vacuous: most steps fed in-flight tokens from the device, and every finish reason occurred
    steps = overlapped.scheduler.stats.steps
    assert len(resolved) >= steps // 2 and sum(resolved) >= steps, (resolved, steps)
    reasons = [c.outputs[0].finish_reason for c in on]
    assert "stop" in reasons[2::6] and reasons[4::6] == ["stop", "stop"] and "length" in reasons  # stop id, string
    if kv_tokens < 4096:
        assert overlapped.scheduler.stats.preemptions > 0 and plain.scheduler.stats.preemptions > 0
    for engine in (plain, overlapped):  # every page came back (wasted rows of finished sequences included)
        cached = engine.radix.num_cached_pages if engine.radix is not None else 0
        assert engine.pool.num_used == cached
        assert not engine.scheduler.running and all(s.in_flight == 0 for s in engine.scheduler.waiting)


def test_grammar_requests_match_under_overlap(model, prompts):
    grammar = GrammarSpec(kind="choice", source=["alpha beta", "gamma", "delta epsilon zeta"])
    extra = [(prompts[i], SamplingParams(max_tokens=12, temperature=0.9, seed=i, grammar=grammar)) for i in range(3)]
    on, _ = _run(model, prompts[:6], overlap=True, extra=extra)
    off, _ = _run(model, prompts[:6], overlap=False, extra=extra)
    assert _summary(on) == _summary(off)
    assert {c.outputs[0].text for c in on[-3:]} <= {"alpha beta", "gamma", "delta epsilon zeta"}


def test_abort_while_a_step_is_in_flight(model, prompts):
    cfg = EngineConfig(compile=False, overlap_schedule=True, page_size=4, kv_budget_tokens=1024, background=False)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with Engine(model, cfg) as engine:
        keep, drop = engine.submit(prompts[0], params), engine.submit(prompts[2], params)
        for _ in range(4):
            engine.step()
        assert engine._pending is not None  # a step is queued whose tokens the host has not read
        drop.abort()
        kept = keep.result()
        assert drop.result().outputs[0].finish_reason == "abort"
        while engine.step():
            pass
        assert engine.pool.num_used == engine.radix.num_cached_pages
    with Engine(model, EngineConfig(compile=False, page_size=4, kv_budget_tokens=1024, background=False)) as engine:
        assert kept.outputs[0].token_ids == engine.generate([prompts[0]], params)[0].outputs[0].token_ids


def test_background_engine_with_overlap(model, prompts):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(model, EngineConfig(compile=False, overlap_schedule=True, kv_budget_tokens=2048)) as engine:
        on = engine.generate(prompts[:4], params)
    with Engine(model, EngineConfig(compile=False, kv_budget_tokens=2048)) as engine:
        off = engine.generate(prompts[:4], params)
    assert _summary(on) == _summary(off)


def test_overlap_needs_a_single_rank():
    with pytest.raises(ValueError, match="needs tensor_parallel_size=1"):
        EngineConfig(overlap_schedule=True, tensor_parallel_size=2)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_overlap_decode_launch_does_not_sync_the_host(model, prompts):
    # the point of the overlap: queueing a decode step (metadata and sampling batch copies, placeholder resolution,
    # graph replay, sampler) never waits for the device, so the host reads step N while step N+1 runs
    cfg = EngineConfig(overlap_schedule=True, background=False, kv_budget_tokens=2048)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=1, ignore_eos=True, logprobs=True)
    with Engine(model, cfg) as engine:
        runner, checked = engine.runner, []
        launch = runner.launch

        def no_sync_launch(plan, **kw):
            if kw.get("previous") is None or any(item.num_new != 1 for item in plan):
                return launch(plan, **kw)
            torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
            try:
                checked.append(len(plan))
                return launch(plan, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        runner.launch = no_sync_launch
        completions = engine.generate(prompts[:4], params)
    assert len(checked) >= 10 and all(len(c.outputs[0].token_ids) == 24 for c in completions)


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "thread"])
def test_update_params_settles_the_step_queued_ahead(model, prompts, background):
    # sequences that end on a stop token leave a step queued past their end; new weights (RL) must wait for it
    cfg = EngineConfig(compile=False, overlap_schedule=True, page_size=4, kv_budget_tokens=1024, background=background)
    params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=list(range(3, 300, 3)))
    with Engine(model, cfg) as engine:
        first = engine.generate(prompts[:3], params)
        assert {c.outputs[0].finish_reason for c in first} == {"stop"}
        if not background:
            assert engine._pending is not None  # planned and launched before the stop tokens were read
        engine.update_params()
        assert engine._pending is None
        assert _summary(engine.generate(prompts[:3], params)) == _summary(first)

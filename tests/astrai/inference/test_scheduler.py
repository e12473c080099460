"""Scheduler policy without a model: token budget, running cap, FIFO admission, chunked prefill, preemption,
prefix hits, aborts, and no page leaks (property-tested)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.inference.params import SamplingParams
from astrai.inference.plan import SampledToken
from astrai.inference.pool import PagePool
from astrai.inference.radix import RadixCache
from astrai.inference.scheduler import Scheduler
from astrai.inference.seq import Seq, Status, split_n


def _req(i, prompt, max_tokens=4):
    return Seq(id=f"r{i}", index=0, prompt=list(prompt), params=SamplingParams(max_tokens=max_tokens), seed=i,
                   arrival=i)  # fmt: skip


def _sched(pages=64, page_size=4, radix=True, running=4, budget=16, max_len=256):
    pool = PagePool(pages, page_size)
    return Scheduler(pool, RadixCache(pool) if radix else None, max_running=running, max_step_tokens=budget,
                     max_model_len=max_len)  # fmt: skip


def _step(sched, log=None):
    """One step with a fake model: every sampled token is 7; returns the plan."""
    plan = sched.schedule()
    if log is not None:
        log.append(plan)
    sched.update(plan, {i: SampledToken(7) for i, item in enumerate(plan) if item.sample})
    return plan


def _run(sched, limit=1000):
    log = []
    for _ in range(limit):
        if not sched.has_work():
            return log
        _step(sched, log)
    raise AssertionError("did not finish")


def test_budget_cap_fifo_and_chunking():
    sched = _sched(running=2, budget=8)
    reqs = [_req(i, range(1 + i, 20 + i)) for i in range(4)]  # 19-token prompts
    sched.add(reqs)
    log = _run(sched)
    admitted = []
    for plan in log:
        assert sum(item.num_new for item in plan) <= 8
        for item in plan:
            if item.start == 0 and item.seq.id not in admitted:
                admitted.append(item.seq.id)
        assert len({item.seq.id for item in plan}) <= 2
    assert admitted == ["r0", "r1", "r2", "r3"]  # strict FIFO
    # the first request's prompt ran as chunks, sampling only after the last one
    first = [item for plan in log for item in plan if item.seq.id == "r0" and item.start < 19]
    assert [i.num_new for i in first] == [8, 8, 3] and [i.sample for i in first] == [False, False, True]
    assert all(r.outputs == [7] * 4 and r.finish_reason == "length" for r in reqs)
    assert sched.pool.num_used == sched.radix.num_cached_pages  # only the cache holds pages


def test_prefix_hit_skips_cached_pages_and_keeps_the_last_token():
    sched = _sched(page_size=4)
    a = _req(0, range(1, 13))  # 12 tokens = 3 full pages
    sched.add([a])
    _run(sched)
    b, c = _req(1, list(range(1, 13)) + [50, 51]), _req(2, range(1, 13))
    sched.add([b])
    plan = sched.schedule()
    assert plan[0].start == 12 and b.num_cached == 12  # three cached pages
    sched.update(plan, {0: SampledToken(7)})
    _run(sched)
    sched.add([c])  # fully cached prompt: recompute its last token for logits (start 8, not 12)
    assert sched.schedule()[0].start == 8


def test_preemption_recomputes_newest_and_everything_finishes():
    # 6 pages of 4 tokens: two 9-token prompts growing to 17 tokens can't both keep running
    sched = _sched(pages=7, page_size=4, radix=False, running=4, budget=32)
    a, b = _req(0, range(1, 10), max_tokens=8), _req(1, range(20, 29), max_tokens=8)
    sched.add([a, b])
    _run(sched)
    assert sched.stats.preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.outputs == [7] * 8 and b.outputs == [7] * 8
    assert sched.pool.num_free == 6


def test_preemption_picks_the_newest_of_three_running():
    """With two running sequences the victim is forced (the only other one), so the test above cannot tell
    "newest" from "oldest". Three one-page prompts on 4 usable pages: when the oldest needs a second page, the
    newest (c) is preempted, not the middle one (b) and not the oldest (a), which vLLM's recompute policy also
    picks (the running queue's tail). Checked at the first preemption, before any requeueing reorders them."""
    sched = _sched(pages=5, page_size=4, radix=False, running=4, budget=64)
    a, b, c = reqs = [_req(i, range(10 * i + 1, 10 * i + 5), max_tokens=12) for i in range(3)]
    sched.add(reqs)
    while not sched.stats.preemptions:
        assert sched.has_work()
        plan = _step(sched)
    assert [r.num_preemptions for r in reqs] == [0, 0, 1]
    assert {item.seq.id for item in plan} == {"r0", "r1"}  # the step that preempted c runs a and b
    _run(sched)
    assert all(r.outputs == [7] * 12 for r in (a, b, c))


def test_abort_frees_pages_and_records_nothing():
    sched = _sched()
    a = _req(0, range(1, 30), max_tokens=50)
    sched.add([a])
    _step(sched)
    _step(sched)
    assert sched.pool.num_used > 0
    sched.abort([a])
    assert a.finish_reason == "abort" and a.status is Status.FINISHED
    assert sched.pool.num_used == sched.radix.num_cached_pages
    assert not sched.has_work()


def test_abort_ends_sequences_the_scheduler_never_saw():
    sched = _sched()
    a, b = _req(0, range(1, 10)), _req(1, range(1, 10))
    sched.add([a])
    _step(sched)
    sched.abort([a, b])  # b was submitted but not yet added (an engine's inbox)
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort") and b.finished
    assert not sched.has_work() and sched.pool.num_used == sched.radix.num_cached_pages


def test_finish_with_a_stop_string_overrides_a_reason_from_the_same_step():
    sched = _sched()
    a = _req(0, range(1, 6), max_tokens=1)
    sched.add([a])
    _step(sched)  # the one token ends it by length
    assert a.finish_reason == "length"
    used = sched.pool.num_used
    sched.finish(a, "stop")  # the text stage then finds a stop string in that token
    assert a.finish_reason == "stop" and sched.pool.num_used == used  # no second release


def test_same_prompt_in_one_step_adopts_the_cached_pages():
    # a and b prefill the same 4-page prompt in one step; b must swap its duplicate pages for a's cached ones,
    # else they stay allocated under b while the cached copies are pinned, and b alone no longer fits
    sched = _sched(pages=17, page_size=1, radix=True, running=3, budget=16)
    a, b = _req(0, [100, 101]), _req(1, [100, 101, 102, 103], max_tokens=12)
    sched.add([a, b])
    _step(sched)
    assert b.pages[:2] == sched.radix.cached_pages([100, 101]) and a.pages[:2] == b.pages[:2]
    _run(sched)  # 16 tokens in a 16-page pool: fits only without the duplicates
    assert b.outputs == [7] * 12 and sched.pool.num_used == sched.radix.num_cached_pages


def test_preempted_n_leader_goes_back_ahead_of_its_followers():
    """A preempted n > 1 leader re-queued behind a follower waiting at the head for its prefill deadlocked the
    engine (found by benchmarks/bench_soak.py: the request and everything after it hung until the client left)."""
    for page_size in (1, 2, 4):
        for pages in range(24 // page_size + 1, 30):  # every pool the engine accepts these requests for
            sched = _sched(pages=pages, page_size=page_size, running=3, budget=16, max_len=64)
            a = _req(0, range(10, 18), max_tokens=12)
            b = split_n(list(range(30, 38)), SamplingParams(max_tokens=8, n=3), "b", 5, 1, frozenset())
            c = _req(2, range(50, 56), max_tokens=6)
            sched.add([a])
            sched.add(b)
            sched.add([c])
            _run(sched)
            assert all(s.finish_reason == "length" for s in [a, *b, c]), (page_size, pages)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=10),
    st.sampled_from([1, 2, 4]),
    st.integers(12, 40),
    st.booleans(),
)
def test_random_workloads_finish_without_leaks(specs, page_size, pages, radix):
    budget = 16
    sched = _sched(pages=pages, page_size=page_size, radix=radix, running=3, budget=budget, max_len=64)
    capacity = (pages - 1) * page_size
    reqs = []
    for i, (length, max_tokens, family) in enumerate(specs):
        if length + max_tokens > capacity:
            continue  # the engine rejects these at submit
        reqs.append(_req(i, [family * 100 + (t % 5) for t in range(length)], max_tokens=max_tokens))
    for r in reqs[: len(reqs) // 2]:
        sched.add([r])
    for step in range(2000):
        if step == 3:
            for r in reqs[len(reqs) // 2 :]:
                sched.add([r])
        if not sched.has_work() and step > 3:
            break
        plan = _step(sched)
        assert sum(item.num_new for item in plan) <= budget and len(sched.running) <= 3
        sched.pool.check()
        for seq in sched.running:
            assert len(seq.pages) * page_size >= seq.num_computed
    assert all(r.finished and len(r.outputs) == r.params.max_tokens for r in reqs)
    cached = sched.radix.num_cached_pages if radix else 0
    assert sched.pool.num_used == cached
    if radix:
        sched.radix.reset()
    assert sched.pool.num_free == pages - 1


def test_token_slices_match_all_tokens():
    req = _req(0, [5, 6, 7, 8])
    req.outputs += [9, 10, 11]
    for start in range(req.num_tokens + 1):
        for end in range(start, req.num_tokens + 1):
            assert req.tokens(start, end) == req.all_tokens[start:end], (start, end)


def test_token_arrays_follow_the_lists_as_they_grow():
    req = _req(0, [5, 6, 7])
    assert req.prompt_array().tolist() == [5, 6, 7] and req.output_array().tolist() == []
    for chunk in ([1], [2, 3], list(range(40)), [], [9]):  # past the initial capacity, in uneven steps
        req.outputs += chunk
        assert req.output_array().tolist() == req.outputs

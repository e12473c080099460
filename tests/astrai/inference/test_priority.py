"""vLLM's `--scheduling-policy priority` (issue 41, item 3): a lower `priority` is admitted first, planned first and
preempted last; under the default "fcfs" policy arrival decides and a non-zero priority is refused.

The expected orders are written out by hand from vLLM's rule (sort by (priority, arrival)); the fcfs runs of the same
workloads are the negative control (the same requests, the arrival order).
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.errors import EngineInputError
from astrai.inference.params import SamplingParams
from astrai.inference.plan import SampledToken
from astrai.inference.pool import PagePool
from astrai.inference.scheduler import Scheduler
from astrai.inference.seq import Seq
from helpers import tiny_model_dir


def _req(i: int, priority: int, prompt_len: int = 6, max_tokens: int = 3) -> Seq:
    params = SamplingParams(max_tokens=max_tokens, priority=priority)
    return Seq(id=f"r{i}", index=0, prompt=list(range(1 + i, 1 + i + prompt_len)), params=params, seed=i, arrival=i)


def _admission_order(policy: str, priorities: list[int], *, running: int = 1, pages: int = 64) -> list[str]:
    sched = Scheduler(PagePool(pages, 4), None, max_running=running, max_step_tokens=32, max_model_len=256,
                      policy=policy)  # fmt: skip
    sched.add([_req(i, p) for i, p in enumerate(priorities)])
    admitted = []
    for _ in range(500):
        if not sched.has_work():
            return admitted
        plan = sched.schedule()
        admitted += [item.seq.id for item in plan if item.start == 0 and item.seq.id not in admitted]
        sched.update(plan, {k: SampledToken(7) for k, item in enumerate(plan) if item.sample})
    raise AssertionError("did not finish")


def test_lower_priority_value_is_admitted_first():
    assert _admission_order("priority", [5, 0, 3, 0, -2]) == ["r4", "r1", "r3", "r2", "r0"]
    assert _admission_order("fcfs", [5, 0, 3, 0, -2]) == ["r0", "r1", "r2", "r3", "r4"]  # negative control


def test_a_late_urgent_request_overtakes_the_queue_not_the_running():
    sched = Scheduler(PagePool(64, 4), None, max_running=1, max_step_tokens=32, max_model_len=256, policy="priority")
    first, second = _req(0, 1), _req(1, 1)
    sched.add([first, second])
    plan = sched.schedule()  # r0 runs
    sched.update(plan, {k: SampledToken(7) for k, item in enumerate(plan) if item.sample})
    urgent = _req(2, 0)
    sched.add([urgent])
    assert [s.id for s in sched.waiting] == ["r2", "r1"]  # ahead of the earlier, less urgent arrival
    assert [s.id for s in sched.running] == ["r0"]  # admission does not preempt a running request


def test_preemption_takes_the_least_urgent():
    # 6 usable pages of 4 tokens: two 9-token prompts growing to 17 tokens can't both keep running
    for policy, expected_victim in (("priority", "r0"), ("fcfs", "r1")):
        sched = Scheduler(PagePool(7, 4), None, max_running=4, max_step_tokens=32, max_model_len=256, policy=policy)
        low, high = _req(0, 9, prompt_len=9, max_tokens=8), _req(1, -1, prompt_len=9, max_tokens=8)
        sched.add([low, high])
        while sched.has_work():
            plan = sched.schedule()
            sched.update(plan, {k: SampledToken(7) for k, item in enumerate(plan) if item.sample})
        victims = [s.id for s in (low, high) if s.num_preemptions]
        assert victims == [expected_victim], policy
        assert low.outputs == high.outputs == [7] * 8 and sched.pool.num_free == 6


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.integers(1, 12), st.integers(1, 6)), min_size=1, max_size=10),
       st.integers(10, 30))  # fmt: skip
def test_random_priority_workloads_finish_without_leaks(specs, pages):
    sched = Scheduler(PagePool(pages, 4), None, max_running=3, max_step_tokens=16, max_model_len=64, policy="priority")
    reqs = [_req(i, p, prompt_len=n, max_tokens=m) for i, (p, n, m) in enumerate(specs) if n + m <= (pages - 1) * 4]
    sched.add(reqs)
    for _ in range(3000):
        if not sched.has_work():
            break
        plan = sched.schedule()
        sched.update(plan, {k: SampledToken(7) for k, item in enumerate(plan) if item.sample})
        sched.pool.check()
        keys = [sched.order(s) for s in sched.waiting]
        assert keys == sorted(keys)  # the queue stays in (priority, arrival) order, preempted sequences included
    assert all(r.finished and len(r.outputs) == r.params.max_tokens for r in reqs)
    assert sched.pool.num_free == pages - 1


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("priority") / "m"))


def test_engine_refuses_priority_under_fcfs_and_runs_it_under_priority(model):
    params = SamplingParams(max_tokens=2, temperature=0.0, priority=1)
    with Engine(model, EngineConfig(compile=False, background=False)) as engine:
        with pytest.raises(EngineInputError, match="scheduling policy") as err:
            engine.submit([1, 2, 3], params)
        assert err.value.param == "priority"
        assert engine.generate([[1, 2, 3]], attrs.evolve(params, priority=0))  # 0 is the fcfs default
    config = EngineConfig(compile=False, background=False, scheduling_policy="priority")
    with Engine(model, config) as engine:
        [done] = engine.run_batch([[1, 2, 3]], params)
        assert len(done.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")

"""`thread_count.AnyThreadCount`: one compile serves every torch thread count up to the one it was compiled at.

What it replaces is Dynamo's global-state guard, so the tests hold both halves: a lower count compiles nothing
(against plain `torch.compile`, which recompiles: the negative control), and every other field of that state still
counts (a changed default dtype runs eagerly, where the guard-less function alone returns the stale graph's dtype).
Compiles are seen through a backend that records the thread count it was called at.
"""

import os

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from astrai.inference.thread_count import AnyThreadCount, without_global_state

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to lower the thread count")


def _fn(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(3) * x.sum()


class Recorder:
    """A Dynamo backend that compiles with inductor (which bakes the default dtype into the graph) and records the
    thread count of each compile and of each run of a compiled graph."""

    def __init__(self) -> None:
        self.compiles: list[int] = []
        self.runs: list[int] = []

    def __call__(self, gm, example_inputs):
        self.compiles.append(torch.get_num_threads())
        compiled = lookup_backend("inductor")(gm, example_inputs)

        def run(*args):
            self.runs.append(torch.get_num_threads())
            return compiled(*args)

        return run


def _fresh(fn=_fn):
    """A private copy of `fn`'s code object: Dynamo caches per code object, and each test wants its own."""
    return type(fn)(fn.__code__.replace(), fn.__globals__, fn.__name__)


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_a_lower_thread_count_compiles_nothing(two_threads):
    record, plain = Recorder(), Recorder()
    fn = _fresh()
    step = AnyThreadCount(torch.compile(fn, backend=record, options={"guard_filter_fn": without_global_state}),
                          fn, threads=2)  # fmt: skip
    unwrapped = torch.compile(_fresh(), backend=plain)  # negative control: Dynamo's own guards
    x = torch.arange(4.0)
    assert torch.equal(step(x), _fn(x)) and torch.equal(unwrapped(x), _fn(x))
    torch.set_num_threads(1)
    assert torch.equal(step(x), _fn(x)) and torch.equal(unwrapped(x), _fn(x))
    assert record.compiles == [2]  # one compile, at two threads ...
    assert record.runs == [2, 1]  # ... run at the caller's count
    assert plain.compiles == [2, 1]  # "GLOBAL_STATE changed: num_threads"
    assert step.eager_calls == 0 and torch.get_num_threads() == 1


def test_a_call_that_would_compile_at_a_lower_count_compiles_at_the_full_one(two_threads):
    record = Recorder()
    fn = _fresh()
    step = AnyThreadCount(torch.compile(fn, backend=record, options={"guard_filter_fn": without_global_state}),
                          fn, threads=2)  # fmt: skip
    torch.set_num_threads(1)
    x = torch.arange(4.0)
    assert torch.equal(step(x), _fn(x))  # the first compile ever, asked for at one thread
    assert torch.equal(step(x[None]), _fn(x))  # a new shape: a recompile, asked for at one thread
    assert record.compiles == [2, 2] and record.runs == [2, 2] and torch.get_num_threads() == 1
    assert torch.equal(step(x), _fn(x)) and record.runs[-1] == 1  # compiled: now it runs at one thread
    torch.set_num_threads(3)  # more threads than the graphs were made for: they run at their own count
    assert torch.equal(step(x), _fn(x)) and record.compiles == [2, 2] and record.runs[-1] == 2
    assert torch.get_num_threads() == 3


def test_a_changed_global_state_runs_eagerly(two_threads):
    """A graph traced under float32 as the default dtype makes float32 ones; under float64 the step must not
    reuse it. The guard-less compiled function alone does (the negative control)."""
    record = Recorder()
    fn = _fresh()
    compiled = torch.compile(fn, backend=record, options={"guard_filter_fn": without_global_state})
    step = AnyThreadCount(compiled, fn, threads=2)
    x = torch.arange(4.0)
    assert step(x).dtype == torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert step(x).dtype == torch.float64 and step.eager_calls == 1
        torch.set_num_threads(1)
        assert step(x).dtype == torch.float64 and step.eager_calls == 2
        assert compiled(x).dtype == torch.float32  # the stale graph, had nothing checked the state
    finally:
        torch.set_default_dtype(default)
    assert step(x).dtype == torch.float32 and step.eager_calls == 2 and record.compiles == [2]


def test_errors_of_the_step_itself_propagate(two_threads):
    def broken(x):
        raise RuntimeError("the step's own error")

    step = AnyThreadCount(broken, broken, threads=2)
    torch.set_num_threads(1)
    with pytest.raises(RuntimeError, match="own error"):
        step(torch.ones(1))


def _plus_one(x, *, cfg):
    return x + cfg


def test_every_compiled_step_keeps_its_guard_filter():
    """torch.compile pops "guard_filter_fn" from the options dict it is given: passed the shared
    `SERVED_STEP_OPTIONS` / `THREAD_FREE_STEP_OPTIONS` as they are, every step compiled after the first in a
    process (the compiled prefill beside the decode step, a second engine) lost its filter, so its parameter and
    thread-count guards came back. `compile_step` passes a copy: the second step's compile calls the filter too."""
    from astrai.inference.step import SERVED_STEP_OPTIONS, compile_step
    from astrai.inference.thread_count import THREAD_FREE_STEP_OPTIONS

    calls = []
    shared = {"guard_filter_fn": lambda entries: calls.append(len(entries)) or [True] * len(entries)}
    for cfg in (1, 2):
        step = compile_step(_plus_one, cfg=cfg, options=shared, backend="eager")
        assert torch.equal(step(torch.zeros(2)), torch.full((2,), float(cfg)))
    assert len(calls) == 2 and "guard_filter_fn" in shared
    assert "guard_filter_fn" in SERVED_STEP_OPTIONS and "guard_filter_fn" in THREAD_FREE_STEP_OPTIONS

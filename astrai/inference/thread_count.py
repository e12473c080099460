"""Compiled CPU steps that run at any torch thread count up to the one they were compiled at, without recompiling.

`EngineConfig.share_cpu_cores` (`cpu_share`) lowers the stepping thread's `torch.set_num_threads` while another
program holds a core. Dynamo's global-state guard includes `torch.get_num_threads()`, so as compiled by default
every new count recompiled the decode step and the sampler: a stall of seconds at the worst moment (the core is
already contended), which kept the option off by default. Yet the code inductor generated does not depend on the
count: compiled at as many threads as the machine has CPUs, its loops open `#pragma omp parallel` with no
`num_threads` clause (inductor's own rule) and split their work at run time, and its per-thread reduction buffers
are sized for the compile-time count, an upper bound. astrai's C kernels, ATen and oneDNN take the count per call.

So on CPU the engine compiles its steps and sampler without Dynamo's global-state guard (`without_global_state`)
and calls them through `AnyThreadCount`, which puts back what that guard protected, for every other field:

- each call checks the global state (grad mode, autocast, default dtype, deterministic algorithms, the matmul
  precision flags, torch-function dispatch) against the first call's, with the thread count left out (one
  `GlobalStateGuard.check`, ~0.2 µs). A call whose state differs runs eagerly: correct, never a stale graph;
  within the engine the state does not change (its steps run under `torch.inference_mode`);
- a call at more threads than the graphs were compiled for runs at that count (the reduction buffers bound it);
- a call at fewer threads runs under `torch.compiler.set_stance("fail_on_recompile")`: if it would compile (a
  batch size never seen), it compiles at the full count instead, so no graph is ever specialised to a reduced one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from astrai.inference.step import SERVED_STEP_OPTIONS, compile_step, without_param_guards
from astrai.models.config import ModelConfig

_GlobalState = torch._C._dynamo.guards.GlobalStateGuard


def without_global_state(entries: Sequence[Any]) -> list[bool]:
    """A Dynamo guard filter that drops the global-state guard (the thread count among its fields), which
    `AnyThreadCount` checks itself; keeps every other guard."""
    return [entry.guard_type != "GLOBAL_STATE" for entry in entries]


def _served_thread_free(entries: Sequence[Any]) -> list[bool]:
    """`step.without_param_guards` and `without_global_state` together: the CPU engine's step guards."""
    return [a and b for a, b in zip(without_param_guards(entries), without_global_state(entries), strict=True)]


# `step.SERVED_STEP_OPTIONS` for a CPU engine's steps, which `AnyThreadCount` calls
THREAD_FREE_STEP_OPTIONS: dict[str, Any] = {**SERVED_STEP_OPTIONS, "guard_filter_fn": _served_thread_free}


def compile_served(fn: Callable[..., Any], *, cfg: ModelConfig, device: torch.device, eager: Callable[..., Any]
                   ) -> Callable[..., Any]:  # fmt: skip
    """`fn` compiled as the engine compiles the steps it serves (`step.compile_step`): without the parameters'
    guards (`SERVED_STEP_OPTIONS`) and, on CPU, without the global-state guard, called through `AnyThreadCount` at
    any thread count up to the current one (`eager` runs a call whose global state differs)."""
    if device.type != "cpu":
        return compile_step(fn, cfg=cfg, options=SERVED_STEP_OPTIONS)
    compiled = compile_step(fn, cfg=cfg, options=THREAD_FREE_STEP_OPTIONS)
    return AnyThreadCount(compiled, eager, torch.get_num_threads())


def _is_recompile_refusal(error: RuntimeError) -> bool:
    return "fail_on_recompile" in str(error)


class AnyThreadCount:
    """Calls `compiled` (built with `without_global_state`) at the caller's torch thread count, within the bounds
    of the module docstring; `eager` runs the calls whose global state differs from the first call's.

    `threads`: the count every graph is compiled at (the engine's starting count)."""

    def __init__(self, compiled: Callable[..., Any], eager: Callable[..., Any], threads: int) -> None:
        self.compiled, self.eager, self.threads = compiled, eager, threads
        self._reference: dict[str, Any] | None = None  # the first call's global state (`GlobalStateGuard`)
        self._expected: dict[int, Any] = {}  # that state at each thread count seen, as a guard to check
        self.eager_calls = 0  # calls run eagerly since their global state differed (tests read it)

    def _state_matches(self, threads: int) -> bool:
        if self._reference is None:
            self._reference = json.loads(_GlobalState().__getstate__())
            self._reference["num_threads"] = self.threads
        guard = self._expected.get(threads)
        if guard is None:
            guard = _GlobalState()
            guard.__setstate__(json.dumps({**self._reference, "num_threads": threads}))
            self._expected[threads] = guard
        return guard.check()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        if not self._state_matches(threads):
            self.eager_calls += 1
            return self.eager(*args, **kwargs)
        if threads == self.threads:
            return self.compiled(*args, **kwargs)
        if threads < self.threads:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):  # refuses Dynamo's first compile too
                    return self.compiled(*args, **kwargs)
            except RuntimeError as error:
                if not _is_recompile_refusal(error):
                    raise
        return self._at(self.threads, *args, **kwargs)

    def _at(self, threads: int, *args: Any, **kwargs: Any) -> Any:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return self.compiled(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

"""CPU cores shared with other programs: the engine's step threads follow the cores the others leave (Linux).

A CPU decode step runs ~150 OpenMP parallel regions on `torch.get_num_threads()` threads, each ending in a barrier.
When another program keeps a core busy, one of two step threads is descheduled at nearly every barrier, and the
step waits for the scheduler: on the 2-core development VM batch-1 fp32 decode kept 9% of its quiet rate under one
busy process (27% with astrai's shorter OpenMP spin, `astrai.openmp`), while the same engine on one thread kept
98% of its own one-thread rate, 66% of the two-thread quiet one (docs/benchmarks-history.md, "CPU: astrai beside
llama.cpp and vLLM's CPU build").

So the engine measures, every 0.5 s of stepping (0.1 s for the first window after an idle gap), how much CPU
time other processes took: all CPUs' busy
time from /proc/stat (steal included: a hypervisor's other guests count as others) minus this process's own
(/proc/self/stat, every thread, spinning included). It then runs its steps on the cores left, rounded, between 1
and the thread count it started with, through `torch.set_num_threads` on the stepping thread. The first step after
an idle gap cannot wait for a window (it is often the longest: a batch's whole prefill, 1.7 s quiet on the Xeon VM
for 16 x 128 tokens, 5.6-5.9 s on two threads beside a busy process), so it runs on the cores that no other
process's thread was runnable on in any of a few /proc/stat samples 1 ms apart (`others_running_now`: the
kernel's `procs_running` minus this process's own running threads; the fewest of the samples, so a thread that
runs for a moment does not count). Every kind of
parallel region follows the count: ATen and oneDNN read it per call, astrai's C kernels are passed it, and
inductor's compiled loops use the runtime count when they were compiled for all of the machine's CPUs (its
`#pragma omp parallel` without `num_threads`). `restore` gives the starting count back (a notebook's thread after
its `generate` call); the next step applies the decision again.

Off where it cannot help or would misread: off Linux, with one thread, and for tensor-parallel engines (their
ranks are other processes, which would count as the competition). On by default: the compiled steps and sampler
run at any count up to the starting one without recompiling (`astrai.inference.thread_count`); until that existed
Dynamo's guard on the thread count recompiled them at each new count, and the option was opt-in.
`ASTRAI_SHARE_CPU_CORES=0` makes the default off (the test suite does, for run-to-run identical bits).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@attrs.frozen
class CpuTimes:
    """One reading: a monotonic time, busy CPU ticks of the whole machine, and this process's own ticks."""

    wall_s: float
    busy_ticks: int
    own_ticks: int


def others_running_now(samples: int = 4, spacing_s: float = 0.001) -> int | None:
    """Threads of other processes running or runnable now: the fewest over `samples` readings of /proc/stat's
    `procs_running` less this process's threads in state R; None where /proc cannot be read. ~30 µs a sample."""
    fewest = None
    for i in range(samples):
        if i:
            time.sleep(spacing_s)
        try:
            text = Path("/proc/stat").read_text()
            at = text.index("procs_running ") + len("procs_running ")
            running = int(text[at : text.index("\n", at)])
            own = 0
            for task in os.listdir("/proc/self/task"):
                try:
                    own += Path(f"/proc/self/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
                except (OSError, IndexError):  # the thread ended meanwhile
                    continue
        except (OSError, ValueError):
            return None
        others = max(0, running - own)
        fewest = others if fewest is None else min(fewest, others)
    return fewest


def read_cpu_times() -> CpuTimes | None:
    """The machine's busy ticks (all but idle and iowait, over every CPU) and this process's user + system ticks;
    None where /proc cannot be read."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is inside user)
    return CpuTimes(time.monotonic(), busy, int(own[11]) + int(own[12]))  # utime, stime (fields 14, 15)


class SharedCores:
    """Sets the stepping thread's torch thread count to the cores other processes leave; see the module doc."""

    def __init__(self, threads: int, *, cpus: int | None = None, interval_s: float = 0.5, first_s: float = 0.1,
                 read: Callable[[], CpuTimes | None] = read_cpu_times,
                 running: Callable[[], int | None] = others_running_now,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:  # fmt: skip
        self.threads = threads  # the most it uses: the count it started with
        self.cpus = cpus or os.cpu_count() or 1
        self.interval_s, self.first_s, self._read, self._set = interval_s, first_s, read, set_threads
        self._running = running
        self.current = self.applied = threads  # the count decided; the count set on the stepping thread now
        self.switches = 0  # how often the count changed (Engine.stats does not report it; tests and benchmarks do)
        self._last: CpuTimes | None = None  # the reading that opened the current window
        self._window_s, self._ended_s = first_s, 0.0  # its length; when the last step ended

    def others(self, now: CpuTimes) -> float:
        """CPUs' worth of time other processes used since the last reading."""
        last = self._last
        seconds = max(now.wall_s - last.wall_s, 1e-9)
        return max(0.0, (now.busy_ticks - last.busy_ticks) - (now.own_ticks - last.own_ticks)) / TICKS_PER_S / seconds

    def before_step(self) -> None:
        """Called by the engine before each step. Readings cover stepping time only: the first step, or the first
        after an idle gap (a new `generate` call, a server's first request in a while), opens a fresh window of
        `first_s`, since a gap's average says what others did while this engine had no work; later windows last
        `interval_s`. Each window's end decides the count; the stepping thread then runs the decided one (after a
        `restore`, the last decision until the first window ends, unless a gap came between: then the cores no
        other process's thread is running on now, since what others did before the gap says little about now)."""
        now_s = time.monotonic()
        if self._last is None or now_s - self._ended_s > self.interval_s:
            self._last, self._window_s = self._read(), self.first_s
            others = self._running()  # the decision from before the gap is stale: what runs now, until measured
            self.current = self.threads if others is None else min(self.threads, max(1, self.cpus - others))
        elif now_s - self._last.wall_s >= self._window_s and (now := self._read()) is not None:
            want = min(self.threads, max(1, int(self.cpus - self.others(now) + 0.5)))
            self._last, self._window_s = now, self.interval_s
            if want != self.current:
                self.current, self.switches = want, self.switches + 1
        if self.applied != self.current:
            self._set(self.current)
            self.applied = self.current

    def after_step(self) -> None:
        """Called by the engine after each step (a gap counts from here: a long step is not idle time)."""
        self._ended_s = time.monotonic()

    def restore(self) -> None:
        """The starting count back on this thread; the decision stays for the next `before_step`."""
        if self.applied != self.threads:
            self._set(self.threads)
            self.applied = self.threads


def shared_cores(device: torch.device, tensor_parallel_size: int, enabled: bool) -> SharedCores | None:
    """The engine's monitor, or None where it is off (not CPU, not Linux, one thread, tensor parallel)."""
    threads = torch.get_num_threads()
    if not enabled or device.type != "cpu" or tensor_parallel_size > 1 or threads < 2 or read_cpu_times() is None:
        return None
    return SharedCores(threads)

"""astrai's OpenMP wait setting for CPU work on cores shared with other programs (imported before torch).

Every parallel region of a CPU step (inductor's loops, oneDNN's products, astrai's C kernels: ~150 per decode
step of a 30-layer model) ends in a barrier. torch's OpenMP runtime (GNU libgomp) lets a thread that reaches a
barrier early spin `GOMP_SPINCOUNT` times before it sleeps: 300,000 by default, milliseconds of spinning. On a quiet
machine that costs nothing. When another program holds a core, the thread the barrier waits for is descheduled,
and the spinning thread keeps the very core it needs, so each barrier can wait for a scheduler time slice: batch-1
decode fell 11x under one competing busy process (issue 46's measurement) where vLLM, whose Intel OpenMP runtime
spins only briefly, fell 2.9x.

libgomp reads its settings once, when it is loaded (by `import torch`), so `astrai/__init__.py` calls
`set_default_spin_count` before anything imports torch. It sets `GOMP_SPINCOUNT` to `SPIN_COUNT` unless the user
set `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` (theirs wins) or torch is already imported (too late to matter: the
setting would only mislead child processes' readers, so it is left alone). Child processes (tensor-parallel ranks,
replicas) inherit it. `benchmarks/bench_shared_cores.py` measures the choice (docs/inference.md, "CPU: cores
shared with other programs").
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN_COUNT = "10000"
"""Spins before a waiting OpenMP thread sleeps: long enough to bridge the gap between two parallel regions of a
step (so a quiet machine loses nothing), short enough to give a shared core back within tens of microseconds."""


def set_default_spin_count(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT to `SPIN_COUNT` when neither it nor OMP_WAIT_POLICY is set and torch is not yet
    imported; True when it did."""
    environ = os.environ if environ is None else environ
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ or "torch" in sys.modules:
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: release the threads, keep nothing else


def release_idle_threads() -> bool:
    """Let the calling thread's idle OpenMP worker threads exit (libgomp's `omp_pause_resource_all`); True when
    some libgomp of the process did.

    Why: libgomp counts every worker thread of every thread's pool, and while that count exceeds the CPUs it cuts
    the spin of waiting threads to 100 rounds (`gomp_throttled_spin_count_var`), so workers sleep and are woken
    through the kernel at every parallel region. A background engine thread has a pool of its own beside the pool
    of the thread that loaded the model and warmed it up: on the 2-core box that made a 16-request bf16 `Engine`
    1.8x slower on its thread than on the caller's (222-231 against 407-422 tok/s; docs/benchmarks-history.md,
    "CPU: a background engine thread and libgomp's thread count"). Releasing the idle pool restores it (416-424).

    Call it from a thread that is done with parallel work for now (it must not be inside a parallel region); the
    next torch op of that thread that runs in parallel builds a new pool, and the engine slows again while it
    lives. Linux only (the libgomp the process has mapped, found in /proc/self/maps); False elsewhere, without
    libgomp (an LLVM or Intel OpenMP build of torch), or with a libgomp older than OpenMP 5.0 (GCC 9)."""
    released = False
    for pause in _pause_functions():
        released |= pause(OMP_PAUSE_SOFT) == 0
    return released


_PAUSES: list | None = None


def _pause_functions() -> list:
    """`omp_pause_resource_all` of each libgomp the process has mapped; looked up once (Engine.generate calls
    `release_idle_threads` per call), and again while none is found (torch not yet imported)."""
    global _PAUSES
    if _PAUSES:
        return _PAUSES
    import ctypes  # lazily: this module is imported before torch, on every `import astrai`

    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return []
    found = []
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        found.append(pause)
    _PAUSES = found
    return found


def share_cpu_cores_default() -> bool:
    """`EngineConfig.share_cpu_cores`' default: on, unless the environment sets `ASTRAI_SHARE_CPU_CORES=0`."""
    return os.environ.get("ASTRAI_SHARE_CPU_CORES", "1") != "0"

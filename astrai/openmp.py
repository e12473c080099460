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

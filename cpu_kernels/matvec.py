"""Few-row products `x @ cat(weights).T` on AVX-512 CPUs: the matrix-vector work of batch-1..8 decode.

Why a hand-written kernel: decode on CPU reads every weight once per token per row of the batch, unless a
kernel reads it once for several rows. Inductor's multiply + row-sum loop (`astrai.ops.linear`) re-reads each
weight per row, and oneDNN/MKL run these shapes at 6-10 GB/s. `matvec.c` walks each weight row by row as one
contiguous stream, two x rows per pass; bf16 uses AVX512-BF16's `vdpbf16ps` (exact products, fp32
accumulation), so the weight is never widened. Measured over all projections of SmolLM2-135M on the 2-core
development box: 16-25 GB/s against the loop's 5-12 (bf16, 1-4 rows); a compiled decode step 1.6-2.4x faster
in bf16 at 2-8 rows, 1.1-1.4x in fp32 at 2-4 (docs/benchmarks.md, "CPU matvec kernel").

The C source is compiled on first use with the C compiler the machine already has for `torch.compile`'s CPU
code (`$CC`, else `cc`, `gcc` or `clang`), into `$XDG_CACHE_HOME/astrai/cpu_kernels` (else
`~/.cache/astrai/cpu_kernels`), one file per source and compiler, in well under a second. It links the
process's own libgomp (torch's) and runs on `torch.get_num_threads()` threads.

`supports(dtype)` says whether the kernel runs here: an x86-64 CPU with AVX-512 (F, BW, VL; plus AVX512-BF16
for bf16), a working compiler, and `ASTRAI_CPU_KERNELS` not set to 0. `unavailable_reason()` says why not.
The `astrai::cpu_matvec` op is always correct: where the kernel cannot run it computes `matvec_ref`.
No autograd: callers use it only when no gradient is needed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["build_dir", "matvec", "matvec_ref", "supports", "unavailable_reason"]

SOURCE = Path(__file__).with_name("matvec.c")
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
_FEATURE_BITS = {torch.float32: 1, torch.bfloat16: 2}  # astrai_cpu_features(): AVX-512, AVX512-BF16
_FUNCTIONS = {torch.float32: "astrai_matvec_f32", torch.bfloat16: "astrai_matvec_bf16"}
# x, M, K, weight pointers, weight rows, weight count, y, threads
_ARGUMENTS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.POINTER(ctypes.c_void_p),
              ctypes.POINTER(ctypes.c_long), ctypes.c_long, ctypes.c_void_p, ctypes.c_int)  # fmt: skip


def _disabled() -> bool:
    return os.environ.get("ASTRAI_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")


def _compiler() -> list[str] | None:
    """The C compiler command: `$CC` (may carry flags), else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    found = next((shutil.which(name) for name in ("cc", "gcc", "clang") if shutil.which(name)), None)
    return [found] if found else None


def build_dir() -> Path:
    """Where the compiled library is kept: `$XDG_CACHE_HOME/astrai/cpu_kernels`, else ~/.cache/astrai/..."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "astrai" / "cpu_kernels"


class _Loaded:
    """The ctypes library's kernels by dtype, or why there are none (built once per process)."""

    def __init__(self) -> None:
        self.kernels: dict[torch.dtype, Any] = {}
        self.reason: str | None = None
        self.features = 0


_STATE: _Loaded | None = None
_LOCK = threading.Lock()


def _build(compiler: list[str], *, fresh: bool = False) -> Path:
    """Compile matvec.c into the cache (skipped when this source and compiler were built before, unless `fresh`)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([*compiler, *_FLAGS]).encode()).hexdigest()[:16]
    target = build_dir() / f"matvec-{key}.so"
    if target.exists() and not fresh:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # compile to a private name and rename: a concurrent build by another process never leaves a torn file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [*compiler, *_FLAGS, str(SOURCE), "-o", partial], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise OSError(f"{' '.join(compiler)} failed on {SOURCE.name}: {proc.stderr.strip()[-600:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _open(compiler: list[str]) -> ctypes.CDLL:
    """Load the cached library; one that fails to load or lacks the entry points (a truncated or foreign file
    under the cache's name) is rebuilt once rather than leaving the kernel off for good."""
    try:
        library = ctypes.CDLL(str(_build(compiler)))
        for name in ("astrai_cpu_features", *_FUNCTIONS.values()):
            getattr(library, name)
        return library
    except (OSError, AttributeError):
        target = _build(compiler, fresh=True)
    # loaded from a private copy: a damaged file that did load stays open under the cache's name, and dlopen
    # would hand that one back (the copy is unlinked at once; the mapping outlives the name)
    fd, private = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        shutil.copyfile(target, private)
        return ctypes.CDLL(private)
    finally:
        os.unlink(private)


def _load() -> _Loaded:
    global _STATE
    if _STATE is not None:
        return _STATE
    with _LOCK:
        if _STATE is None:
            state = _Loaded()
            compiler = _compiler()
            if _disabled():
                state.reason = "disabled by ASTRAI_CPU_KERNELS=0"
            elif platform.machine().lower() not in ("x86_64", "amd64"):
                state.reason = f"needs an x86-64 CPU with AVX-512 (this one is {platform.machine()})"
            elif compiler is None:
                state.reason = "no C compiler found (set CC, or install gcc or clang)"
            else:
                try:
                    library = _open(compiler)
                    state.features = library.astrai_cpu_features()
                except (OSError, AttributeError, subprocess.SubprocessError) as error:
                    state.reason = f"could not build the kernel: {error}"
                else:
                    for dtype, name in _FUNCTIONS.items():
                        if state.features & _FEATURE_BITS[dtype]:
                            state.kernels[dtype] = function = getattr(library, name)
                            function.argtypes = _ARGUMENTS
                            function.restype = None
            _STATE = state
    return _STATE


def unavailable_reason(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the kernel cannot run `dtype` products here, or None when it can (builds it on first call)."""
    if dtype not in _FEATURE_BITS:
        return f"{dtype} is not supported (fp32 and bf16 are)"
    state = _load()
    if state.reason is not None:
        return state.reason
    if dtype not in state.kernels:
        return "this CPU lacks AVX512-BF16" if dtype == torch.bfloat16 else "this CPU lacks AVX-512 (F, BW, VL)"
    return None


@torch.compiler.assume_constant_result
def supports(dtype: torch.dtype) -> bool:
    """Whether `matvec` runs the kernel for `dtype` here. A constant to `torch.compile`, which calls it once
    while tracing (so the first compiled trace builds the library)."""
    return unavailable_reason(dtype) is None


def matvec_ref(x: Tensor, weights: Sequence[Tensor]) -> Tensor:
    """The plain-torch reference: x [M, K] @ cat(weights).T in fp32 -> [M, sum N] fp32."""
    return x.float() @ torch.cat([w.float() for w in weights]).T


def _check(x: Tensor, weights: Sequence[Tensor]) -> None:
    if x.dim() != 2 or not weights:
        raise ValueError(f"matvec takes x [M, K] and at least one weight, got x {tuple(x.shape)}")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(
                f"matvec weight {tuple(w.shape)} {w.dtype} on {w.device} does not fit x {tuple(x.shape)} "
                f"{x.dtype} on {x.device} (wanted [N, {x.shape[1]}], same dtype and device)"
            )


def matvec(x: Tensor, weights: Sequence[Tensor]) -> Tensor:
    """x [M, K] @ cat(weights).T -> [M, sum N] fp32: one call for weights that share an input (q/k/v,
    gate/up), each weight's columns after the previous one's. The kernel where `supports(x.dtype)`, else
    `matvec_ref`. Meant for few rows (it loads each weight once per two rows of x)."""
    _check(x, weights)
    kernel = _load().kernels.get(x.dtype) if x.device.type == "cpu" and x.shape[1] else None
    if kernel is None:
        return matvec_ref(x, weights)
    x = x if x.is_contiguous() else x.contiguous()
    weights = [w if w.is_contiguous() else w.contiguous() for w in weights]
    pointers, rows, total = _arrays(weights)
    out = torch.empty(x.shape[0], total, dtype=torch.float32)
    if out.numel():
        kernel(x.data_ptr(), x.shape[0], x.shape[1], pointers, rows, len(weights), out.data_ptr(),
               torch.get_num_threads())  # fmt: skip
    return out


# (data pointer, rows, columns) of each weight -> the ctypes arrays of their pointers and rows, and the total
# rows: building them costs as much as the rest of a call, and decode passes the same weights every step. The
# key holds the shapes too, so a freed weight's address reused by another tensor never meets a stale entry.
_ARRAYS: dict[tuple, tuple[Any, Any, int]] = {}
_MAX_ARRAYS = 4096


def _arrays(weights: Sequence[Tensor]) -> tuple[Any, Any, int]:
    key = tuple((w.data_ptr(), *w.shape) for w in weights)
    found = _ARRAYS.get(key)
    if found is None:
        if len(_ARRAYS) >= _MAX_ARRAYS:
            _ARRAYS.clear()
        count = len(weights)
        found = _ARRAYS[key] = (
            (ctypes.c_void_p * count)(*(w.data_ptr() for w in weights)),
            (ctypes.c_long * count)(*(w.shape[0] for w in weights)),
            sum(w.shape[0] for w in weights),
        )
    return found


# `torch.ops.astrai.cpu_matvec`: opaque to torch.compile, which calls it from compiled decode steps. Registered
# with torch.library directly rather than `custom_op`: a dispatch costs ~8 us here against ~18 us, and decode
# calls it ~120 times per token.
_LIBRARY = torch.library.Library("astrai", "FRAGMENT")
_LIBRARY.define("cpu_matvec(Tensor x, Tensor[] weights) -> Tensor")
_LIBRARY.impl("cpu_matvec", matvec, "CPU")


@torch.library.register_fake("astrai::cpu_matvec", lib=_LIBRARY)
def _(x: Tensor, weights: list[Tensor]) -> Tensor:
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights), dtype=torch.float32)

"""Build and load the C kernels of this folder: one shared library from every `*.c` source, once per process.

The sources are compiled on first use with the C compiler the machine already has for `torch.compile`'s CPU
code (`$CC`, else `cc`, `gcc` or `clang`), into `$XDG_CACHE_HOME/astrai/cpu_kernels` (else
`~/.cache/astrai/cpu_kernels`), one file per set of sources and compiler, in about a second; a build removes the
files of other sources unused for a week. The library links the process's own libgomp (torch's); the kernels
take their thread count from the caller.

`load()` returns the library with the CPU's features, or why there is none: `ASTRAI_CPU_KERNELS=0`, not x86-64,
no compiler, or a failed build. The kernel modules (`matvec`, `decode_attention`) add their own checks (dtype,
AVX512-BF16) on top.

With the library, `load()` also builds `ops.cpp` with the C++ compiler (`$CXX`, else c++, g++ or clang++; ~2 s,
cached the same way, per torch version) against torch's stable ABI, loads it, and hands it the kernels' addresses:
its CPU kernels of the `astrai::cpu_decode_attention`, `astrai::cpu_matvec` and `astrai::cpu_lora_delta` ops then
take precedence over the Python ones, which stay registered under CompositeExplicitAutograd. `Library.ops_reason`
says why not, where not (no C++ compiler, no torch headers, a failed build); the ops keep working through Python,
only slower per call.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["AMX", "AVX512", "AVX512_BF16", "Library", "bind", "build_dir", "constant_when_compiled", "load"]

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # included by the sources: hashed with them
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
OPS_SOURCE = Path(__file__).parent / "ops.cpp"
_TORCH_DIR = Path(torch.__file__).resolve().parent
# the stable ABI's shim functions live in libtorch_cpu; torch's own libraries are loaded RTLD_LOCAL, so link them
_OPS_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", f"-I{_TORCH_DIR / 'include'}", f"-L{_TORCH_DIR / 'lib'}",
              "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{_TORCH_DIR / 'lib'}")  # fmt: skip
# bits of astrai_cpu_features(): AVX-512 F/BW/VL; AVX512-BF16 as well; AMX (tiles and bf16, granted by the OS) as well
AVX512, AVX512_BF16, AMX = 1, 2, 4
FEATURES = {torch.float32: AVX512, torch.bfloat16: AVX512_BF16}  # what each dtype's kernels need


class Library:
    """The loaded ctypes library and `astrai_cpu_features()`, or `reason` why it could not be had."""

    def __init__(self, cdll: ctypes.CDLL | None = None, features: int = 0, reason: str | None = None) -> None:
        self.cdll, self.features, self.reason = cdll, features, reason
        self.ops_reason: str | None = reason  # why the ops' C++ kernels are not loaded, or None


_LIBRARY: Library | None = None
_LOCK = threading.Lock()


def _disabled() -> bool:
    return os.environ.get("ASTRAI_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")


def _compiler(variable: str = "CC", names: Sequence[str] = ("cc", "gcc", "clang")) -> list[str] | None:
    """The compiler command: `$variable` (may carry flags), else the first of `names` on PATH (C by default; the
    C++ one is `_compiler("CXX", CXX_NAMES)`)."""
    if os.environ.get(variable, "").strip():
        return shlex.split(os.environ[variable])
    found = next((shutil.which(name) for name in names if shutil.which(name)), None)
    return [found] if found else None


CXX_NAMES = ("c++", "g++", "clang++")


def build_dir() -> Path:
    """Where the compiled library is kept: `$XDG_CACHE_HOME/astrai/cpu_kernels`, else ~/.cache/astrai/..."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "astrai" / "cpu_kernels"


def _build(
    compiler: list[str], *, fresh: bool = False, sources: Sequence[Path] = SOURCES, flags: Sequence[str] = _FLAGS,
    stem: str = "kernels",
) -> Path:  # fmt: skip
    """Compile `sources` into the cache as `{stem}-{digest}.so` (skipped when these sources, flags, compiler and torch
    version were built before, unless `fresh`)."""
    digest = hashlib.sha256(" ".join([*compiler, *flags, torch.__version__]).encode())
    for source in (*sources, *HEADERS):
        digest.update(source.name.encode() + source.read_bytes())
    target = build_dir() / f"{stem}-{digest.hexdigest()[:16]}.so"
    if target.exists() and not fresh:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # compile to a private name and rename: a concurrent build by another process never leaves a torn file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        # sources before flags: a linker with --as-needed drops libraries named before the objects that use them
        command = [*compiler, *map(str, sources), *flags, "-o", partial]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            names = " ".join(source.name for source in sources)
            raise OSError(f"{' '.join(compiler)} failed on {names}: {proc.stderr.strip()[-600:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    _remove_stale(target, stem)
    return target


STALE_AFTER_S = 7 * 24 * 3600


def _remove_stale(kept: Path, stem: str) -> None:
    """Delete the libraries of other sources or compilers (one per source version, left by upgrades) that no process
    has loaded for `STALE_AFTER_S` (`_open` touches the file it loads). A younger one may belong to another checkout
    that shares the cache; a process that has one loaded keeps its mapping, and one that needs it again rebuilds it
    in a second or two."""
    cutoff = time.time() - STALE_AFTER_S
    for old in kept.parent.glob(f"{stem}-*.so"):
        try:
            if old != kept and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # removed by another process meanwhile, or not ours to remove
            pass


def _open(compiler: list[str], entries: tuple[str, ...], **build: Any) -> ctypes.CDLL:
    """Load the cached library (`build`: `_build`'s sources, flags and stem); one that fails to load or lacks an
    entry point (a truncated or foreign file under the cache's name) is rebuilt once rather than leaving the kernels
    off for good."""
    try:
        target = _build(compiler, **build)
        _check_complete(target)
        cdll = ctypes.CDLL(str(target))
        for name in entries:
            getattr(cdll, name)
        with contextlib.suppress(OSError):  # marks it in use (`_remove_stale`); a read-only cache is fine
            os.utime(target)
        return cdll
    except (OSError, AttributeError):
        target = _build(compiler, fresh=True, **build)
    # loaded from a private copy: a damaged file that did load stays open under the cache's name, and dlopen
    # would hand that one back (the copy is unlinked at once; the mapping outlives the name)
    fd, private = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        shutil.copyfile(target, private)
        return ctypes.CDLL(private)
    finally:
        os.unlink(private)


def _check_complete(path: Path) -> None:
    """Raise OSError unless `path` is an x86-64 ELF file holding every segment and section its headers name. dlopen
    maps a truncated library's segments past the end of the file, and the process dies of SIGBUS on touching them
    (a short file, cut by a damaged disk or a copy that did not finish, crashed the loading process)."""
    data = path.read_bytes()
    if len(data) < 64 or data[:6] != b"\x7fELF\x02\x01":  # ELF, 64-bit, little-endian
        raise OSError(f"{path} is not a 64-bit ELF library")
    ph_off, sh_off = struct.unpack_from("<QQ", data, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from("<HHHH", data, 0x36)
    end = max(ph_off + ph_size * ph_count, sh_off + sh_size * sh_count)
    if end > len(data):
        raise OSError(f"{path} is truncated ({len(data)} of at least {end} bytes)")
    for index in range(ph_count):  # each segment's bytes in the file: p_offset at +8, p_filesz at +32
        (offset,) = struct.unpack_from("<Q", data, ph_off + index * ph_size + 8)
        (size,) = struct.unpack_from("<Q", data, ph_off + index * ph_size + 32)
        end = max(end, offset + size)
    if end > len(data):
        raise OSError(f"{path} is truncated ({len(data)} of {end} bytes)")


# every kernel module's entry points: a cached library missing one of them is stale or damaged
ENTRIES = ("astrai_cpu_features", "astrai_matvec_f32", "astrai_matvec_bf16", "astrai_matvec_i8_f32",
           "astrai_matvec_i8_bf16", "astrai_decode_attention_f32", "astrai_decode_attention_bf16", "astrai_lora_f32",
           "astrai_lora_bf16", "astrai_amx_bf16", "astrai_rms_norm_f32", "astrai_rms_norm_bf16", "astrai_silu_mul_f32",
           "astrai_silu_mul_bf16", "astrai_rotary_kv_store_f32", "astrai_rotary_kv_store_bf16")  # fmt: skip


def load() -> Library:
    """The library, built on the first call of the process (thread-safe); later calls return the same one."""
    global _LIBRARY
    if _LIBRARY is not None:
        return _LIBRARY
    with _LOCK:
        if _LIBRARY is None:
            compiler = _compiler()
            if _disabled():
                _LIBRARY = Library(reason="disabled by ASTRAI_CPU_KERNELS=0")
            elif platform.machine().lower() not in ("x86_64", "amd64"):
                _LIBRARY = Library(reason=f"needs an x86-64 CPU with AVX-512 (this one is {platform.machine()})")
            elif compiler is None:
                _LIBRARY = Library(reason="no C compiler found (set CC, or install gcc or clang)")
            else:
                try:
                    cdll = _open(compiler, ENTRIES)
                    _LIBRARY = Library(cdll, cdll.astrai_cpu_features())
                except (OSError, AttributeError, subprocess.SubprocessError) as error:
                    _LIBRARY = Library(reason=f"could not build the kernel: {error}")
                else:
                    _LIBRARY.ops_reason = _load_ops(_LIBRARY)
    return _LIBRARY


def _load_ops(kernels: Library) -> str | None:
    """Build and load `ops.cpp` (registering its CPU kernels of the ops) and bind the C kernels' addresses for
    the dtypes this CPU runs; None, or why not. Bound before the first call: `load()` runs under its lock."""
    compiler = _compiler("CXX", CXX_NAMES)
    if compiler is None:
        return "no C++ compiler found (set CXX, or install g++ or clang++)"
    if not (_TORCH_DIR / "include" / "torch" / "csrc" / "stable" / "library.h").is_file():
        return f"torch's stable C++ headers are not installed under {_TORCH_DIR / 'include'}"
    try:
        ops = _open(compiler, ("astrai_ops_bind",), sources=(OPS_SOURCE,), flags=_OPS_FLAGS, stem="ops")
    except (OSError, AttributeError, subprocess.SubprocessError) as error:
        return f"could not build the C++ ops: {error}"

    def address(name: str, dtype: torch.dtype) -> int | None:  # None (null) where this CPU lacks the instructions
        if not kernels.features & FEATURES[dtype]:
            return None
        return ctypes.cast(getattr(kernels.cdll, name), ctypes.c_void_p).value

    ops.astrai_ops_bind.argtypes = [ctypes.c_void_p] * 8
    ops.astrai_ops_bind(
        address("astrai_decode_attention_f32", torch.float32), address("astrai_decode_attention_bf16", torch.bfloat16),
        address("astrai_matvec_f32", torch.float32), address("astrai_matvec_bf16", torch.bfloat16),
        address("astrai_matvec_i8_f32", torch.float32), address("astrai_matvec_i8_bf16", torch.bfloat16),
        address("astrai_lora_f32", torch.float32), address("astrai_lora_bf16", torch.bfloat16),
    )  # fmt: skip
    return None


def constant_when_compiled(fn: Any) -> Any:
    """`torch.compiler.assume_constant_result` without importing Dynamo: `torch.compile` calls `fn` once while
    tracing and keeps its result as a constant. The public decorator imports `torch._dynamo` (~1.5 s on 2 cores)
    just to set this marker; the kernel modules are imported with `astrai`, and many processes (eager runs,
    training rank workers, tools that only load models) never compile. `tests/cpu_kernels` checks the marker is
    the public decorator's."""
    fn._dynamo_marked_constant = True
    return fn


def bind(functions: dict[torch.dtype, str], argtypes: Sequence[Any], restype: Any) -> dict[torch.dtype, Any]:
    """The ctypes entries `functions` names, typed, for each dtype whose instructions this CPU has (empty without
    the library)."""
    loaded, out = load(), {}
    for dtype, name in functions.items():
        if loaded.cdll is not None and loaded.features & FEATURES[dtype]:
            out[dtype] = function = getattr(loaded.cdll, name)
            function.argtypes, function.restype = list(argtypes), restype
    return out

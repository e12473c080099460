"""Build and call the cuda_ref kernels under the CPU emulator of `sim/cuda_sim.h` (no GPU needed).

`build(dir)` rewrites each `cuda_ref/*.cu` into plain C++ for the emulator (kernel launches become
`sim::launch(...)`, `__shared__` arrays become per-block poisoned buffers), compiles the three files and
`sim/sim_entry.cpp` with g++ in parallel, and links a shared library. `Sim` wraps its C entry points for
torch CPU tensors with the cuda_ref op signatures, plus `mma` to pick the kernel path.
Needs g++ and the CUDA headers (cuda_fp16.h / cuda_bf16.h for the host conversions); `missing()` says why
not when either is absent.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[2]
CUDA_REF = ROOT / "cuda_ref"
SIM_DIR = Path(__file__).resolve().parent / "sim"
KERNEL_FILES = ("decode_attention.cu", "extend_attention.cu", "rotary.cu")
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\[\];")
_SHARED = re.compile(r"__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\[([^\]]+)\];")
_LAUNCH = re.compile(r"(\w+(?:<[^<>;]*>)?)<<<(.+?)>>>\(")


def cuda_include() -> Path | None:
    """The CUDA toolkit include dir (holding cuda_fp16.h), from CUDA_HOME, nvcc's location or /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.insert(2, str(Path(nvcc).resolve().parent.parent))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_fp16.h").exists():
            return Path(c) / "include"
    return None


def missing() -> str | None:
    """Why the emulator cannot be built here, or None when it can."""
    if shutil.which("g++") is None:
        return "g++ not found"
    if cuda_include() is None:
        return "CUDA headers (cuda_fp16.h) not found: set CUDA_HOME"
    return None


def translate(source: str) -> str:
    """CUDA source -> C++ for the emulator (see sim/cuda_sim.h for what each rewrite stands for)."""
    source = _EXTERN_SHARED.sub(r"\1* \2 = ::sim::dynamic_shared<\1>();", source)
    source = _SHARED.sub(r'\1* \2 = ::sim::shared_array<\1>((\3), "\2");', source)
    return _LAUNCH.sub(r"::sim::launch(\1, \2, ", source)


def build(out_dir: Path) -> Path:
    """Compile the emulated kernels into `out_dir/libcuda_ref_sim.so` and return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    include = cuda_include()
    flags = [
        "g++",
        "-std=c++20",
        "-O2",
        "-fPIC",
        "-w",
        "-U_FORTIFY_SOURCE",
        f"-I{CUDA_REF}",
        f"-I{include}",
        f"-I{SIM_DIR}",
    ]
    jobs = []
    for name in KERNEL_FILES:
        src = out_dir / name.replace(".cu", ".cpp")
        src.write_text(translate((CUDA_REF / name).read_text()))
        jobs.append([*flags, "-include", "cuda_sim.h", "-c", str(src), "-o", str(src.with_suffix(".o"))])
    jobs.append([*flags, "-include", "cuda_sim.h", "-c", str(SIM_DIR / "sim_entry.cpp"), "-o", str(out_dir / "e.o")])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs))
    for cmd, res in zip(jobs, results, strict=True):
        if res.returncode != 0:
            raise RuntimeError(f"emulator build failed: {' '.join(cmd)}\n{res.stderr[-4000:]}")
    lib = out_dir / "libcuda_ref_sim.so"
    objs = [str(out_dir / n.replace(".cu", ".o")) for n in KERNEL_FILES] + [str(out_dir / "e.o")]
    subprocess.run(["g++", "-shared", "-o", str(lib), *objs], check=True, capture_output=True)
    return lib


def _ptr(t: Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


class Sim:
    """The emulated ops on CPU tensors (same contracts as `cuda_ref`, caches and block tables contiguous)."""

    def __init__(self, lib_path: Path) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.sim_message.restype = ctypes.c_char_p
        self.last_num_splits = 0

    def _check(self, rc: int, op: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{op}: emulated launch failed ({rc}): {self.lib.sim_message().decode()}")

    def rotary(
        self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None, *, interleaved=False
    ) -> tuple[Tensor, Tensor]:
        q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
        i64 = ctypes.c_int64
        rc = self.lib.sim_rotary(
            _ptr(q), _ptr(k), _ptr(q_out), _ptr(k_out), _ptr(cos), _ptr(sin), _ptr(positions),
            i64(q.shape[0]), i64(q.shape[1]), i64(k.shape[1]), i64(q.shape[2]), i64(cos.shape[0]),
            i64(q.stride(0)), i64(q.stride(1)), i64(k.stride(0)), i64(k.stride(1)),
            ctypes.c_int(int(interleaved)), ctypes.c_int(_DTYPES[q.dtype]),
        )  # fmt: skip
        self._check(rc, "rotary")
        return q_out, k_out

    def decode_attention(
        self, q, k_cache, v_cache, block_table, seq_lens, *, page_size, scale, window=0, mma=True
    ) -> Tensor:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)  # every element must be written
        i64, splits = ctypes.c_int64, ctypes.c_int64(0)
        b, h, d = q.shape
        rc = self.lib.sim_decode(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_table), _ptr(seq_lens), _ptr(out),
            i64(b), i64(h), i64(k_cache.shape[1]), i64(d), i64(block_table.shape[1]), i64(page_size),
            i64(q.stride(0)), i64(q.stride(1)), i64(window), ctypes.c_float(scale),
            ctypes.c_int(_DTYPES[q.dtype]), ctypes.c_int(int(mma)), ctypes.byref(splits),
        )  # fmt: skip
        self._check(rc, "decode_attention")
        self.last_num_splits = splits.value
        return out

    def extend_attention(
        self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *, page_size, scale, window=0, mma=True
    ) -> Tensor:
        out = torch.zeros(q.shape, dtype=q.dtype)  # the binding zero-fills too
        i64 = ctypes.c_int64
        t, h, d = q.shape
        rc = self.lib.sim_extend(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(cu_seqlens_q), _ptr(seq_lens), _ptr(block_table),
            _ptr(out), i64(t), i64(seq_lens.shape[0]), i64(h), i64(k_cache.shape[1]), i64(d),
            i64(block_table.shape[1]), i64(page_size), i64(q.stride(0)), i64(q.stride(1)), i64(window),
            ctypes.c_float(scale), ctypes.c_int(_DTYPES[q.dtype]), ctypes.c_int(int(mma)),
        )  # fmt: skip
        self._check(rc, "extend_attention")
        return out

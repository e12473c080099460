"""Compile-only check of the CUDA references: `python -m cuda_ref.compile_check` (no GPU needed).

Compiles each `.cu` file with `nvcc -c -std=c++17` for sm_80 (the tensor-core path) and for the lowest
architecture below 80 that this nvcc supports (sm_75 for CUDA 12/13: the `ASTRAI_NO_MMA` scalar fallback),
with torch's include dirs and the `__CUDA_NO_HALF_*` flags torch builds extensions with. `bindings.cpp` is
compiled once by nvcc's host compiler with `-std=c++20` (torch's headers need it); on a CPU-only torch wheel,
which lacks the generated `c10/cuda/impl/cuda_cmake_macros.h`, `C10_CUDA_NO_CMAKE_CONFIGURE_FILE` stands in.
Objects go to a temp dir and are discarded; nothing is linked (that needs a CUDA build of torch).

Prints one OK/FAIL line per job, with the compiler output of failures and any warning raised in our own
files; exits 1 if anything failed, 0 otherwise, and 0 with the reason when nvcc is missing (skip).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

DIR = Path(__file__).resolve().parent
KERNELS = ("decode_attention.cu", "extend_attention.cu", "rotary.cu")
BINDINGS = "bindings.cpp"
_HALF_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


@dataclass(frozen=True)
class Job:
    """One compile: `name` is what the report shows (file and arch)."""

    name: str
    cmd: tuple[str, ...]


@dataclass(frozen=True)
class Result:
    job: Job
    ok: bool
    seconds: float
    output: str


def find_nvcc() -> str | None:
    """nvcc from PATH, else $CUDA_HOME/bin/nvcc, else /usr/local/cuda/bin/nvcc."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return None


def target_archs(nvcc: str) -> list[int]:
    """[80, the lowest supported arch below 80] (just [80] when nvcc has nothing older)."""
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    archs = sorted({int(m) for m in re.findall(r"compute_(\d+)", out)})
    older = [a for a in archs if a < 80]
    return [80, 75] if 75 in older else [80, *older[:1]]


def torch_includes() -> list[str]:
    import torch

    root = Path(torch.__file__).resolve().parent / "include"
    return [str(root), str(root / "torch" / "csrc" / "api" / "include")]


def jobs(nvcc: str, out_dir: Path) -> list[Job]:
    """The compile commands: every kernel file for every target arch, then the bindings."""
    includes = torch_includes()
    system = [arg for inc in includes for arg in ("-isystem", inc)]
    result = []
    for arch in target_archs(nvcc):
        for name in KERNELS:
            obj = out_dir / f"{Path(name).stem}_sm{arch}.o"
            cmd = [nvcc, "-std=c++17", f"-arch=sm_{arch}", "-c", str(DIR / name), "-o", str(obj)]
            cmd += [*_HALF_FLAGS, *system, f"-I{DIR}", "-Xcompiler", "-fPIC,-Wall,-Wextra"]
            result.append(Job(f"{name} sm_{arch}", tuple(cmd)))
    cmd = [nvcc, "-std=c++20", "-c", str(DIR / BINDINGS), "-o", str(out_dir / "bindings.o"), *system, f"-I{DIR}"]
    cmd += ["-Xcompiler", "-fPIC,-Wall,-Wextra"]
    if not (Path(includes[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        cmd.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    result.append(Job(f"{BINDINGS} host", tuple(cmd)))
    return result


def own_warnings(output: str) -> list[str]:
    """Warning lines that point into cuda_ref's own files (header warnings of other projects are ignored)."""
    ours = (*KERNELS, BINDINGS, "common.cuh", "launch.cuh")
    return [ln for ln in output.splitlines() if "warning" in ln.lower() and any(f in ln for f in ours)]


def run_job(job: Job) -> Result:
    start = time.perf_counter()
    proc = subprocess.run(job.cmd, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    ok = proc.returncode == 0 and not own_warnings(output)
    return Result(job, ok, time.perf_counter() - start, output)


def check(parallel: int | None = None) -> list[Result] | None:
    """Run every compile job (in parallel threads); None when nvcc is missing."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="astrai_cuda_ref_check_") as tmp:
        todo = jobs(nvcc, Path(tmp))
        with ThreadPoolExecutor(max_workers=parallel or os.cpu_count() or 2) as pool:
            return list(pool.map(run_job, todo))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = check(args.jobs)
    if results is None:
        print("cuda_ref compile check skipped: nvcc not found (put it on PATH or set CUDA_HOME)")
        return 0
    for r in results:
        print(f"{'OK  ' if r.ok else 'FAIL'} {r.job.name} ({r.seconds:.1f}s)")
        if not r.ok:
            print("  $ " + " ".join(r.job.cmd))
            print("\n".join("  " + ln for ln in r.output.strip().splitlines()[-40:]))
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed}/{len(results)} compiled in {time.perf_counter() - start:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

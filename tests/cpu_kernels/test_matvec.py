"""cpu_kernels.matvec: the AVX-512 few-row product equals torch's fp32 product, builds safely, and falls back.

The kernel tests skip on CPUs without AVX-512 (and bf16 ones without AVX512-BF16); on a CPU whose flags list
them, the kernel must build (so CI on such a box cannot pass by silently running the reference).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from astrai.cpu_kernels import library
from astrai.cpu_kernels import matvec as cpu_matvec
from astrai.ops import packed_linear
from astrai.ops.linear import (
    F32_KERNEL_MAX_ROWS,
    INT8_EAGER_MAX_ROWS,
    INT8_KERNEL_MAX_ROWS,
    MAX_REDUCE_ROWS,
    kernel_rows,
    linear,
    linears,
    reduce_rows,
)
from helpers import assert_close


@pytest.fixture(autouse=True)
def kernel_for_small_weights(monkeypatch):
    """These tests' weights are small, and small weights keep inductor's loop (`ops.linear.SMALL_WEIGHT_BYTES`,
    tested in tests/astrai/ops/test_packed_linear.py); here the kernel's own paths are under test."""
    from astrai.ops import linear as ops_linear

    monkeypatch.setattr(ops_linear, "SMALL_WEIGHT_BYTES", 0)


ROOT = Path(__file__).resolve().parents[2]
FLAGS = {torch.float32: "avx512f", torch.bfloat16: "avx512_bf16"}  # /proc/cpuinfo's names


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()}


def _needs_kernel(dtype: torch.dtype) -> None:
    if not cpu_matvec.supports(dtype):
        pytest.skip(f"no CPU matvec kernel here: {cpu_matvec.unavailable_reason(dtype)}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_builds_where_the_cpu_has_the_instructions(dtype):
    if FLAGS[dtype] not in _cpu_flags() or os.environ.get("ASTRAI_CPU_KERNELS") == "0":
        pytest.skip(f"this CPU does not list {FLAGS[dtype]}")
    assert cpu_matvec.unavailable_reason(dtype) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 15, 33, 100, 576])
def test_kernel_matches_the_fp32_product(dtype, rows, k):
    _needs_kernel(dtype)
    x = torch.randn(rows, k).to(dtype)
    weights = [torch.randn(n, k).to(dtype) for n in (7, 1, 40)]
    out = cpu_matvec.matvec(x, weights)
    expected = cpu_matvec.matvec_ref(x, weights)
    assert out.shape == (rows, 48) and out.dtype == torch.float32
    # bf16 products are exact in fp32 on both sides: only the summation order differs
    assert_close(out, expected, atol=1e-5 * k**0.5, rtol=1e-5)
    # negative control: the weights' order decides where each one's columns land
    swapped = cpu_matvec.matvec(x, weights[::-1])
    assert not torch.allclose(swapped, expected)
    assert_close(swapped[:, :40], expected[:, 8:], atol=1e-5 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 15, 33, 100, 576])
def test_int8_weights_match_the_product_with_their_integers(dtype, rows, k):
    _needs_kernel(dtype)
    x = torch.randn(rows, k).to(dtype)
    weights = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for n in (7, 1, 40)]
    out = cpu_matvec.matvec(x, weights)
    expected = x.double() @ torch.cat(weights).double().T
    assert out.shape == (rows, 48) and out.dtype == torch.float32
    # bf16 x: exact products, fp32 sums; fp32 x: one rounding per product as well
    assert_close(out.double(), expected, atol=2e-6 * 127 * k**0.5, rtol=1e-6)
    # negative control: the weights are read as signed bytes (as unsigned, -1 would count as 255)
    assert not torch.allclose(out.double(), x.double() @ torch.cat(weights).view(torch.uint8).double().T)


def call_kernel(name: str, x: torch.Tensor, weights: list[torch.Tensor], threads: int) -> tuple[int, torch.Tensor]:
    """A C entry of the library with the matvec signature called directly, e.g. gemm_i8.c's blocked GEMM (the op
    reaches it only from 22 rows): (its status, y [M, sum N] fp32, NaN where nothing was written)."""
    import ctypes

    fn = getattr(library.load().cdll, name)
    fn.restype = ctypes.c_int
    y = torch.full((x.shape[0], sum(w.shape[0] for w in weights)), float("nan"))
    pointers = (ctypes.c_void_p * len(weights))(*(w.data_ptr() for w in weights))
    rows = (ctypes.c_long * len(weights))(*(w.shape[0] for w in weights))
    args = (ctypes.c_void_p(x.data_ptr()), ctypes.c_long(x.shape[0]), ctypes.c_long(x.shape[1]), pointers, rows,
            ctypes.c_long(len(weights)), ctypes.c_void_p(y.data_ptr()), ctypes.c_int(threads))  # fmt: skip
    return fn(*args), y


def _gemm_i8(x: torch.Tensor, weights: list[torch.Tensor], threads: int) -> torch.Tensor:
    status, y = call_kernel("astrai_gemm_i8_f32", x, weights, threads)
    assert status == 0
    return y


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 40, 41, 48, 70])
@pytest.mark.parametrize("k", [1, 17, 576, 3000])
def test_int8_gemm_matches_the_product_with_their_integers(rows, k):
    # every tail: x blocks of 32 rows with 1-31 left (one or two vectors, masked stores), weights of 7 and 13 rows
    # (a partial tile of 12), 200 rows (several L2 panels per thread at K = 576 and 3000), K not a multiple of 16.
    # Through the op's entry, 33, 40 and 70 rows leave their last 1, 8 and 6 rows to the matvec loop, 41 does not.
    _needs_kernel(torch.float32)
    gen = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=gen)
    weights = [torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8) for n in (7, 200, 13)]
    expected = x.double() @ torch.cat(weights).double().T
    # one fp32 accumulator per output, summed in k order: its rounding error grows with the sum of |x w|
    bound = 1e-6 * (x.double().abs() @ torch.cat(weights).double().abs().T)
    one, two = _gemm_i8(x, weights, 1), _gemm_i8(x, weights, 2)
    assert ((two.double() - expected).abs() <= bound).all()  # and no NaN left: every output written
    assert torch.equal(one, two)  # each output is one tile's sum, whichever thread runs it
    # negative control: the weights are read as signed bytes
    assert not torch.allclose(two.double(), x.double() @ torch.cat(weights).view(torch.uint8).double().T)
    # the op's entry point takes the GEMM from 22 rows and the matvec loop below: both give the product
    assert ((cpu_matvec.matvec(x, weights).double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 7, 10, 12, 16, 17, 32])
@pytest.mark.parametrize("k", [1, 17, 576, 1600])
def test_fp32_blocked_kernel_matches_the_product(rows, k):
    # gemm_f32.c: blocks of 6 x rows and one of 4 for a last 1-4 (10 rows: 6 + 4, 7: 6 + a padded 1), weight groups
    # of 4 rows with a zero-padded copy for the last 3, 2 or 1 (7, 13 and 202 rows), K with and without a masked
    # tail of 16, and the prefetch two groups ahead (202 rows)
    _needs_kernel(torch.float32)
    gen = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=gen)
    weights = [torch.randn(n, k, generator=gen) for n in (7, 202, 13)]
    expected = x.double() @ torch.cat(weights).double().T
    bound = 2e-6 * (x.double().abs() @ torch.cat(weights).double().abs().T) + 1e-30
    status, one = call_kernel("astrai_gemm_f32", x, weights, 1)
    status2, two = call_kernel("astrai_gemm_f32", x, weights, 2)
    assert status == status2 == 0
    assert ((two.double() - expected).abs() <= bound).all()  # and no NaN left: every output written
    assert torch.equal(one, two)  # each output is one block's sum, whichever thread runs it
    # negative control: the group order decides where each weight's columns land
    _, swapped = call_kernel("astrai_gemm_f32", x, weights[::-1], 2)
    assert not torch.allclose(swapped, two)
    # the op's entry takes it from 3 rows (1-2: the row kernel): both give the product
    assert ((cpu_matvec.matvec(x, weights).double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_independent_of_the_thread_count(dtype):
    # each output is one thread's dot product, so the split between threads cannot change a bit
    _needs_kernel(dtype)
    x, weight = torch.randn(3, 300).to(dtype), torch.randn(517, 300).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_matvec.matvec(x, [weight])
        torch.set_num_threads(2)
        two = cpu_matvec.matvec(x, [weight])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_strided_inputs_and_empty_shapes():
    _needs_kernel(torch.float32)
    x = torch.randn(32, 6)[:, ::2].T  # [3, 32], strided in both dimensions
    weight = torch.randn(32, 20).T  # [20, 32] transposed view
    assert_close(cpu_matvec.matvec(x, [weight]), x @ weight.T, atol=1e-5)
    assert cpu_matvec.matvec(torch.randn(0, 8), [torch.randn(4, 8)]).shape == (0, 4)
    assert torch.equal(cpu_matvec.matvec(torch.randn(2, 0), [torch.randn(4, 0)]), torch.zeros(2, 4))


def test_mismatched_inputs_name_the_problem():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"wanted \[N, 8\]"):
        cpu_matvec.matvec(x, [torch.randn(4, 9)])
    with pytest.raises(ValueError, match="of x's dtype or every one int8"):
        cpu_matvec.matvec(x, [torch.randn(4, 8).bfloat16()])
    with pytest.raises(ValueError, match="every one int8"):
        cpu_matvec.matvec(x, [torch.ones(4, 8, dtype=torch.int8), x[:, :8]])
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        cpu_matvec.matvec(torch.randn(8), [torch.randn(4, 8)])
    with pytest.raises(ValueError, match="at least one weight"):
        cpu_matvec.matvec(x, [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_linears_call_the_kernel_once_per_group(dtype, monkeypatch):
    _needs_kernel(dtype)
    from torch._inductor.utils import run_and_get_code

    from astrai.ops import linear as ops_linear

    x = torch.randn(1, 2, 64).to(dtype)
    weights = [torch.randn(n, 64).to(dtype) for n in (64, 16, 16)]
    biases = [torch.randn(64).to(dtype), None, torch.randn(16).to(dtype)]
    torch._dynamo.reset()
    outs, (code,) = run_and_get_code(torch.compile(linears, fullgraph=True), x, weights, biases)
    assert code.count("torch.ops.astrai.cpu_matvec.default(") == 1  # q/k/v in one call
    for out, w, b in zip(outs, weights, biases, strict=True):
        expected = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert_close(out, expected.to(dtype), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)

    # one row takes the kernel too (MIN_KERNEL_ROWS: 1.22x on a bf16 step of the AMX Xeon, no loss elsewhere)
    one = x[:, :1]
    torch._dynamo.reset()
    outs, (code,) = run_and_get_code(torch.compile(linears, fullgraph=True), one, weights, biases)
    assert code.count("torch.ops.astrai.cpu_matvec.default(") == 1
    assert_close(outs[0], F.linear(one.float(), weights[0].float(), biases[0].float()).to(dtype), atol=1e-2)
    # negative control: weights under SMALL_WEIGHT_BYTES keep inductor's loop at one row
    monkeypatch.setattr(ops_linear, "SMALL_WEIGHT_BYTES", 1 << 20)
    torch._dynamo.reset()
    outs, (code,) = run_and_get_code(torch.compile(linears, fullgraph=True), one, weights, biases)
    assert "cpu_matvec.default(" not in code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_int8_products_call_the_kernel_and_apply_the_scales(dtype):
    _needs_kernel(dtype)
    from torch._inductor.utils import run_and_get_code

    q = torch.randint(-127, 128, (48, 64), dtype=torch.int8)
    # scales of a real weight's size (max|row| / 127 ~ 0.01): products ~10, so a bias ~ N(0, 1) multiplied by its
    # scale (or dropped) is off by ~1, past bf16's tolerance of the output's rounding (1% of the largest)
    scale, bias = ((torch.rand(48) + 0.5) * 0.01).to(dtype), torch.randn(48).to(dtype)
    expected_of = lambda x: F.linear(x.float(), q.float()) * scale.float() + bias.float()  # noqa: E731
    for rows in (1, 2, MAX_REDUCE_ROWS):
        x = torch.randn(rows, 64).to(dtype)
        torch._dynamo.reset()
        out, (code,) = run_and_get_code(torch.compile(linear, fullgraph=True, dynamic=False), x, q, bias, scale)
        assert code.count("cpu_matvec.default(") == 1, rows
        expected = expected_of(x)
        assert out.dtype == dtype
        tol = (1e-2 if dtype == torch.bfloat16 else 1e-6) * expected.abs().max().item()  # bf16: the output's rounding
        assert_close(out.float(), expected, atol=tol)
        # negative control: without its scale the product is far off
        assert (out.float() - F.linear(x.float(), q.float())).abs().max() > 1.0
    # bf16: up to 32 rows compiled and 24 eager, the widened GEMM past them; fp32: any number (the blocked GEMM from 22)
    bounds = {"compiled": INT8_KERNEL_MAX_ROWS.get(dtype), "eager": INT8_EAGER_MAX_ROWS.get(dtype)}
    assert bounds == ({"compiled": 32, "eager": 24} if dtype == torch.bfloat16 else {"compiled": None, "eager": None})
    for rows in (16, 24, 25, 32, 33, 40):
        x = torch.randn(rows, 64).to(dtype)
        for name, fn in (("eager", linear), ("compiled", torch.compile(linear, fullgraph=True, dynamic=False))):
            torch._dynamo.reset()
            with torch.profiler.profile() as prof:
                out = fn(x, q, bias, scale)
            called = any(e.name == "astrai::cpu_matvec" for e in prof.events())
            assert called == (bounds[name] is None or rows <= bounds[name]), (name, rows)
            tol = (1e-2 if dtype == torch.bfloat16 else 1e-6) * expected_of(x).abs().max().item()
            assert_close(out.float(), expected_of(x), atol=tol)
    # one row: eager, the kernel (nothing to fuse with; fp32 would otherwise widen the whole weight for one row)
    x = torch.randn(1, 64).to(dtype)
    with torch.profiler.profile() as prof:
        out = linear(x, q, bias, scale)
    assert any(e.name == "astrai::cpu_matvec" for e in prof.events())
    assert_close(
        out.float(),
        expected_of(x),
        atol=(1e-2 if dtype == torch.bfloat16 else 1e-6) * expected_of(x).abs().max().item(),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_counts_past_the_measured_bound_keep_the_loop(dtype):
    _needs_kernel(dtype)
    from torch._inductor.utils import run_and_get_code

    weight = torch.randn(24, 32).to(dtype)
    bound = reduce_rows(dtype)  # fp32: 3 (oneDNN's packed GEMM wins from 4), bf16: MAX_REDUCE_ROWS
    assert bound == (3 if dtype == torch.float32 and packed_linear.AVAILABLE else MAX_REDUCE_ROWS)
    # bf16 on an AMX CPU: the kernel's tiles take batched rows too, up to AMX_MAX_ROWS (tests/cpu_kernels/test_amx.py)
    bound = kernel_rows(dtype)
    for rows in (bound, bound + 1):  # past it the products are GEMMs (oneDNN packs)
        x = torch.randn(rows, 32).to(dtype)
        torch._dynamo.reset()
        out, (code,) = run_and_get_code(torch.compile(linear, fullgraph=True, dynamic=False), x, weight)
        assert ("cpu_matvec.default(" in code) == (rows <= bound), rows
        assert ("packed_linear.default(" in code) == (rows > bound), rows
        assert_close(out, F.linear(x.float(), weight.float()).to(dtype), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_compiled_fp32_products_of_4_to_32_rows_take_the_kernel_packed_or_not():
    # fp32 from 4 rows: the blocked kernel (gemm_f32.c) up to F32_KERNEL_MAX_ROWS whether oneDNN packed the weights
    # or not; past it the packs
    _needs_kernel(torch.float32)
    if not packed_linear.AVAILABLE:
        pytest.skip("no oneDNN linear ops in this torch build")
    weights = [torch.randn(n, 48) for n in (40, 8)]
    biases = [torch.randn(40), None]
    compiled = torch.compile(linears, fullgraph=True, dynamic=False)
    for rows, packed in ((6, False), (6, True), (F32_KERNEL_MAX_ROWS, True), (F32_KERNEL_MAX_ROWS + 1, True)):
        x = torch.randn(rows, 48)
        expected = [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        torch._dynamo.reset()
        if packed:
            packed_linear.pack_group(weights)
        with torch.profiler.profile() as prof:
            outs = compiled(x, weights, biases)
        names = {e.name for e in prof.events()}
        kernel = rows <= F32_KERNEL_MAX_ROWS
        assert ("astrai::cpu_matvec" in names) == kernel and ("mkldnn::_linear_pointwise" in names) == (not kernel)
        for out, want in zip(outs, expected, strict=True):
            assert_close(out, want, atol=1e-5)


def test_products_that_need_a_gradient_keep_the_loop():
    _needs_kernel(torch.float32)
    from torch._inductor.utils import run_and_get_code

    x, weight = torch.randn(4, 32), torch.randn(8, 32, requires_grad=True)
    torch._dynamo.reset()
    out, (code, *_) = run_and_get_code(torch.compile(linear, fullgraph=True), x, weight)
    assert "cpu_matvec.default(" not in code  # the op has no backward
    out.sum().backward()
    assert_close(weight.grad, x.sum(0).expand(8, 32), atol=1e-5)


_SUBPROCESS = """
import torch
from astrai.cpu_kernels import matvec as m
x, w = torch.randn(2, 40), torch.randn(5, 40)
print(m.unavailable_reason(torch.float32))
assert torch.allclose(m.matvec(x, [w]), x @ w.T, atol=1e-5)  # the op stays correct without the kernel
"""


def _fresh(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", _SUBPROCESS], env=environment, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"ASTRAI_CPU_KERNELS": "0"}, "disabled by ASTRAI_CPU_KERNELS=0"),
        (
            {"CC": "false"},
            "could not build the kernel: false failed on amx.c decode_attention.c gemm_f32.c gemm_i8.c lora.c matvec.c",
        ),
    ],
)
def test_without_a_kernel_the_op_falls_back_and_says_why(tmp_path, env, reason):
    proc = _fresh(tmp_path, **env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(reason)
    assert not list((tmp_path / "astrai" / "cpu_kernels").glob("*.so"))  # no half-written library is left


def test_a_damaged_cached_library_is_rebuilt(tmp_path, monkeypatch):
    """A truncated file, then a loadable library without the kernels' entry points, under the cache's name: each is
    rebuilt and loaded. In this process (`library._open`, what `load()` calls once per process): every damaged file
    is a new one at a path this process has not mapped, as a fresh process would find it."""
    if "avx512f" not in _cpu_flags() or not cpu_matvec.supports(torch.float32):
        pytest.skip("no AVX-512 kernel here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = library._compiler()
    built = library._build(compiler)  # the first build, not loaded here
    # a tiny file dlopen rejects; the library's first 4 KiB, whose headers pass and whose segments dlopen would map
    # past the end of the file (SIGBUS; `library._check_complete` refuses it); a foreign library
    for content in (b"\x7fELF truncated", built.read_bytes()[:4096], None):
        if content is None:  # a loadable library without the kernel's entry points, under the cache's name
            source, foreign = tmp_path / "other.c", tmp_path / "other.so"
            source.write_text("int unrelated(void) { return 1; }\n")
            subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(foreign)], check=True, timeout=60)
            os.replace(foreign, built)
        else:
            built.write_bytes(content)
        cdll = library._open(compiler, library.ENTRIES)
        assert cdll.astrai_cpu_features() == library.load().features  # the kernels' library, loaded
        assert built.stat().st_size > 20000  # the real library again (the foreign one is ~15 kB)


@pytest.mark.slow  # ~11 s (several processes build at once); the damaged-library test above runs in CI
def test_concurrent_first_builds_share_one_library(tmp_path):
    if "avx512f" not in _cpu_flags() or not cpu_matvec.supports(torch.float32):
        pytest.skip("no AVX-512 kernel here")
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _SUBPROCESS], env=environment, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0] and outputs == ["None"] * 3
    built = list((tmp_path / "astrai" / "cpu_kernels").iterdir())
    # one C library and one C++ ops library (where a C++ compiler builds it), no temporary files left behind
    stems = sorted(path.name.split("-")[0] for path in built)
    assert stems in (["kernels"], ["kernels", "ops"]) and all(path.suffix == ".so" for path in built), built
    assert ("ops" in stems) == (library.load().ops_reason is None)

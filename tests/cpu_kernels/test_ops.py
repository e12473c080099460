"""cpu_kernels/ops.cpp: the C++ CPU kernels of `astrai::cpu_decode_attention`, `astrai::cpu_matvec` and
`astrai::cpu_lora_delta`.

Where a C++ compiler builds it, the dispatcher's CPU kernel of each op is ops.cpp's. These tests hold it to the
plain-torch references and, bit for bit, to the Python implementations it replaces (both call the same C kernel);
bad inputs raise an error naming the problem; and without a C++ compiler (a subprocess with CXX=/bin/false) the
ops keep working through their Python kernels, with `ops_reason` saying why.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai.cpu_kernels import decode_attention as cpu_attention
from astrai.cpu_kernels import library
from astrai.cpu_kernels import lora as cpu_lora
from astrai.cpu_kernels import matvec as cpu_matvec
from astrai.triton_kernels.decode_attention import decode_attention_ref
from helpers import assert_close

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16]


def _needs_ops(dtype: torch.dtype) -> None:
    reason = library.load().ops_reason or cpu_matvec.unavailable_reason(dtype)
    if reason is not None:
        pytest.skip(f"no C++ op kernels for {dtype} here: {reason}")


def test_the_cpu_kernels_are_the_cpp_ones():
    _needs_ops(torch.float32)
    for name in ("cpu_decode_attention", "cpu_matvec", "cpu_lora_delta"):
        dump = torch._C._dispatch_dump(f"astrai::{name}")
        cpu = next(line for line in dump.splitlines() if line.startswith("CPU:"))
        assert "ops.cpp" in cpu, dump  # not the Python kernel, which serves under CompositeExplicitAutograd


def _pool(lens, *, heads, kv_heads, dim, page=16, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(1, -(-max(lens) // page))
    num_pages = len(lens) * width + 3
    k = torch.randn(num_pages * page, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_pages * page, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(num_pages, generator=gen)[: len(lens) * width].int().view(len(lens), width)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, k, v, table.contiguous(), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "dim", "window"),
    [([17, 5, 40], 6, 2, 64, 0), ([1500], 9, 3, 64, 0), ([33, 700], 8, 8, 80, 100), ([64, 0], 16, 1, 256, 0)],
)
def test_attention_op_equals_the_reference_and_the_python_kernel(dtype, lens, heads, kv_heads, dim, window):
    _needs_ops(dtype)
    q, k, v, table, seq_lens = _pool(lens, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype)
    scale = dim**-0.5
    out = torch.ops.astrai.cpu_decode_attention(q, k, v, table, seq_lens, 16, scale, window)
    ref = decode_attention_ref(q, k, v, table, seq_lens, page_size=16, scale=scale, window=window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    python = cpu_attention.decode_attention(q, k, v, table, seq_lens, page_size=16, scale=scale, window=window)
    assert torch.equal(out, python)
    # strided q and block table are made contiguous first, as the Python kernel does
    strided_q = torch.cat([q, q], dim=2)[:, :, :dim]
    strided_table = torch.stack([table, table], dim=2)[:, :, 0]
    strided = torch.ops.astrai.cpu_decode_attention(strided_q, k, v, strided_table, seq_lens, 16, scale, window)
    assert torch.equal(strided, out)


def test_attention_op_edge_shapes():
    _needs_ops(torch.float32)
    q, k, v, table, lens = _pool([5], heads=2, kv_heads=1, dim=16, dtype=torch.float32)
    empty = torch.ops.astrai.cpu_decode_attention(q[:0], k, v, table[:0], lens[:0], 16, 1.0, 0)
    assert empty.shape == (0, 2, 16)
    # a pool smaller than one page holds no tokens: zeros, as the Python kernel gives
    small = torch.ops.astrai.cpu_decode_attention(q, k[:8], v[:8], table, lens, 16, 1.0, 0)
    assert torch.equal(small, torch.zeros_like(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_matvec_op_equals_the_reference_and_the_python_kernel(dtype, rows):
    _needs_ops(dtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    weights = [torch.randn(n, 96, generator=gen).to(dtype) for n in (40, 8, 17)]
    out = torch.ops.astrai.cpu_matvec(x, weights)
    assert out.dtype == torch.float32 and out.shape == (rows, 65)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert_close(out, cpu_matvec.matvec_ref(x, weights), atol=tol, rtol=tol)
    assert torch.equal(out, cpu_matvec.matvec(x, weights))
    # a transposed weight and a strided x are read through contiguous copies
    transposed = weights[0].T.contiguous().T
    assert not transposed.is_contiguous()
    strided_x = torch.cat([x, x], dim=1)[:, :96]
    assert torch.equal(torch.ops.astrai.cpu_matvec(strided_x, [transposed, *weights[1:]]), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: fp32's blocked GEMM (gemm_i8.c)
def test_matvec_op_with_int8_weights_equals_the_reference_and_the_python_kernel(dtype, rows):
    _needs_ops(dtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 100, generator=gen).to(dtype)  # 100: a masked tail in both kernels' blocks
    weights = [torch.randint(-127, 128, (n, 100), generator=gen, dtype=torch.int8) for n in (40, 8, 17)]
    out = torch.ops.astrai.cpu_matvec(x, weights)
    assert out.dtype == torch.float32 and out.shape == (rows, 65)
    assert_close(out, cpu_matvec.matvec_ref(x, weights), atol=1e-3, rtol=1e-5)
    assert torch.equal(out, cpu_matvec.matvec(x, weights))
    unaligned = torch.randint(-127, 128, (40 * 100 + 3,), generator=gen, dtype=torch.int8)[3:].view(40, 100)
    assert torch.equal(torch.ops.astrai.cpu_matvec(x, [unaligned]), cpu_matvec.matvec(x, [unaligned]))


def test_matvec_op_edge_shapes():
    _needs_ops(torch.float32)
    assert torch.ops.astrai.cpu_matvec(torch.randn(0, 8), [torch.randn(4, 8)]).shape == (0, 4)
    assert torch.equal(torch.ops.astrai.cpu_matvec(torch.randn(2, 0), [torch.randn(4, 0)]), torch.zeros(2, 4))
    assert torch.ops.astrai.cpu_matvec(torch.randn(2, 8), [torch.randn(0, 8)]).shape == (2, 0)


def test_bad_inputs_raise_an_error_naming_the_problem():
    _needs_ops(torch.float32)
    q, k, v, table, lens = _pool([20], heads=6, kv_heads=2, dim=64, dtype=torch.float32)
    attention = torch.ops.astrai.cpu_decode_attention
    cases = [
        ((q.double(), k, v, table, lens, 16, 1.0, 0), "share one dtype"),
        ((q.double(), k.double(), v.double(), table, lens, 16, 1.0, 0), "wanted float32 or bfloat16"),
        ((q[0], k, v, table, lens, 16, 1.0, 0), "must be 3-d"),
        ((q, k, v[:, :1], table, lens, 16, 1.0, 0), "shapes differ"),
        ((q[:, :, :40], k[:, :, :40], v[:, :, :40], table, lens, 16, 1.0, 0), "head dim 40"),
        ((q[:, :5], k, v, table, lens, 16, 1.0, 0), "heads 5 over 2"),
        ((q, k.transpose(1, 2).contiguous().transpose(1, 2), v, table, lens, 16, 1.0, 0), "last dim"),
        ((q, k, v, table.long(), lens, 16, 1.0, 0), "int32"),
        ((q, k, v, table, lens, 0, 1.0, 0), "page size 0"),
        ((q, k, v, torch.cat([table, table]), lens, 16, 1.0, 0), "block_table rows 2"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            attention(*args)
    matvec = torch.ops.astrai.cpu_matvec
    x = torch.randn(2, 8)
    for args, message in [
        ((x, [torch.randn(4, 9)]), r"wanted \[N, 8\]"),
        ((x, [torch.randn(4, 8).double()]), "of x's dtype"),
        ((torch.randn(8), [torch.randn(4, 8)]), r"x \[M, K\]"),
        ((x, []), "at least one weight"),
        ((x.half(), [torch.randn(4, 8).half()]), "float32 and bfloat16 are supported"),
        ((x, [torch.ones(4, 8, dtype=torch.int8), torch.randn(4, 8)]), "every one int8"),
        ((x.half(), [torch.ones(4, 8, dtype=torch.int8)]), "float32 and bfloat16 are supported"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            matvec(*args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_op_equals_the_python_kernel_and_names_bad_inputs(dtype):
    _needs_ops(dtype)
    gen = torch.Generator().manual_seed(0)
    x, a, b = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((5, 40), (3, 6, 40), (33, 3, 6)))
    scaling, slot_ids = torch.tensor([0.5, 2.0, 0.0]), torch.tensor([2, -1, 0, 1, 1])
    out = torch.ops.astrai.cpu_lora_delta(x, a, b, scaling, slot_ids)
    assert torch.equal(out, cpu_lora.lora_delta(x, a, b, scaling, slot_ids))  # one C kernel behind both
    assert_close(out, cpu_lora.lora_delta_ref(x, a, b, scaling, slot_ids), atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.ops.astrai.cpu_lora_delta(x.T.contiguous().T, a, b, scaling, slot_ids), out)  # strided
    lora = torch.ops.astrai.cpu_lora_delta
    for args, message in [
        ((x, a, b[:, :2], scaling, slot_ids), "shapes do not fit"),
        ((x, a, b, scaling.double(), slot_ids), "scaling be float32"),
        ((x, a.float() if dtype != torch.float32 else a.double(), b, scaling, slot_ids), "share one dtype"),
        ((x[0], a, b, scaling, slot_ids), "takes x"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            lora(*args)


def test_opcheck():
    _needs_ops(torch.float32)
    q, k, v, table, lens = _pool([20, 3], heads=4, kv_heads=2, dim=32, dtype=torch.float32)
    torch.library.opcheck(torch.ops.astrai.cpu_decode_attention.default, (q, k, v, table, lens, 16, 0.2, 0))
    torch.library.opcheck(torch.ops.astrai.cpu_matvec.default, (torch.randn(3, 16), [torch.randn(5, 16)]))
    lora_args = (
        torch.randn(3, 16),
        torch.randn(2, 4, 16),
        torch.randn(8, 2, 4),
        torch.ones(2),
        torch.tensor([1, -1, 0]),
    )
    torch.library.opcheck(torch.ops.astrai.cpu_lora_delta.default, lora_args)


_WITHOUT_CXX = """
import torch
from astrai.cpu_kernels import decode_attention, library, matvec
loaded = library.load()
print(loaded.reason, "|", loaded.ops_reason)
cpu = [l for l in torch._C._dispatch_dump("astrai::cpu_matvec").splitlines() if l.startswith("CPU:")]
print(cpu)
x, w = torch.randn(3, 16), torch.randn(5, 16)
assert torch.equal(torch.ops.astrai.cpu_matvec(x, [w]), matvec.matvec(x, [w]))  # the Python kernel serves
try:
    torch.ops.astrai.cpu_matvec(x.half(), [w.half()])
except ValueError as error:
    print("ValueError", error)
"""


def test_without_a_cpp_compiler_the_python_kernels_serve(tmp_path):
    if library.load().reason is not None or cpu_matvec.unavailable_reason(torch.float32) is not None:
        pytest.skip(f"no C kernels here: {library.load().reason}")
    env = {**os.environ, "CXX": "/bin/false", "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_CXX], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reasons, cpu, error = proc.stdout.strip().splitlines()
    assert reasons.startswith("None | could not build the C++ ops: /bin/false failed on ops.cpp"), reasons
    assert cpu == "[]"  # no CPU kernel: CompositeExplicitAutograd's Python one serves
    assert error.startswith("ValueError cpu_matvec cannot run here") and "falls back" in error
    assert [path.name.split("-")[0] for path in (tmp_path / "astrai" / "cpu_kernels").iterdir()] == ["kernels"]


_LOAD = """
import torch
from astrai.cpu_kernels import library, matvec
print(library.load().ops_reason)
x, w = torch.randn(3, 16), torch.randn(5, 16)
assert torch.equal(torch.ops.astrai.cpu_matvec(x, [w]), matvec.matvec(x, [w]))
"""


@pytest.mark.slow  # ~13 s: two processes, one C++ build; the CI set keeps the suite under its 15 minutes
def test_a_damaged_cached_ops_library_is_rebuilt(tmp_path):
    """A truncated file under the C++ ops library's cache name (a crash mid-copy, a full disk): the next process
    rebuilds it and loads the C++ kernels, rather than failing or silently keeping the slow path."""
    _needs_ops(torch.float32)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}

    def run() -> str:
        proc = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip()

    assert run() == "None"
    (built,) = (tmp_path / "astrai" / "cpu_kernels").glob("ops-*.so")
    size = built.stat().st_size
    built.write_bytes(built.read_bytes()[:4096])
    assert run() == "None"
    assert built.stat().st_size == size  # rebuilt in place

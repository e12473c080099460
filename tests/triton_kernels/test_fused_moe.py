"""fused_experts (Triton; interpreted on CPU) against grouped_experts (the engine's eager expert loop) and against
fused_experts_ref; moe_align's bookkeeping; and that the alignment needs no host sync (it runs on fake tensors)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from astrai.nn.moe import _dispatch, grouped_experts
from astrai.ops.quant import quantize_int8
from astrai.triton_kernels.fused_moe import fused_experts, fused_experts_ref, moe_align
from helpers import DEVICE, TOLERANCES, assert_close, assert_compiles_for_gpu


def _case(n: int, *, experts: int = 5, k: int = 2, dim: int = 24, hidden: int = 20, dtype=torch.float32,
          foreign: bool = False, seed: int = 0):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)]) if n else torch.zeros(0, k)
    idx = idx.long()
    if foreign and n:  # expert parallel: some pairs belong to another rank (id == experts)
        idx[torch.rand(n, k, generator=gen) < 0.3] = experts
        idx[0, 0] = experts
    weights = torch.rand(n, k, generator=gen).to(dtype)
    gate, up = (torch.randn(experts, hidden, dim, generator=gen).to(dtype) / dim**0.5 for _ in range(2))
    down = (torch.randn(experts, dim, hidden, generator=gen) / hidden**0.5).to(dtype)
    return tuple(t.to(DEVICE) for t in (x, idx, weights, gate, up, down))


@pytest.mark.parametrize("n", [1, 3, 17], ids=lambda n: f"tokens{n}")
@pytest.mark.parametrize("foreign", [False, True], ids=["all-ours", "expert-parallel"])
def test_fused_experts_match_the_grouped_loop(n, foreign):
    x, idx, w, gate, up, down = _case(n, foreign=foreign, seed=n)
    expected = grouped_experts(x, idx, w, gate, up, down)
    assert_close(fused_experts(x, idx, w, gate, up, down), expected, atol=1e-5, rtol=1e-5)
    assert_close(fused_experts_ref(x, idx, w, gate, up, down), expected, atol=1e-5, rtol=1e-5)
    if foreign:  # negative control: treating the foreign pairs as ours changes the result
        other = fused_experts(x, idx.clamp(max=gate.shape[0] - 1), w, gate, up, down)
        assert (other - expected).abs().max() > 1e-3


def test_bf16_and_int8_experts():
    x, idx, w, gate, up, down = _case(6, dtype=torch.bfloat16, seed=3)
    atol, rtol = TOLERANCES[torch.bfloat16]
    assert_close(fused_experts(x, idx, w, gate, up, down), fused_experts_ref(x, idx, w, gate, up, down),
                 atol=atol, rtol=rtol)  # fmt: skip
    q = [quantize_int8(t) for t in (gate, up, down)]  # (int8 [E, O, I], scale [E, O])
    stacks = [t for t, _ in q], [s for _, s in q]
    expected = grouped_experts(x, idx, w, *stacks[0], tuple(stacks[1]))
    got = fused_experts(x, idx, w, *stacks[0], *stacks[1])
    assert_close(got, expected, atol=atol, rtol=rtol)


def test_no_tokens():
    x, idx, w, gate, up, down = _case(0)
    assert fused_experts(x, idx, w, gate, up, down).shape == (0, x.shape[1])


def test_moe_align_groups_pairs_by_expert_in_padded_runs():
    idx = torch.tensor([[2, 0], [2, 4], [1, 2], [4, 4]])  # 4 = not ours (E = 4)
    sorted_pairs, block_expert = moe_align(idx, 4, 2)
    pairs = idx.numel()
    assert block_expert.shape == (pairs // 2 + 4,) and sorted_pairs.shape == (block_expert.shape[0] * 2,)
    runs = sorted_pairs.view(-1, 2)
    flat = idx.reshape(-1)
    for block, expert in enumerate(block_expert.tolist()):
        got = [p for p in runs[block].tolist() if p < pairs]
        if expert == 4:
            assert not got  # blocks past the last run hold padding only
        else:
            assert got and all(flat[p] == expert for p in got)
    placed = sorted(p for p in sorted_pairs.tolist() if p < pairs)
    assert placed == [i for i in range(pairs) if flat[i] < 4]  # every pair of ours exactly once, foreign ones never
    assert block_expert.tolist()[:4] == [0, 1, 2, 2]  # expert 2's three pairs take two blocks of 2


def test_moe_align_needs_no_tensor_data_on_the_host():
    # on fake tensors (shapes, no data) any op that reads values on the host raises: a `.tolist()` or `.item()`
    # (what grouped_experts' dispatch does, a host sync on CUDA) or an output shape that depends on the data
    idx = torch.randint(0, 6, (9, 2))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(idx)
        sorted_pairs, block_expert = moe_align(fake, 6, 4)
        assert sorted_pairs.shape == (4 * (5 + 6),) and block_expert.shape == (5 + 6,)
        with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):  # negative control
            _dispatch(fake, 6)


# The GPU variants (16-bit tensor-core dots, int8 weights with scales, the routing-weight epilogue) compiled to
# PTX/cubin for sm_80 and sm_90 without a device: the interpreter accepts programs the compiler rejects.
_AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from astrai.triton_kernels.fused_moe import _moe_gemm_kernel as fn

for dt, wt, scale, route, block_m in [("bf16", "bf16", False, False, 16), ("fp16", "i8", True, True, 64),
                                      ("bf16", "i8", True, False, 16)]:
    types = dict(x_ptr="*" + dt, w_ptr="*" + wt, scale_ptr="*" + dt, route_ptr="*" + dt, out_ptr="*" + dt,
                 sorted_pairs_ptr="*i64", block_expert_ptr="*i64")
    consts = dict(NUM_EXPERTS=64, TOP_K=6, ROWS_BY_TOKEN=not route, HAS_SCALE=scale, HAS_ROUTE=route,
                  BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, UPCAST=False)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    for arch in (80, 90):
        triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=4, num_stages=3))
"""


def test_compiles_for_gpu_targets() -> None:
    assert_compiles_for_gpu(_AOT_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 64, 700])
def test_compiled_gpu(dtype, n):
    # decode-sized and prefill-sized batches (block_m 16 and 64), autotuned tiles, DeepSeek-like expert counts
    x, idx, w, gate, up, down = _case(n, experts=64, k=6, dim=256, hidden=128, dtype=dtype, foreign=True, seed=n)
    atol, rtol = TOLERANCES[dtype]
    expected = grouped_experts(x, idx, w, gate, up, down)
    assert_close(fused_experts(x, idx, w, gate, up, down), expected, atol=atol * 2, rtol=rtol)
    torch.cuda.set_sync_debug_mode("error")  # the point of the kernel: no host sync
    try:
        fused_experts(x, idx, w, gate, up, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")

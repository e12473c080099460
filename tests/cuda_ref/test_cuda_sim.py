"""The cuda_ref kernels run on the CPU emulator (tests/cuda_ref/sim) against the plain-torch references.

Checks what a compile cannot: index math, paging, masking (causal, window, ragged), split-KV bookkeeping, GQA
head packing (including more than 16 heads per kv head) and the m16n8k16 fragment usage of both paths, for
fp32/fp16/bf16. The MMA instruction is emulated from the PTX fragment tables, so these tests do not replace the
GPU tests in test_cuda_ref.py; they catch logic errors on machines without a GPU. Needs g++ and the CUDA headers.
"""

from __future__ import annotations

from pathlib import Path

import _cuda_sim
import pytest
import torch
from _attn_cases import PagedCase, decode_case, extend_case, rotary_case

from helpers import TOLERANCES, assert_close

pytestmark = pytest.mark.skipif(_cuda_sim.missing() is not None, reason=f"emulator: {_cuda_sim.missing()}")

# (dtype, use the MMA path): fp32 has only the scalar path.
PATHS = [(torch.float16, True), (torch.bfloat16, True), (torch.float16, False), (torch.bfloat16, False)]
PATHS += [(torch.float32, False)]
PATH_IDS = [f"{str(d).split('.')[-1]}-{'mma' if m else 'scalar'}" for d, m in PATHS]

# (group size G, kv heads K, head dim D, page size N, window)
DECODE_SHAPES = [(1, 2, 64, 1, 0), (4, 2, 128, 16, 0), (8, 1, 64, 16, 37), (20, 1, 64, 16, 0), (4, 1, 256, 16, 0)]
EXTEND_SHAPES = [(1, 2, 64, 1, 0), (4, 1, 128, 16, 0), (8, 1, 64, 16, 45), (2, 1, 256, 16, 0)]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> _cuda_sim.Sim:
    return _cuda_sim.Sim(_cuda_sim.build(Path(tmp_path_factory.mktemp("cuda_sim"))))


def _clones(case: PagedCase) -> list[torch.Tensor]:
    return [t.clone() for t in case.tensors()]


def _assert_unchanged(case: PagedCase, before: list[torch.Tensor]) -> None:
    for t, b in zip(case.tensors(), before, strict=True):
        assert torch.equal(t.nan_to_num(), b.nan_to_num()), "an input was modified"


@pytest.mark.parametrize(("dtype", "mma"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("group", "kv_heads", "head_dim", "page_size", "window"), DECODE_SHAPES)
def test_decode_matches_ref(sim, dtype, mma, group, kv_heads, head_dim, page_size, window):
    from astrai.triton_kernels.decode_attention import decode_attention_ref

    # padding row, single token, tile edges (16, 17), and a long row that gets several splits
    lens = [0, 1, 16, 17, 40, 300]
    c = decode_case(lens, group=group, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
                    window=window)  # fmt: skip
    before = _clones(c)
    args = (c.q, c.k_cache, c.v_cache, c.block_table, c.seq_lens)
    out = sim.decode_attention(*args, page_size=c.page_size, scale=c.scale, window=c.window, mma=mma)
    ref = decode_attention_ref(*args, page_size=c.page_size, scale=c.scale, window=c.window)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, ref, atol=atol, rtol=rtol, msg=f"decode G={group} D={head_dim} N={page_size} w={window}")
    if window == 0:
        assert sim.last_num_splits > 1  # the split-KV merge is exercised (a window caps the work per request)
    _assert_unchanged(c, before)


@pytest.mark.parametrize(("dtype", "mma"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("group", "kv_heads", "head_dim", "page_size", "window"), EXTEND_SHAPES)
def test_extend_matches_ref(sim, dtype, mma, group, kv_heads, head_dim, page_size, window):
    from astrai.triton_kernels.extend_attention import extend_attention_ref

    # plain prefill over two 64-row tiles, a decode-like row, an empty request, a chunk after a long prefix
    pairs = [(0, 70), (33, 1), (0, 0), (90, 17)]
    c = extend_case(pairs, group=group, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
                    window=window)  # fmt: skip
    before = _clones(c)
    args = (c.q, c.k_cache, c.v_cache, c.cu_seqlens_q, c.seq_lens, c.block_table)
    out = sim.extend_attention(*args, page_size=c.page_size, scale=c.scale, window=c.window, mma=mma)
    ref = extend_attention_ref(*args, page_size=c.page_size, scale=c.scale, window=c.window)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, ref, atol=atol, rtol=rtol, msg=f"extend G={group} D={head_dim} N={page_size} w={window}")
    _assert_unchanged(c, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("table_rows", [None, 50])
def test_rotary_matches_ref(sim, dtype, interleaved, table_rows):
    rotary_ref = pytest.importorskip("astrai.triton_kernels.rotary").rotary_ref
    q, k, cos, sin, positions = rotary_case(7, 4, 2, 64, dtype, table_rows=table_rows)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = sim.rotary(q, k, cos, sin, positions, interleaved=interleaved)
    q_ref, k_ref = rotary_ref(q, k, cos, sin, positions, interleaved=interleaved)
    atol, rtol = TOLERANCES[dtype]
    assert_close(q_out, q_ref, atol=atol, rtol=rtol, msg="rotary q")
    assert_close(k_out, k_ref, atol=atol, rtol=rtol, msg="rotary k")
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_rotary_out_of_range_position_is_nan(sim):
    q, k, cos, sin, _ = rotary_case(3, 2, 1, 64, torch.float32, table_rows=8)
    positions = torch.tensor([0, 8, 2])  # row 8 is past the table
    q_out, k_out = sim.rotary(q, k, cos, sin, positions)
    assert q_out[1].isnan().all() and k_out[1].isnan().all()
    assert not q_out[[0, 2]].isnan().any()

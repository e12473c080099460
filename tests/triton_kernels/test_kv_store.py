"""kv_store_ (Triton; interpreted on CPU) against kv_store_ref_, and the reference against a Python loop."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from astrai.triton_kernels.kv_store import kv_store_, kv_store_ref_
from helpers import AOT_PRELUDE, DEVICE, assert_compiles_for_gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, slots: list[int]):
    """A random pool and k/v rows given as strided views of one fused [T, 3K + 1, D] projection."""
    num_slots = 48
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    fused = torch.randn(num_tokens, 3 * num_kv_heads + 1, head_dim, device=DEVICE).to(dtype)
    k = fused[:, num_kv_heads + 1 : 2 * num_kv_heads + 1]  # [T, K, D], token stride (3K + 1) * D
    v = fused[:, 2 * num_kv_heads + 1 :]  # [T, K, D]
    return k_cache, v_cache, k, v, torch.tensor(slots, dtype=torch.int64, device=DEVICE)


def _store_loop(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """The contract read literally, one token at a time."""
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot] = k[t]
            v_cache[slot] = v[t]


# Shuffled slots with padding rows (-1), including slot 0 next to padding (the reference redirects padding).
SLOTS = [17, -1, 0, 45, 3, -1, 30, 8, 21]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (4, 128), (2, 80)])
def test_kernel_matches_ref_and_loop(dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> None:
    k_cache, v_cache, k, v, slot_mapping = _inputs(len(SLOTS), num_kv_heads, head_dim, dtype, SLOTS)
    results = []
    for store in (kv_store_, kv_store_ref_, _store_loop):
        kc, vc = k_cache.clone(), v_cache.clone()
        store(kc, vc, k, v, slot_mapping)
        results.append((kc, vc))
    for kc, vc in results[:2]:  # a store is a copy: bit-exact, including bf16 bit patterns
        assert torch.equal(kc, results[2][0]) and torch.equal(vc, results[2][1])
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=k_cache.device)
    untouched[[s for s in SLOTS if s >= 0]] = False
    assert torch.equal(results[0][0][untouched], k_cache[untouched])


@pytest.mark.parametrize("slots", [[-1, -1, -1], [-1, 5, -1, 0], [0, -1], [7]])
def test_ref_padding_rows(slots: list[int]) -> None:
    k_cache, v_cache, k, v, slot_mapping = _inputs(len(slots), 2, 16, torch.float32, slots)
    expected = k_cache.clone(), v_cache.clone()
    _store_loop(*expected, k, v, slot_mapping)
    for store in (kv_store_ref_, kv_store_):
        kc, vc = k_cache.clone(), v_cache.clone()
        store(kc, vc, k, v, slot_mapping)
        assert torch.equal(kc, expected[0]) and torch.equal(vc, expected[1]), store.__name__


def test_inputs_unchanged() -> None:
    k_cache, v_cache, k, v, slot_mapping = _inputs(len(SLOTS), 2, 32, torch.float16, SLOTS)
    before = [t.clone() for t in (k, v, slot_mapping)]
    kv_store_(k_cache, v_cache, k, v, slot_mapping)
    for t, b in zip((k, v, slot_mapping), before, strict=True):
        assert torch.equal(t, b)


def test_empty_batch() -> None:
    k_cache, v_cache, k, v, slot_mapping = _inputs(0, 2, 32, torch.float32, [])
    before = k_cache.clone()
    kv_store_(k_cache, v_cache, k, v, slot_mapping)
    assert torch.equal(k_cache, before)


def test_opcheck() -> None:
    k_cache, v_cache, k, v, slot_mapping = _inputs(5, 2, 32, torch.float32, [3, -1, 9, 0, 40])
    torch.library.opcheck(kv_store_, (k_cache, v_cache, k.contiguous(), v.contiguous(), slot_mapping))


@pytest.mark.parametrize("store", [kv_store_, kv_store_ref_], ids=["triton", "ref"])
def test_compiles_fullgraph(store) -> None:
    k_cache, v_cache, k, v, slot_mapping = _inputs(len(SLOTS), 2, 32, torch.float32, SLOTS)
    expected = k_cache.clone(), v_cache.clone()
    _store_loop(*expected, k, v, slot_mapping)
    compiled = torch.compile(store, fullgraph=True, backend="aot_eager")  # fails on a graph break or a sync
    compiled(k_cache, v_cache, k, v, slot_mapping)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


@pytest.mark.gpu
def test_int64_offsets_gpu() -> None:
    # 2**31 + 4 * 128 elements per cache (4.3 GB each in bf16): slot * stride overflows int32.
    num_kv_heads, head_dim = 1, 128
    num_slots = 2**31 // (num_kv_heads * head_dim) + 4
    k_cache = torch.zeros(num_slots, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slot_mapping = torch.tensor([num_slots - 1, -1, num_slots - 3], device="cuda", dtype=torch.int64)
    kv_store_(k_cache, v_cache, k, v, slot_mapping)
    assert torch.equal(k_cache[num_slots - 1], k[0]) and torch.equal(v_cache[num_slots - 3], v[2])
    assert not k_cache[num_slots - 2].any() and not k_cache[: num_slots - 3].any()


# The GPU variants (16-bit and fp32 pools, a padded head dim, one and several head blocks) compiled to PTX/cubin
# for sm_80 and sm_90 without a device: the interpreter accepts programs the compiler rejects.
_AOT_SCRIPT = (
    AOT_PRELUDE
    + """
import triton
from astrai.triton_kernels.kv_store import _kv_store_kernel as fn

for dt, heads, dim, block_k in [("bf16", 8, 128, 8), ("fp16", 1, 64, 1), ("fp32", 12, 80, 16)]:
    types = {n: "*" + dt for n in ("k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr")}
    types.update(slot_mapping_ptr="*i64")
    consts = dict(NUM_KV_HEADS=heads, HEAD_DIM=dim, BLOCK_K=block_k, BLOCK_D=triton.next_power_of_2(dim))
    build(fn, types, consts, num_warps=4)
"""
)


def test_compiles_for_gpu_targets() -> None:
    assert_compiles_for_gpu(_AOT_SCRIPT)

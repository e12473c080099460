"""Write new tokens' keys and values into the paged KV pool: `k_cache[slot_mapping[t]] = k[t]` (same for v).

Layouts (docs/kernels.md, "The paged KV pool"):
    k, v:               [T, K, D]  any strides, last dim contiguous (e.g. views of a fused qkv projection)
    k_cache, v_cache:   [S, K, D]  any strides, last dim contiguous; same dtype as k and v
    slot_mapping:       [T] int64  pool slot of each token; a negative slot marks a padding row, which is skipped

Every page size shares this slot layout, so the store never needs the block table. Two valid rows that name the
same slot leave that slot holding one of them (unspecified which), as in vLLM's `reshape_and_cache`.
Not supported: quantised caches, dtype conversion on store (the caller casts first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import cdiv, check_last_dim_contiguous, next_power_of_2

__all__ = ["kv_store_", "kv_store_ref_", "store_rows_ref_"]


@triton.jit
def _kv_store_kernel(
    k_cache_ptr,
    v_cache_ptr,
    k_ptr,
    v_ptr,
    slot_mapping_ptr,
    stride_kc_s,
    stride_kc_k,
    stride_vc_s,
    stride_vc_k,
    stride_k_t,
    stride_k_k,
    stride_v_t,
    stride_v_k,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid (T, cdiv(K, BLOCK_K)); one program copies a [BLOCK_K, BLOCK_D] tile of token t's k and v rows.
    # Addresses are int64: slot * stride_s exceeds 2**31 elements in pools over a few GB.
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + t)
    # Padding rows (slot < 0) write no heads. Folding the scalar test into a bound rather than `& (slot >= 0)`
    # also sidesteps the interpreter, which turns a scalar-bool & tensor-bool into an int mask it rejects.
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_heads) & (d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + t * stride_k_t + heads[:, None] * stride_k_k + d[None, :], mask=mask)
    tl.store(k_cache_ptr + slot * stride_kc_s + heads[:, None] * stride_kc_k + d[None, :], k, mask=mask)
    v = tl.load(v_ptr + t * stride_v_t + heads[:, None] * stride_v_k + d[None, :], mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc_s + heads[:, None] * stride_vc_k + d[None, :], v, mask=mask)


def store_rows_ref_(cache: Tensor, rows: Tensor, slot_mapping: Tensor) -> None:
    """cache[slot_mapping[t]] = rows[t] in place for one pool of any row shape; negative slots are skipped.

    No host sync, so it traces under `torch.compile`. A boolean-mask index would need one (its size depends on
    the data); instead every padding row is redirected to write exactly what some valid row writes (the first
    one), so duplicate indices in index_copy_ carry identical values and the result is deterministic. With no
    valid row at all, every row rewrites the current content of slot 0.

    Args:
        cache: [S, ...] pool, written in place.
        rows: [T, ...] new rows, same row shape and dtype as the pool.
        slot_mapping: [T] int64 slot per row.
    """
    valid = slot_mapping >= 0  # [T]
    idx = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)  # [T]
    src = torch.where(valid, idx, torch.argmax(valid.to(torch.int32)))  # [T] row each row writes; argmax: first valid
    dst = slot_mapping[src]  # [T], negative only when no row is valid
    dst_safe = dst.clamp(min=0)
    keep = (dst >= 0).view(-1, *[1] * (rows.dim() - 1))  # [T, 1, ...]
    # index_select rather than advanced indexing: much cheaper per call on CPU, where this is the hot path
    cache.index_copy_(0, dst_safe, torch.where(keep, rows.index_select(0, src), cache.index_select(0, dst_safe)))


def kv_store_ref_(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Plain-torch specification of `kv_store_` (sync-free `store_rows_ref_` on each pool; same arguments)."""
    store_rows_ref_(k_cache, k, slot_mapping)
    store_rows_ref_(v_cache, v, slot_mapping)


def _check(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    assert k_cache.dim() == 3 and k_cache.shape == v_cache.shape, f"caches {k_cache.shape} {v_cache.shape}"
    assert k.dim() == 3 and k.shape == v.shape, f"k {k.shape} v {v.shape}"
    assert k.shape[1:] == k_cache.shape[1:], f"k {k.shape} does not match cache {k_cache.shape}"
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, "k, v and the caches must share a dtype"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (k.shape[0],), "slot_mapping: [T] int64"
    check_last_dim_contiguous(k_cache=k_cache, v_cache=v_cache, k=k, v=v)


@torch.library.custom_op("astrai::kv_store_", mutates_args=("k_cache", "v_cache"))
def kv_store_(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store new keys and values into the paged pool in place (Triton; CUDA, or CPU under the interpreter).

    Args:
        k_cache: [S, K, D] key pool (last dim contiguous), written in place.
        v_cache: [S, K, D] value pool (last dim contiguous), written in place.
        k: [T, K, D] new keys (last dim contiguous, same dtype as the pool).
        v: [T, K, D] new values.
        slot_mapping: [T] int64 slot per token; rows with a negative slot are skipped.
    """
    _check(k_cache, v_cache, k, v, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = next_power_of_2(head_dim)
    # Up to ~4K elements per program: whole tokens for typical K * D, so each program streams 2 x 8 KB.
    block_k = min(next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_tokens, cdiv(num_kv_heads, block_k))
    _kv_store_kernel[grid](
        k_cache,
        v_cache,
        k,
        v,
        slot_mapping,
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_K=block_k,
        BLOCK_D=block_d,
        num_warps=4 if block_k * block_d >= 2048 else 2,
        enable_fp_fusion=True,  # Triton's default; explicit so that Triton 3.9 does not warn it is unset
    )


@kv_store_.register_fake
def _(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    _check(k_cache, v_cache, k, v, slot_mapping)

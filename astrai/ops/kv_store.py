"""Write new K/V rows into the paged pool, in place (fact F4: out-of-place would copy the whole cache)."""

from __future__ import annotations

from torch import Tensor

from astrai.ops.backend import attn_backend


def kv_store_(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """k_cache[slot_mapping[t]] = k[t] (and v); rows with a negative slot are skipped.

    Args:
        k_cache, v_cache: [S, K, D] pool tensors of one layer (mutated).
        k, v: [T, K, D] new rows.
        slot_mapping: [T] int64 destination slots.
    """
    if attn_backend(k_cache) == "triton":
        from astrai.triton_kernels.kv_store import kv_store_ as kv_store_kernel_

        kv_store_kernel_(k_cache, v_cache, k, v, slot_mapping)
        return
    # the reference is already vectorised and sync-free, so it is the CPU path too
    from astrai.triton_kernels.kv_store import kv_store_ref_

    kv_store_ref_(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype), slot_mapping)

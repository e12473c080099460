"""Paged decode attention on AVX-512 CPUs: each request's one new query over its pages, read in place.

Why a hand-written kernel: the plain-torch CPU path (`triton_kernels.decode_attention.decode_attention_ref`)
gathers each request's pages into a padded fp32 copy, masks it and calls SDPA, three fp32 passes over the
context per layer. `decode_attention.c` reads every key and value row once where it lies in the pool, in the
cache's dtype (bf16 pairs by `vdpbf16ps`), with flash-attention's online softmax; long contexts of few requests are
split and merged by their log-sum-exp. Measured on the 2-core development box: docs/benchmarks.md ("CPU decode
attention kernel").

`supports(q, k_cache)` says whether the kernel runs these tensors here: fp32 or bf16 with a matching cache, head
dim a multiple of 16 up to 256, at most 16 query heads per KV head, contiguous last dims, and the shared library
built (`astrai.cpu_kernels.library`; an AVX512-BF16 CPU for bf16). `astrai.ops.attention` asks it and otherwise
runs the reference. The `astrai::cpu_decode_attention` op (opaque to `torch.compile`) raises where the kernel
cannot run; its CPU kernel is `ops.cpp`'s where that builds (the same checks, ~1 us a call instead of ~8),
else `decode_attention` here. No autograd: decode needs none.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from . import library

__all__ = ["decode_attention", "supports", "unavailable_reason"]

_FUNCTIONS = {torch.float32: "astrai_decode_attention_f32", torch.bfloat16: "astrai_decode_attention_bf16"}
_L, _P = ctypes.c_long, ctypes.c_void_p
# q, B, H, D, k, v, Kh, k strides (rows, heads), v strides, pool rows, table, its row stride and width, lens,
# page size, scale, window, out, threads
_ARGUMENTS = (_P, _L, _L, _L, _P, _P, _L, _L, _L, _L, _L, _L, _P, _L, _L, _P, _L, ctypes.c_float, _L, _P,
              ctypes.c_int)  # fmt: skip
_MAX_GROUP, _MAX_DIM = 16, 256  # decode_attention.c's MAX_GROUP and MAX_DIM
_KERNELS: dict[torch.dtype, Any] | None = None


def _kernels() -> dict[torch.dtype, Any]:
    """The ctypes entry of each dtype this CPU runs (empty without the library)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = library.bind(_FUNCTIONS, _ARGUMENTS, ctypes.c_int)
    return _KERNELS


def unavailable_reason(q: Tensor, k_cache: Tensor, v_cache: Tensor | None = None) -> str | None:
    """Why the kernel cannot run decode attention of `q` [B, H, D] over these caches [S, Kh, D], or None."""
    v_cache = k_cache if v_cache is None else v_cache
    if q.device.type != "cpu":
        return f"tensors on {q.device}, not the CPU"
    if q.dtype not in _FUNCTIONS or not q.dtype == k_cache.dtype == v_cache.dtype:
        return f"dtypes {q.dtype}/{k_cache.dtype}/{v_cache.dtype} (wanted one of fp32, bf16 throughout)"
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape or q.shape[2] != k_cache.shape[2]:
        return f"shapes q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    if dim % 16 or dim > _MAX_DIM or kv_heads == 0 or heads % kv_heads or heads // kv_heads > _MAX_GROUP:
        return f"head dim {dim} / heads {heads} over {kv_heads} (wanted dim % 16 == 0, <= 256; <= 16 per KV head)"
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        return "caches whose last dim is not contiguous"
    return _library_reason(q.dtype)


def _library_reason(dtype: torch.dtype) -> str | None:
    reason = library.load().reason
    if reason is None and dtype not in _kernels():
        reason = "this CPU lacks AVX512-BF16" if dtype == torch.bfloat16 else "this CPU lacks AVX-512 (F, BW, VL)"
    return reason


@library.constant_when_compiled
def _runs(dtype: torch.dtype) -> bool:
    """Whether the library runs `dtype` here: a constant to `torch.compile` (building it is not traced)."""
    return _library_reason(dtype) is None


def supports(q: Tensor, k_cache: Tensor, v_cache: Tensor | None = None) -> bool:
    """Whether `decode_attention` runs on these tensors here (the checks of `unavailable_reason`). Traceable:
    `astrai.ops.attention` asks it inside compiled decode steps."""
    v_cache = k_cache if v_cache is None else v_cache
    if q.device.type != "cpu" or q.dtype not in _FUNCTIONS or not q.dtype == k_cache.dtype == v_cache.dtype:
        return False
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape or q.shape[2] != k_cache.shape[2]:
        return False
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    if dim % 16 or dim > _MAX_DIM or kv_heads == 0 or heads % kv_heads or heads // kv_heads > _MAX_GROUP:
        return False
    return k_cache.stride(2) == 1 and v_cache.stride(2) == 1 and _runs(q.dtype)


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor, *, page_size: int,
    scale: float, window: int = 0,
) -> Tensor:  # fmt: skip
    """The arguments and result of `triton_kernels.decode_attention.decode_attention_ref`: q [B, H, D] over the
    pool's k/v [S, Kh, D], block_table [B, P] and seq_lens [B] int32 -> [B, H, D] in q's dtype. Raises
    ValueError where `supports` is false."""
    reason = unavailable_reason(q, k_cache, v_cache)
    if reason is not None:
        raise ValueError(f"cpu decode_attention cannot run here: {reason}")
    if block_table.device.type != "cpu" or seq_lens.device.type != "cpu":
        raise ValueError(f"block_table and seq_lens must be on the CPU, got {block_table.device} / {seq_lens.device}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table [B, P] and seq_lens [B] must be int32, got {block_table.dtype} "
                         f"{tuple(block_table.shape)} and {seq_lens.dtype}")  # fmt: skip
    if block_table.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],) or page_size < 1:
        raise ValueError(f"{q.shape[0]} queries, block_table {tuple(block_table.shape)}, seq_lens "
                         f"{tuple(seq_lens.shape)}, page size {page_size}")  # fmt: skip
    batch, heads, dim = q.shape
    if batch == 0 or k_cache.shape[0] < page_size:
        return torch.zeros(batch, heads, dim, dtype=q.dtype)
    out = torch.empty(batch, heads, dim, dtype=q.dtype)
    q = q.contiguous()
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    lens = seq_lens.contiguous()
    status = _kernels()[q.dtype](
        q.data_ptr(), batch, heads, dim, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), k_cache.shape[0],
        table.data_ptr(), table.stride(0), table.shape[1], lens.data_ptr(), page_size, scale, window, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("cpu decode_attention could not allocate its split buffers")
    return out


# `torch.ops.astrai.cpu_decode_attention`: one opaque call per layer inside compiled CPU decode steps (in place of
# the reference's gather + SDPA, itself an opaque SDPA call); registered like `astrai::cpu_matvec`, under
# CompositeExplicitAutograd so that `ops.cpp`'s CPU kernel takes precedence where it loads.
_LIBRARY = torch.library.Library("astrai", "FRAGMENT")
_LIBRARY.define(
    "cpu_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
    "int page_size, float scale, int window) -> Tensor"
)


def _op(q, k_cache, v_cache, block_table, seq_lens, page_size, scale, window):
    return decode_attention(q, k_cache, v_cache, block_table, seq_lens, page_size=page_size, scale=scale,
                            window=window)  # fmt: skip


_LIBRARY.impl("cpu_decode_attention", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("astrai::cpu_decode_attention", lib=_LIBRARY)
def _(q, k_cache, v_cache, block_table, seq_lens, page_size, scale, window):
    return q.new_empty(q.shape)

"""Hand-written CUDA C++ references of astrai's attention and rotary kernels, built on first use.

The ops implement the contracts of docs/kernels.md (same signatures and semantics as the Triton ops):
`rotary`, `decode_attention` (split-KV flash-decoding with GQA head packing) and `extend_attention` (ragged
paged prefill). Each has a tensor-core path (`mma.sync.m16n8k16`, fp16/bf16 on sm_80+) and a scalar fp32-FMA
path (fp32 inputs, older GPUs, or `allow_mma=False`); designs are in docs/cuda_ref.md.

`load()` compiles `bindings.cpp` and the `.cu` files with `torch.utils.cpp_extension.load` into
`$TORCH_EXTENSIONS_DIR/astrai_cuda_ref` (else `~/.cache/astrai/cuda_ref`), one folder per GPU arch and torch
version, and registers the `torch.ops.astrai_cuda_ref` ops. Nothing is built or imported at import time;
`available()` says whether a build can work here (a CUDA GPU, a CUDA build of torch, and nvcc).
Set `ASTRAI_NO_MMA=1` before the first `load()` to build without the tensor-core path.

Not supported: head dims other than 64/128/256 in attention, quantised caches, ALiBi, soft-capping.
These are references and fallbacks, not tuned kernels (no cp.async pipelining).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["available", "decode_attention", "extend_attention", "load", "rotary", "unavailable_reason"]

_DIR = Path(__file__).resolve().parent
_SOURCES = ("bindings.cpp", "decode_attention.cu", "extend_attention.cu", "rotary.cu")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 128, 256)


def unavailable_reason() -> str | None:
    """Why `load()` cannot build the kernels on this machine, or None when it can."""
    if torch.version.cuda is None:
        return "torch is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device"
    from torch.utils.cpp_extension import CUDA_HOME, is_ninja_available

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "nvcc not found (set CUDA_HOME to a CUDA toolkit)"
    if not is_ninja_available():
        return "ninja not found (torch.utils.cpp_extension.load needs it: pip install ninja)"
    return None


def available() -> bool:
    """Whether the CUDA references can be built and run here (cheap; builds nothing)."""
    return unavailable_reason() is None


def _no_mma() -> bool:
    return os.environ.get("ASTRAI_NO_MMA", "0").strip().lower() not in ("", "0", "false", "no")


def build_dir() -> Path:
    """The build folder: per torch version, GPU arch of the current device, and ASTRAI_NO_MMA."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR")
    root = Path(base) / "astrai_cuda_ref" if base else Path.home() / ".cache" / "astrai" / "cuda_ref"
    major, minor = torch.cuda.get_device_capability()
    tag = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-sm{major}{minor}"
    return root / (tag + ("-nomma" if _no_mma() else ""))


_OPS: Any = None  # the torch.ops.astrai_cuda_ref namespace once load() has registered the ops
_LOCK = threading.Lock()


def load() -> Any:
    """Build (first call, about a minute) and load the extension; return the `torch.ops.astrai_cuda_ref` namespace.

    Later calls only return the namespace, so torch.compile traces through the wrappers cheaply; call it once
    before compiling or capturing a CUDA graph so the build happens outside the trace.

    Raises:
        RuntimeError: when the machine cannot build it (see `unavailable_reason`) or the build fails.
    """
    global _OPS
    if _OPS is not None:
        return _OPS
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cuda_ref kernels unavailable: {reason}")
    from torch.utils import cpp_extension

    with _LOCK:
        if _OPS is None:
            defines = ["-DASTRAI_NO_MMA"] if _no_mma() else []
            directory = build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name="astrai_cuda_ref",
                sources=[str(_DIR / s) for s in _SOURCES],
                extra_cflags=["-O3", *defines],
                extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", *defines],
                extra_include_paths=[str(_DIR)],
                build_directory=str(directory),
                is_python_module=False,
                verbose=os.environ.get("ASTRAI_CUDA_REF_VERBOSE", "0") == "1",
            )
            _OPS = torch.ops.astrai_cuda_ref
    return _OPS


# ---- argument checks (ValueError before anything reaches C++) ---------------------------------------------


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(f"cuda_ref: {msg}")


def _check_float(name: str, t: Tensor, like: Tensor) -> None:
    _require(isinstance(t, Tensor), f"{name} must be a tensor")
    _require(t.is_cuda, f"{name} must be a CUDA tensor, got device {t.device}")
    _require(t.device == like.device, f"{name} is on {t.device} but q is on {like.device}")
    _require(
        t.dtype == like.dtype and t.dtype in _FLOATS, f"{name} must be {like.dtype} (fp32/fp16/bf16), got {t.dtype}"
    )
    _require(t.dim() == 3, f"{name} must have 3 dims, got shape {tuple(t.shape)}")
    _require(t.stride(-1) == 1, f"{name} needs a contiguous last dim, strides {t.stride()}")


def _check_index(name: str, t: Tensor, dims: int, like: Tensor, dtype: torch.dtype = torch.int32) -> None:
    _require(isinstance(t, Tensor) and t.device == like.device, f"{name} must be a tensor on {like.device}")
    _require(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    _require(t.dim() == dims and t.stride(-1) == 1, f"{name} must have {dims} dims and a contiguous last dim")


def _check_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, page_size: int) -> None:
    _check_float("q", q, q)
    _check_float("k_cache", k_cache, q)
    _check_float("v_cache", v_cache, q)
    _require(k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    _require(k_cache.stride() == v_cache.stride(), "k_cache and v_cache must have the same strides")
    head_dim = q.shape[2]
    _require(head_dim in _HEAD_DIMS, f"head dim must be one of {_HEAD_DIMS}, got {head_dim}")
    _require(k_cache.shape[2] == head_dim, f"k_cache head dim {k_cache.shape[2]} != q head dim {head_dim}")
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    _require(kv_heads > 0 and heads % kv_heads == 0, f"H={heads} must be a multiple of K={kv_heads}")
    _check_index("block_table", block_table, 2, q)
    _require(isinstance(page_size, int) and page_size > 0, f"page_size must be a positive int, got {page_size}")


# ---- ops ----------------------------------------------------------------------------------------------------


def rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None, *, interleaved: bool = False
) -> tuple[Tensor, Tensor]:
    """Rotary embedding of q and k in one launch (fp32 math, outputs in the input dtype).

    Args:
        q: [T, H, D] queries; k: [T, K, D] keys (last dim contiguous, other strides arbitrary), D even.
        cos, sin: [R, D // 2] contiguous fp32 tables.
        positions: [T] int64 table rows per token; None uses row t for token t (then R == T). A position
            outside [0, R) yields NaN for that token (it cannot be reported without a host sync).
        interleaved: rotate adjacent pairs (x[2i], x[2i+1]) instead of halves (x[i], x[i + D/2]).

    Returns:
        (q_out, k_out): new contiguous tensors shaped like q and k.
    """
    _check_float("q", q, q)
    _check_float("k", k, q)
    _require(k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2], "q [T, H, D] and k [T, K, D] must share T, D")
    half = q.shape[2] // 2
    _require(q.shape[2] % 2 == 0, f"head dim must be even, got {q.shape[2]}")
    for name, t in (("cos", cos), ("sin", sin)):
        _require(isinstance(t, Tensor) and t.device == q.device, f"{name} must be a tensor on {q.device}")
        _require(t.dtype == torch.float32 and t.is_contiguous(), f"{name} must be contiguous float32")
        _require(t.dim() == 2 and t.shape[1] == half, f"{name} must be [R, {half}], got {tuple(t.shape)}")
    _require(cos.shape == sin.shape, f"cos {tuple(cos.shape)} != sin {tuple(sin.shape)}")
    if positions is None:
        _require(cos.shape[0] == q.shape[0], f"without positions cos needs T={q.shape[0]} rows, got {cos.shape[0]}")
    else:
        _check_index("positions", positions, 1, q, torch.int64)
        _require(positions.shape[0] == q.shape[0], f"positions must have T={q.shape[0]} entries")
    return load().rotary(q, k, cos, sin, positions, interleaved)


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    page_size: int,
    scale: float,
    window: int = 0,
    allow_mma: bool = True,
) -> Tensor:
    """Paged split-KV decode attention: one query token per request over its cached keys.

    Args:
        q: [B, H, D] query of each request's newest token (last dim contiguous), D in {64, 128, 256}.
        k_cache, v_cache: [S, K, D] pools with equal strides (last dim contiguous), H % K == 0.
        block_table: [B, P] int32 pages per request; seq_lens: [B] int32 cached tokens incl. the current one
            (at most P * page_size; 0 = padding row, output zeros).
        page_size: N slots per page; scale: softmax scale; window: sliding window in tokens (0 = none).
        allow_mma: False forces the scalar path (tests use it to check that path on sm_80+ GPUs).

    Returns:
        [B, H, D] contiguous, in q's dtype.
    """
    _check_paged(q, k_cache, v_cache, block_table, page_size)
    _check_index("seq_lens", seq_lens, 1, q)
    batch = q.shape[0]
    _require(seq_lens.shape[0] == batch and block_table.shape[0] == batch, f"seq_lens/block_table need B={batch}")
    _require(isinstance(window, int) and window >= 0, f"window must be an int >= 0, got {window}")
    return load().decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, page_size, float(scale), window, allow_mma
    )


def extend_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    *,
    page_size: int,
    scale: float,
    window: int = 0,
    allow_mma: bool = True,
) -> Tensor:
    """Ragged paged extend attention: causal over the new tokens, full over each request's cached prefix.

    Args:
        q: [T, H, D] new-token queries (last dim contiguous); request b owns rows
            cu_seqlens_q[b] : cu_seqlens_q[b+1]. D in {64, 128, 256}.
        k_cache, v_cache: [S, K, D] pools with equal strides holding every position's K/V (prefix and new).
        cu_seqlens_q: [B+1] int32 offsets; seq_lens: [B] int32 prefix + new tokens; block_table: [B, P] int32.
        page_size: N slots per page; scale: softmax scale; window: sliding window in tokens (0 = none).
        allow_mma: False forces the scalar path.

    Returns:
        [T, H, D] contiguous in q's dtype; rows owned by no request are zeros.
    """
    _check_paged(q, k_cache, v_cache, block_table, page_size)
    _check_index("cu_seqlens_q", cu_seqlens_q, 1, q)
    _check_index("seq_lens", seq_lens, 1, q)
    batch = seq_lens.shape[0]
    _require(cu_seqlens_q.shape[0] == batch + 1, f"cu_seqlens_q needs B+1={batch + 1} entries")
    _require(block_table.shape[0] == batch, f"block_table needs B={batch} rows")
    _require(isinstance(window, int) and window >= 0, f"window must be an int >= 0, got {window}")
    ops = load()
    return ops.extend_attention(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, page_size, float(scale), window, allow_mma
    )

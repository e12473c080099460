"""CPU projections with oneDNN pre-packed weights: the many-row products of batched decode and prefill.

On CPU, `F.linear` in fp32 runs MKL's sgemm. On the AMD EPYC box this project is developed on, oneDNN's
AVX-512 brgemm on pre-packed weights runs the same products 1.15-2x faster (all 211 projections of
SmolLM2-135M, fp32, ms per pass: 16 rows 72 → 36, 64 rows 139 → 96, 1024 rows 1671 → 1451;
`benchmarks/bench_packed_linear.py`, docs/benchmarks.md). MKL is known to take lesser code paths on non-Intel
CPUs. oneDNN needs its weights reordered into its blocked layout first (`torch.ops.mkldnn._reorder_linear_weight`),
an opaque tensor that cannot be a `torch.compile` input. So:

- `pack_weights(weights)` reorders each weight once and keeps the packed copy in a table keyed by the weight
  tensor's identity (`WeakIdKeyDictionary`: the entry dies with the weight, so packs are released with the
  model and a reloaded model never meets a stale pack). Each entry records the weight's `_version`; a weight
  changed in place since it was packed is repacked on its next use. Writes through `.data` bypass the
  version counter, and inference tensors (a model loaded under `torch.inference_mode`) have none: `repack`
  (called by `Engine.update_params`) covers them.
- `packed_linear(x, weight, bias)` is a custom op, opaque to `torch.compile` (the compiled graph passes the
  very weight tensor it was called with, so the lookup works inside compiled steps too). A weight with no
  pack runs `F.linear`, so the op is always correct; it only gets faster for the weights someone packed. Few
  rows (`FEW_ROWS`) without a pack run the CPU matvec kernel instead, where it runs: compiled fp32 decode of 4-8
  rows comes here (`astrai.ops.linear`), and for those MKL's GEMM is ~1.7x slower than the kernel.

The packed copy costs as much memory as the weight itself: the engine packs on CPU unless told not to
(`EngineConfig.pack_weights`), and skips it when the copy would not fit comfortably in free memory.
No autograd: callers route through it only when no gradient is needed.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from astrai.cpu_kernels import matvec as cpu_matvec


def _bf16_packs() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: its reorder refuses without AVX512-BW/VL/DQ (or
    AVX-NE-CONVERT) and raised on an AVX2-only EPYC, which made every bf16 engine fail to start there."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# the dtypes whose weights this CPU packs (bf16 only where oneDNN's bf16 path runs; else those products keep
# `F.linear` or the few-row paths)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16) if _bf16_packs() else (torch.float32,)
FEW_ROWS = 8  # `ops.linear.MAX_REDUCE_ROWS`: unpacked products of at most this many rows take the matvec kernel

# One table for single weights and groups (a single weight is a group of one): first weight -> {member ids ->
# (weak refs to the members, their versions when packed, the packed [sum out, in] matrix)}. Keyed weakly by the
# first weight, so an entry dies with it; the refs tell a live group from one whose ids were reused.
_PACKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


# whether this torch build has the oneDNN linear ops (the x86 and ARM CPU wheels do); a constant, so that
# compiled code reads it without tracing into torch.ops
AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable(weight: Tensor) -> bool:
    """A 2-D fp32/bf16 CPU weight that needs no gradient (the packed product has no backward)."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in PACKABLE_DTYPES
        and not weight.requires_grad
        and weight.numel() > 0
    )


def _versions(weights: Sequence[Tensor]) -> tuple[int | None, ...]:
    # inference tensors track no version (reading `_version` raises): their in-place changes need `repack`
    return tuple(None if w.is_inference() else w._version for w in weights)


def _store(weights: Sequence[Tensor], packed: Tensor) -> Tensor:
    entry = (tuple(weakref.ref(w) for w in weights), _versions(weights), packed)
    _PACKS.setdefault(weights[0], {})[tuple(id(w) for w in weights)] = entry
    return packed


def _pack(weights: Sequence[Tensor]) -> Tensor:
    with torch.inference_mode():
        whole = weights[0] if len(weights) == 1 else torch.cat(list(weights))
        return _store(weights, torch.ops.mkldnn._reorder_linear_weight(whole.contiguous()))


def _entry(weights: Sequence[Tensor]) -> tuple | None:
    entry = _PACKS.get(weights[0], {}).get(tuple(id(w) for w in weights))
    if entry is None or any(r() is not w for r, w in zip(entry[0], weights, strict=True)):
        return None
    return entry


def pack_group(weights: Sequence[Tensor]) -> int:
    """Pack weights that multiply the same input (q/k/v, gate/up) as one [sum out, in] matrix: one product
    instead of several, which runs faster at few rows (measured: 16 rows, SmolLM2-135M's q/k/v + gate/up,
    20.4 → 16.8 ms per pass). A single weight is a group of one. Returns the bytes of the new pack (0 if
    unpackable or already packed)."""
    first = weights[0]
    same = all(w.shape[1:] == first.shape[1:] and w.dtype == first.dtype for w in weights)
    if not (AVAILABLE and same and all(packable(w) for w in weights)) or _entry(weights) is not None:
        return 0
    _pack(weights)
    return sum(w.numel() * w.element_size() for w in weights)


def pack_weights(weights: Iterable[Tensor]) -> int:
    """Pack every packable weight of `weights` on its own (already packed ones are kept); returns the bytes of
    new packs."""
    return sum(pack_group([w]) for w in weights)


def repack(weights: Iterable[Tensor]) -> None:
    """Pack afresh every single or group pack that starts with one of `weights`: for changes the version counter
    misses (writes through `.data`)."""
    for weight in weights:
        for refs, _, _ in list(_PACKS.get(weight, {}).values()):
            members = [r() for r in refs]
            if all(m is not None for m in members):
                _pack(members)


def is_group_packed(weights: Sequence[Tensor]) -> bool:
    """Whether `weights`, in this order, have a pack (possibly stale: it is refreshed on use)."""
    return _entry(weights) is not None


def is_packed(weight: Tensor) -> bool:
    """Whether `weight` has a pack of its own."""
    return is_group_packed([weight])


def packed_bytes() -> int:
    """Bytes held by live packs (the weights' own bytes, once more)."""
    entries = [e for group in list(_PACKS.values()) for e in group.values()]
    return sum(e[2].numel() * e[2].element_size() for e in entries)


def run_packed_group(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> Tensor | None:
    """x @ cat(weights).T (+ cat(biases)) through their pack: [..., sum out], or None without one (or when the
    dtypes differ). A pack whose weights changed in place since is rebuilt first."""
    entry = _entry(weights) if x.dtype == weights[0].dtype and x.numel() else None
    if entry is None or any(b is not None and b.dtype != x.dtype for b in biases):
        return None
    packed = entry[2] if entry[1] == _versions(weights) else _pack(weights)
    bias = None
    if len(biases) == 1:
        bias = biases[0]
    elif any(b is not None for b in biases):
        bias = torch.cat([x.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases, strict=True)])
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def run_packed(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """x [..., in] @ weight.T (+ bias) through the weight's own pack, or None (`run_packed_group` of one)."""
    return run_packed_group(x, (weight,), (bias,))


def _unpacked(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> Tensor:
    """cat([F.linear(x, w, b) ...], -1) for weights nobody packed: through the CPU matvec kernel for few rows of a
    dtype it runs (one call for the group; bias added and the result cast as `ops.linear` does), else F.linear."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    few = 0 < rows <= FEW_ROWS and x.device.type == "cpu" and cpu_matvec.supports(x.dtype)
    if few and all(w.dim() == 2 and w.dtype == x.dtype and w.is_contiguous() for w in weights):
        return cpu_matvec.projection(x, weights, biases)
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)], dim=-1)


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear(x, weight, bias)`, through the weight's oneDNN pack when `pack_weights` made one (else
    `_unpacked`)."""
    out = run_packed(x, weight, bias)
    return _unpacked(x, (weight,), (bias,)) if out is None else out


def packed_linear_cat(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    """`cat([F.linear(x, w, b) ...], -1)`, as one product through the group's pack when `pack_group` made one."""
    out = run_packed_group(x, weights, biases)
    if out is None and not any(is_packed(w) for w in weights):  # nothing packed: `_unpacked`, one call for all
        out = _unpacked(x, weights, biases)
    elif out is None:  # no group pack: each weight through its own pack, or `_unpacked`
        out = torch.cat([packed_linear(x, w, b) for w, b in zip(weights, biases, strict=True)], dim=-1)
    return out


# `torch.ops.astrai.packed_linear` / `packed_linear_cat`: opaque to torch.compile, called from compiled CPU steps
# (~120 times a batched decode step). Registered with torch.library directly, as `cpu_kernels.matvec` registers its
# op, rather than through `torch.library.custom_op`, whose wrapper added ~11 us a call here (a compiled call of one
# small packed product: 97.7 -> 86.5 us; docs/benchmarks-history.md, "CPU: one-row products through the matvec
# kernel, prefetched weight streams").
_LIBRARY = torch.library.Library("astrai", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define("packed_linear_cat(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor")
_LIBRARY.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")
_LIBRARY.impl("packed_linear_cat", packed_linear_cat, "CompositeExplicitAutograd")


@torch.library.register_fake("astrai::packed_linear", lib=_LIBRARY)
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("astrai::packed_linear_cat", lib=_LIBRARY)
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))

"""FSDP-style sharding of parameter trees with DTensor: each rank stores 1/R of every weight, gradient and optimizer
moment (ZeRO-3), and holds full weights only while the unit that uses them runs.

torch's FSDP2 (`fully_shard`) shards `nn.Module`s; astrai's parameters are plain trees, so this module does the
same thing one level lower, with the DTensor primitives FSDP2 is built on:
- `shard_tree`: every leaf becomes a `DTensor` with placement `Shard(0)` on a 1-D device mesh.
- `BlockGather` (the default, `fsdp_unit="block"`): a *unit runner* the model's forward calls once per unit
  (the embedding, each decoder block, the final norm + LM head). It all-gathers the unit's shards just before
  the unit runs and drops them when it returns; the unit's autograd graph does not keep them: a saved-tensor
  hook swaps every saved tensor that lives in a gathered weight's storage for a small token, and the token
  re-gathers the unit (once, shared by the unit's tokens) when its backward first needs it, so the full weights
  exist again only during that unit's backward. Each gathered leaf's gradient is reduce-scattered straight
  into its shard by `_Gather`'s backward, which the autograd engine runs as soon as the unit's backward is done
  (before the previous unit's). With activation checkpointing the unit's gather sits inside the checkpointed
  function, so the recompute re-gathers it. Peak full-size parameter memory per rank: the largest unit (plus
  the full-size gradients of the unit being reduced).
- `gather_tree` (`fsdp_unit="model"`): the whole tree at once, as before (one full copy alive per micro-batch).
- Mixed precision: `param_dtype` (e.g. bf16) casts each shard before the all-gather (half the bytes on the wire
  and in memory), `reduce_dtype` (default fp32) is the dtype gradients are summed in; the shard's gradient
  comes back in the shard's own dtype (fp32 master weights).
- `track_gathered`: a measurement context: the bytes of full-size gathered storages alive at any moment (weak
  references to the storages, sampled after every gather), its maximum over the context, and the gather count.
- `full_tree`: all ranks gather full tensors (checkpoints, the final model); a collective, so every rank calls it.
The optimizers run on the sharded leaves (torch's functional AdamW accepts DTensors; Muon all-gathers each
matrix's update for Newton-Schulz), so their state stays sharded.

Notable choices: the saved-tensor hook recognises a gathered weight by its storage (so the `w.t()` a matmul
saves is caught too), not by value; a tensor *derived* from it (a dtype cast made by autocast) is saved as usual,
so under autocast pass `param_dtype` equal to the compute dtype (the cast is then a no-op). Gradient accumulation
re-gathers every unit in each micro-batch's forward and backward (memory first; gradients accumulate in the
shards).

Not here: prefetching the next unit's all-gather while the current one computes (gloo on CPU gains nothing from
it and it would hold two units; the gathers are synchronous), keeping gathered weights across micro-batches,
torch.compile around the per-block path (the step compiles only the whole-tree path), hybrid sharding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.multiprocessing.reductions import StorageWeakRef

from astrai.tree import leaves, tree_map

# ---- sharding -------------------------------------------------------------------------------------------------


def make_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over every rank of the (already initialised) process group."""
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard_tree(tree: Any, mesh: DeviceMesh) -> Any:
    """Every leaf as a `Shard(0)` DTensor on `mesh` (detached; the caller sets requires_grad)."""
    return tree_map(lambda t: distribute_tensor(t.detach(), mesh, [Shard(0)]), tree)


# ---- measurement ----------------------------------------------------------------------------------------------


@attrs.define
class GatherStats:
    """What `track_gathered` saw: peak bytes of full-size gathered storages alive at once, and all-gathers run."""

    peak_bytes: int = 0
    gathers: int = 0
    _alive: dict[int, tuple[StorageWeakRef, int]] = attrs.field(factory=dict, repr=False)

    def record(self, tensors: list[torch.Tensor]) -> None:
        """Note freshly gathered tensors, then sample the bytes of every recorded storage still alive."""
        self.gathers += len(tensors)
        for t in tensors:
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            self._alive[ref.cdata] = (ref, storage.nbytes())
        self._alive = {k: v for k, v in self._alive.items() if not v[0].expired()}
        self.peak_bytes = max(self.peak_bytes, sum(n for _, n in self._alive.values()))


_TRACKERS: list[GatherStats] = []


@contextlib.contextmanager
def track_gathered() -> Iterator[GatherStats]:
    """Record the full-size parameter storages gathered inside the block (this process only); yields the stats."""
    stats = GatherStats()
    _TRACKERS.append(stats)
    try:
        yield stats
    finally:
        _TRACKERS.remove(stats)


@torch.compiler.disable
def _record(tensors: list[torch.Tensor]) -> None:
    for stats in _TRACKERS:
        stats.record(tensors)


# ---- gathering ------------------------------------------------------------------------------------------------


def _all_gather(shard: DTensor, param_dtype: torch.dtype | None) -> torch.Tensor:
    """The full tensor of `shard` (cast to `param_dtype` before the all-gather), contiguous, no autograd."""
    with torch.no_grad():
        x = shard if param_dtype is None or shard.dtype == param_dtype else shard.to(param_dtype)
        full = x.redistribute(shard.device_mesh, [Replicate()]).to_local()
        wait = getattr(full, "wait", None)  # a functional collective's lazily-waited result
        return (wait() if callable(wait) else full).contiguous()


class _Gather(torch.autograd.Function):
    """shard (DTensor, Shard(0)) -> full local tensor; backward: the full gradient summed over ranks (in
    `reduce_dtype`) and scattered back into the shard (reduce-scatter), in the shard's dtype."""

    @staticmethod
    def forward(ctx: Any, shard: DTensor, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> Any:
        ctx.mesh, ctx.dtype, ctx.reduce_dtype = shard.device_mesh, shard.dtype, reduce_dtype
        ctx.shape, ctx.stride = shard.shape, shard.stride()
        return _all_gather(shard, param_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        g = grad.to(ctx.reduce_dtype) if ctx.reduce_dtype is not None else grad
        partial = DTensor.from_local(g.contiguous(), ctx.mesh, [Partial()], run_check=False, shape=ctx.shape,
                                     stride=ctx.stride)  # fmt: skip
        return partial.redistribute(ctx.mesh, [Shard(0)]).to(ctx.dtype), None, None


def _gather_leaves(
    tree: Any, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> tuple[Any, list[torch.Tensor]]:
    """(tree with every DTensor leaf gathered, the gathered full tensors); differentiable through `_Gather`."""
    fulls: list[torch.Tensor] = []

    def gather(leaf: Any) -> Any:
        if not isinstance(leaf, DTensor):
            return leaf
        full = _Gather.apply(leaf, param_dtype, reduce_dtype) if leaf.requires_grad else _all_gather(leaf, param_dtype)
        fulls.append(full)
        return full

    out = tree_map(gather, tree)
    _record(fulls)
    return out, fulls


def gather_tree(tree: Any, *, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> Any:
    """Full local tensors of the whole tree for the forward (`fsdp_unit="model"`); gradients flow back as
    reduce-scatters into the shards."""
    return _gather_leaves(tree, param_dtype, reduce_dtype)[0]


class _Regather:
    """One unit's re-gather for its backward: done on first use, shared by the unit's saved-tensor tokens, and
    freed with the last of them (when the unit's backward has used them all)."""

    def __init__(self, shards: list[DTensor], param_dtype: torch.dtype | None) -> None:
        self.shards, self.param_dtype = shards, param_dtype
        self.fulls: list[torch.Tensor] | None = None

    def get(self, index: int) -> torch.Tensor:
        if self.fulls is None:
            self.fulls = [_all_gather(s, self.param_dtype) for s in self.shards]
            _record(self.fulls)
        return self.fulls[index]


class _Saved:
    """A saved tensor that was (a view of) gathered leaf `index`: its geometry, re-gathered on unpack."""

    __slots__ = ("regather", "index", "size", "stride", "offset")

    def __init__(self, regather: _Regather, index: int, t: torch.Tensor, base_offset: int) -> None:
        self.regather, self.index = regather, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset() - base_offset

    def unpack(self) -> torch.Tensor:
        full = self.regather.get(self.index)
        return full.as_strided(self.size, self.stride, full.storage_offset() + self.offset)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.unpack() if isinstance(packed, _Saved) else packed


@attrs.frozen
class BlockGather:
    """The per-unit runner of `fsdp_unit="block"`: `runner(fn, params, *args, checkpoint=False, **kwargs)` runs
    `fn(full_params, *args, **kwargs)` with `params`' DTensor leaves all-gathered for the call only.

    Attributes:
        param_dtype: dtype the shards are cast to before the all-gather (None: their own).
        reduce_dtype: dtype gradients are reduce-scattered in (None: the gathered dtype).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32

    def __call__(self, fn: Callable[..., Any], params: Any, *args: Any, checkpoint: bool = False, **kwargs: Any) -> Any:
        if checkpoint and torch.is_grad_enabled():  # the recompute in backward re-gathers
            return torch.utils.checkpoint.checkpoint(self._gathered, fn, params, *args, use_reentrant=False, **kwargs)
        if not torch.is_grad_enabled():
            return self._gathered(fn, params, *args, **kwargs)
        full, fulls = _gather_leaves(params, self.param_dtype, self.reduce_dtype)
        regather = _Regather([leaf for leaf in leaves(params) if isinstance(leaf, DTensor)], self.param_dtype)
        # storage address -> (leaf index, storage offset): plain ints, so the hook holds no gathered tensor
        storages = {t.untyped_storage().data_ptr(): (i, t.storage_offset()) for i, t in enumerate(fulls) if t.numel()}
        del fulls

        def pack(t: torch.Tensor) -> Any:
            plain = not isinstance(t, DTensor) and t.device.type != "meta"
            hit = storages.get(t.untyped_storage().data_ptr()) if plain else None
            return t if hit is None else _Saved(regather, hit[0], t, hit[1])

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            return fn(full, *args, **kwargs)

    def _gathered(self, fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(_gather_leaves(params, self.param_dtype, self.reduce_dtype)[0], *args, **kwargs)


# ---- whole tensors, checkpoints, clipping ---------------------------------------------------------------------


def full_tree(tree: Any) -> Any:
    """Plain full tensors of a sharded tree (detached); collective: call it on every rank."""
    return tree_map(lambda t: t.full_tensor().detach() if isinstance(t, DTensor) else t.detach(), tree)


def load_into_shards_(tree: Any, tensors: dict[str, torch.Tensor], named: dict[str, Any]) -> None:
    """Copy full tensors (by name) into the matching sharded leaves of `tree`, in place."""
    with torch.no_grad():
        for name, leaf in named.items():
            full = tensors[name].to(device=leaf.device, dtype=leaf.dtype)
            if isinstance(leaf, DTensor):
                leaf.copy_(distribute_tensor(full, leaf.device_mesh, leaf.placements))
            else:
                leaf.copy_(full)


def local_sq_norm(grads: list[Any]) -> torch.Tensor:
    """Sum of squares of this rank's shards of `grads` (fp32); all-reduce it for the global norm."""
    parts = [(g.to_local() if isinstance(g, DTensor) else g).float().pow(2).sum() for g in grads]
    return torch.stack(parts).sum() if parts else torch.zeros(())


def clip_sharded_(grads: list[Any], max_norm: float | None) -> torch.Tensor:
    """Global-norm clipping of sharded gradients (one scalar all-reduce); returns the pre-clip norm."""
    sq = local_sq_norm(grads)
    dist.all_reduce(sq)
    norm = sq.sqrt()
    if max_norm is not None and max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(scale.to(local.dtype))
    return norm

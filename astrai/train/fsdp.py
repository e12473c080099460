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
  function, so the recompute re-gathers it. Peak full-size parameter memory per rank: the two largest units
  with prefetch (below), the largest one without (plus the full-size gradients of the unit being reduced).
- `gather_tree` (`fsdp_unit="model"`): the whole tree at once, as before (one full copy alive per micro-batch).
- Mixed precision: `param_dtype` (e.g. bf16) casts each shard before the all-gather (half the bytes on the wire
  and in memory), `reduce_dtype` (default fp32) is the dtype gradients are summed in; the shard's gradient
  comes back in the shard's own dtype (fp32 master weights).
- `track_gathered`: a measurement context: the bytes of full-size gathered storages alive at any moment (weak
  references to the storages, sampled after every gather), its maximum over the context, and the gather count.
- `full_tree`: all ranks gather full tensors (the final model, `--tp` checkpoints; `--fsdp` checkpoints are saved
  per rank by `astrai.train.sharded_checkpoint`); a collective, so every rank calls it.
The optimizers run on the sharded leaves (torch's functional AdamW accepts DTensors; Muon all-gathers each
matrix's update for Newton-Schulz), so their state stays sharded.

Notable choices: the saved-tensor hook recognises a gathered weight by its storage (so the `w.t()` a matmul
saves is caught too), not by value; a tensor *derived* from it (a dtype cast made by autocast) is saved as usual,
so under autocast pass `param_dtype` equal to the compute dtype (the cast is then a no-op). Gradient accumulation
re-gathers every unit in each micro-batch's forward and backward (memory first; gradients accumulate in the
shards).

Prefetch (`BlockGather(prefetch=True)`, the default): the next unit's all-gather is issued (asynchronously)
before the current unit computes, and in the backward each unit's re-gather issues the previous unit's, so the
communication overlaps compute; the peak is then two units' full weights instead of one. A prefetch is dropped
(never used) if the shards changed in place since it was issued.

Not here: keeping gathered weights across micro-batches, torch.compile around the per-block path (the step
compiles only the whole-tree path), hybrid sharding.
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
        for t in tensors:
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata not in self._alive:  # a prefetched tensor is recorded when issued, not again when used
                self.gathers += 1
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


class _AsyncGather:
    """One shard's all-gather issued with `async_op=True` on buffers this object owns until `wait` returns
    (a buffer freed while the collective still writes into it would corrupt memory).

    `Shard(0)` splits rows as `torch.chunk` does (every non-empty chunk but the last has ceil(n / R) rows), so each
    rank's rows are padded to ceil(n / R) and the full tensor is the first n rows of the gathered buffer.
    """

    def __init__(self, shard: DTensor, param_dtype: torch.dtype | None) -> None:
        mesh = shard.device_mesh
        with torch.no_grad():
            local = shard.to_local()
            if param_dtype is not None and local.dtype != param_dtype:
                local = local.to(param_dtype)
            self.rows, world = shard.shape[0], mesh.size()
            per_rank = -(-self.rows // world)
            self.input = local.new_zeros((per_rank, *local.shape[1:]))
            self.input[: local.shape[0]] = local
            self.output = local.new_empty((per_rank * world, *local.shape[1:]))
            self.work = dist.all_gather_into_tensor(self.output, self.input, group=mesh.get_group(), async_op=True)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work, self.input = None, None
        return self.output[: self.rows]


def _dtensors(tree: Any) -> list[DTensor]:
    return [leaf for leaf in leaves(tree) if isinstance(leaf, DTensor)]


def _versions(shards: list[DTensor]) -> tuple[int, ...]:
    return tuple(s._local_tensor._version for s in shards)


@attrs.define
class _Prefetch:
    """A unit's all-gathers issued ahead of its call: valid only while its shards are unchanged (an in-place
    optimizer update bumps their version counters, so a stale prefetch is dropped, never used)."""

    shards: list[DTensor]
    versions: tuple[int, ...]
    pending: list[_AsyncGather]

    @classmethod
    def start(cls, shards: list[DTensor], param_dtype: torch.dtype | None) -> _Prefetch:
        pending = [_AsyncGather(s, param_dtype) for s in shards]
        _record([g.output for g in pending])  # the output buffers exist from now on
        return cls(shards, _versions(shards), pending)

    def wait(self) -> list[torch.Tensor]:
        """The gathered tensors, waited for (idempotent)."""
        return [g.wait() for g in self.pending]

    def take(self, shards: list[DTensor]) -> list[torch.Tensor] | None:
        """The gathered tensors, waited for; None when they no longer match `shards` (still waited for)."""
        fulls = self.wait()
        same = len(shards) == len(self.shards) and all(a is b for a, b in zip(shards, self.shards, strict=False))
        return fulls if same and _versions(shards) == self.versions else None


class _Gather(torch.autograd.Function):
    """shard (DTensor, Shard(0)) -> full local tensor; backward: the full gradient summed over ranks (in
    `reduce_dtype`) and scattered back into the shard (reduce-scatter), in the shard's dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        shard: DTensor,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        ready: torch.Tensor | None = None,
    ) -> Any:
        ctx.mesh, ctx.dtype, ctx.reduce_dtype = shard.device_mesh, shard.dtype, reduce_dtype
        ctx.shape, ctx.stride = shard.shape, shard.stride()
        return ready if ready is not None else _all_gather(shard, param_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:
        g = grad.to(ctx.reduce_dtype) if ctx.reduce_dtype is not None else grad
        partial = DTensor.from_local(g.contiguous(), ctx.mesh, [Partial()], run_check=False, shape=ctx.shape,
                                     stride=ctx.stride)  # fmt: skip
        return partial.redistribute(ctx.mesh, [Shard(0)]).to(ctx.dtype), None, None, None


def _gather_leaves(
    tree: Any,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    ready: list[torch.Tensor] | None = None,
) -> tuple[Any, list[torch.Tensor]]:
    """(tree with every DTensor leaf gathered, the gathered full tensors); differentiable through `_Gather`.
    `ready`: the DTensor leaves' full tensors, already gathered (a prefetch), in leaf order."""
    fulls: list[torch.Tensor] = []
    done = iter(ready) if ready is not None else None

    def gather(leaf: Any) -> Any:
        if not isinstance(leaf, DTensor):
            return leaf
        got = next(done) if done is not None else None
        if leaf.requires_grad:
            full = _Gather.apply(leaf, param_dtype, reduce_dtype, got)
        else:
            full = got if got is not None else _all_gather(leaf, param_dtype)
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

    def __init__(self, shards: list[DTensor], param_dtype: torch.dtype | None, inflight: list[_Prefetch]) -> None:
        self.shards, self.param_dtype, self.inflight = shards, param_dtype, inflight
        self.fulls: list[torch.Tensor] | None = None
        self.saved = 0  # saved-tensor tokens pointing here: 0 means the backward never re-gathers this unit
        self.before: _Regather | None = None  # the unit that ran before this one (its backward runs next)
        self.ahead: _Prefetch | None = None  # this unit's re-gather, issued early by the unit after it

    def get(self, index: int) -> torch.Tensor:
        if self.fulls is None:
            fulls = None
            if self.ahead is not None:
                fulls = self.ahead.take(self.shards)
                self.inflight.remove(self.ahead)  # waited for: only this unit's tokens keep its tensors now
            self.ahead = None
            self.fulls = fulls if fulls is not None else [_all_gather(s, self.param_dtype) for s in self.shards]
            _record(self.fulls)
            prev = self.before
            if prev is not None and prev.saved and prev.fulls is None and prev.ahead is None:
                # prefetch: the previous unit's backward comes next; its re-gather overlaps this one's backward.
                # The runner also holds it until waited for: a backward may never unpack that unit (no gradient
                # needs its weights), and freeing an in-flight gather's buffer would corrupt memory.
                prev.ahead = _Prefetch.start(prev.shards, prev.param_dtype)
                self.inflight.append(prev.ahead)
            self.before = None
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


@attrs.define
class BlockGather:
    """The per-unit runner of `fsdp_unit="block"`: `runner(fn, params, *args, checkpoint=False, next_params=None,
    **kwargs)` runs `fn(full_params, *args, **kwargs)` with `params`' DTensor leaves all-gathered for the call only.

    Prefetch (`prefetch=True`): given `next_params` (the unit that runs next, as `hidden_states` passes it), the
    next unit's all-gathers are issued before this unit computes and waited for when it starts, and in the
    backward a unit's re-gather issues the re-gather of the unit before it (whose backward comes next). At most two
    units' full weights are alive at once. Not with `checkpoint=True` (the recompute gathers inside backward).

    Attributes:
        param_dtype: dtype the shards are cast to before the all-gather (None: their own).
        reduce_dtype: dtype gradients are reduce-scattered in (None: the gathered dtype).
        prefetch: overlap the next unit's gather with this unit's compute (forward and backward).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    prefetch: bool = True
    _ahead: dict[int, _Prefetch] = attrs.field(factory=dict, init=False, repr=False)
    _before: dict[int, _Regather] = attrs.field(factory=dict, init=False, repr=False)
    _inflight: list[_Prefetch] = attrs.field(factory=list, init=False, repr=False)

    def drain(self) -> None:
        """Wait for every backward prefetch still in flight (call after each backward); forget stale links."""
        for prefetch in self._inflight:
            prefetch.wait()
        self._inflight.clear()
        self._before.clear()

    def __call__(
        self,
        fn: Callable[..., Any],
        params: Any,
        *args: Any,
        checkpoint: bool = False,
        next_params: Any = None,
        **kwargs: Any,
    ) -> Any:
        shards = _dtensors(params)
        key = id(shards[0]) if shards else 0
        ahead = self._ahead.pop(key, None)
        ready = ahead.take(shards) if ahead is not None else None
        if checkpoint and torch.is_grad_enabled():  # the recompute in backward re-gathers
            return torch.utils.checkpoint.checkpoint(self._gathered, fn, params, *args, use_reentrant=False, **kwargs)
        full, fulls = _gather_leaves(params, self.param_dtype, self.reduce_dtype, ready)
        after = _dtensors(next_params) if self.prefetch and next_params is not None else []
        if after and id(after[0]) not in self._ahead:  # issued now, so it overlaps this unit's compute
            self._ahead[id(after[0])] = _Prefetch.start(after, self.param_dtype)
        if not torch.is_grad_enabled():
            return fn(full, *args, **kwargs)
        regather = _Regather(shards, self.param_dtype, self._inflight)
        regather.before = self._before.pop(key, None)
        if after:
            self._before[id(after[0])] = regather
        # storage address -> (leaf index, storage offset): plain ints, so the hook holds no gathered tensor
        storages = {t.untyped_storage().data_ptr(): (i, t.storage_offset()) for i, t in enumerate(fulls) if t.numel()}
        del fulls

        def pack(t: torch.Tensor) -> Any:
            plain = not isinstance(t, DTensor) and t.device.type != "meta"
            hit = storages.get(t.untyped_storage().data_ptr()) if plain else None
            if hit is None:
                return t
            regather.saved += 1
            return _Saved(regather, hit[0], t, hit[1])

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

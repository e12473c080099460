"""FSDP-style sharding of parameter trees with DTensor: each rank stores 1/R of every weight, gradient and AdamW
moment (ZeRO-3), and gathers full weights only for the forward.

torch's FSDP2 (`fully_shard`) shards `nn.Module`s; astrai's parameters are plain trees, so this module does the
same thing one level lower, with the DTensor primitives FSDP2 is built on:
- `shard_tree`: every leaf becomes a `DTensor` with placement `Shard(0)` on a 1-D device mesh.
- `gather_tree`: inside the loss, each leaf is all-gathered (`redistribute` to `Replicate`) and used as a plain
  local tensor whose gradient is declared `Partial` (each rank's gradient covers only its own data), so the
  backward reduce-scatters the summed gradient straight back into the shard: no full-size gradient is kept.
- `full_tree`: all ranks gather full tensors (checkpoints, the final model); a collective, so every rank calls it.
AdamW runs on the sharded leaves (torch.optim's functional AdamW accepts DTensors), so its state is sharded too.

Not here: gathering block by block with prefetch (the whole tree is gathered at the start of each micro-batch,
so peak memory holds one full copy of the weights), mixed-precision gather, hybrid sharding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from astrai.tree import tree_map


def make_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over every rank of the (already initialised) process group."""
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard_tree(tree: Any, mesh: DeviceMesh) -> Any:
    """Every leaf as a `Shard(0)` DTensor on `mesh` (detached; the caller sets requires_grad)."""
    return tree_map(lambda t: distribute_tensor(t.detach(), mesh, [Shard(0)]), tree)


def gather_tree(tree: Any) -> Any:
    """Full local tensors for the forward; gradients flow back as reduce-scatters into the shards."""

    def gather(leaf: Any) -> Any:
        if not isinstance(leaf, DTensor):
            return leaf
        return leaf.redistribute(leaf.device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    return tree_map(gather, tree)


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

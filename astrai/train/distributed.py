"""Process-group setup for data-parallel training under torchrun (gloo on CPU, NCCL on GPUs).

torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; a plain `python` launch is a world
of one and needs no process group. Gradients are averaged by `astrai.train.step` (one flat all-reduce per step).
"""

from __future__ import annotations

import os

import attrs
import torch
import torch.distributed as dist


@attrs.frozen
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints, metrics and the final model."""
        return self.rank == 0


def setup(device: str | None = None) -> DistInfo:
    """Join the torchrun process group when WORLD_SIZE > 1 and pick this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def env_rank() -> int:
    """This process's rank from torchrun's environment (0 outside torchrun); usable before `setup`."""
    return int(os.environ.get("RANK", "0"))


def barrier() -> None:
    """Wait for every rank (no-op in a world of one)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def teardown() -> None:
    """Leave the process group (no-op when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

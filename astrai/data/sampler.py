"""`ResumableSampler`: shuffled, distributed, exactly resumable batches of dataset indices.

Each epoch draws one permutation of all items from a generator seeded by (seed, epoch). Global batch g is
`perm[g * B * W : (g + 1) * B * W]` (B = batch_size per rank, W = world size) and rank r takes its slice
`[r * B : (r + 1) * B]`, so the ranks of one step together see exactly the batch a single process with batch
size B * W would see, in the same order. Changing W therefore changes the batches; a state saved with one W
refuses to load with another.

`state_dict()` records (seed, epoch, batches consumed in the epoch); a batch counts as consumed as soon as it is
yielded, so save the state after training on it. With `drop_last=False` the last global batch is topped up
with the epoch's first indices so that every rank gets a full batch (uneven batches would stall collectives).

Footgun: a `torch.utils.data.DataLoader` with workers prefetches batches, which advances this sampler ahead of
training. Save the state the loop itself tracked (`{"epoch": e, "batch": steps_done_in_epoch, ...}`) or
iterate the sampler in the main process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableSampler:
    """Yields lists of item indices for this rank, one epoch per iteration (see the module docstring)."""

    def __init__(
        self,
        num_items: int,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """Args:
        num_items: dataset length.
        batch_size: indices per batch on this rank.
        seed: shuffling seed (each epoch uses (seed, epoch)).
        shuffle: permute each epoch (else 0..num_items-1 in order).
        drop_last: drop the last partial global batch (else top it up from the epoch's start).
        rank, world_size: default to torch.distributed's when it is initialised, else 0 and 1.
        """
        default_rank, default_world = _dist_rank_world()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if num_items < 0 or batch_size <= 0:
            raise ValueError(f"need num_items >= 0 and batch_size > 0, got {num_items} and {batch_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{num_items} items make no batch of {self.global_batch_size} "
                f"(batch_size {batch_size} x world_size {self.world_size}); lower the batch size or add data"
            )
        self.epoch = 0
        self.batch = 0  # batches of this epoch already yielded

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_items, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self.batches_per_epoch

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_items)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)  # one stream per (seed, epoch)
        return torch.randperm(self.num_items, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch; afterwards the sampler is at the next epoch's start."""
        order = self._order(self.epoch)
        need = self.batches_per_epoch * self.global_batch_size
        if need > self.num_items:  # drop_last=False: top the last batch up from the start
            order = torch.cat([order, order.repeat(need // self.num_items + 1)])[:need]
        while self.batch < self.batches_per_epoch:
            start = self.batch * self.global_batch_size + self.rank * self.batch_size
            self.batch += 1
            yield order[start : start + self.batch_size].tolist()
        self.epoch += 1
        self.batch = 0

    def state_dict(self) -> dict[str, Any]:
        """Where the sampler is: seed, epoch, batches consumed in it, and the shape it was built with."""
        return {"seed": self.seed, "epoch": self.epoch, "batch": self.batch, "num_items": self.num_items,
                "global_batch_size": self.global_batch_size}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` stopped.

        Raises:
            ValueError: the state comes from a different dataset length or global batch size.
        """
        for key in ("num_items", "global_batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler has {getattr(self, key)}")
        if not 0 <= int(state["batch"]) <= self.batches_per_epoch:
            raise ValueError(f"sampler state batch {state['batch']} is outside 0..{self.batches_per_epoch}")
        self.seed, self.epoch, self.batch = int(state["seed"]), int(state["epoch"]), int(state["batch"])

"""Multi-LoRA serving's host side: which adapters are loaded, which sit in the device slots, who uses them.

The served tree holds `max_loras` adapter slots (`astrai.nn.lora_slots`); this module decides what is in them.

- **Loading** (`Adapters.load`, on the caller's thread: the engine thread never reads a file) reads a PEFT folder
  (`astrai.io.lora.load_lora`) against the base model and checks it fits the slots (rank <= `max_lora_rank`). The
  host copy stays in an LRU cache of `max_cpu_loras` adapters; one pushed out is read again from its folder by
  the next request that names it (`Adapters.pin`, on the submitting thread). A request pins its adapter's host
  copy until its last sequence ends, so a pinned copy is never dropped (the cache may then hold more).
- **Slots** (`acquire` / `release`, on the engine thread, from the scheduler): a sequence takes its adapter's
  slot when it is admitted and gives it back when it leaves the running set (finish, abort, preemption). An
  adapter already in a slot is reused as it is; otherwise the least recently used free slot is overwritten in
  place (`Adapters.write`: `write_slot`, or under tensor parallel `TPRunner.write_slot`, which reaches every
  rank). When every slot is held by running sequences of other adapters, the sequence waits in the queue
  (`acquire` says no; the scheduler lets sequences behind it that can run pass) and is admitted when a slot
  frees: it never fails for want of a slot.
- **Unloading** (`unload`) removes the name at once for new requests; sequences already submitted with it finish
  under it, and its slot is free once the last one leaves.
- **Prefix cache**: each load gets a new `uid`, and a sequence's cache key (`Seq.cache_key`) joins it to the
  request's `cache_salt`, so K/V computed under one adapter never serves another adapter, the base model, or a
  later adapter loaded under the same name.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from astrai.inference.errors import LoRAError, LoRANotFoundError
from astrai.io.errors import CheckpointError, UnsupportedModelError
from astrai.io.lora import load_lora
from astrai.io.model import Model
from astrai.nn.lora import LoRAConfig, LoRAParams, apply_lora
from astrai.nn.lora_slots import with_lora_slots, write_slot

__all__ = ["Adapter", "Adapters", "LoRAError", "LoRANotFoundError", "serve_adapters"]


@attrs.define(eq=False)
class Adapter:
    """One loaded adapter: its name, folder, load id, host copy (None when pushed out of the cache), users."""

    name: str
    path: str
    uid: int
    config: LoRAConfig
    lora: LoRAParams | None
    pins: int = 0  # live sequences submitted with it: its host copy stays
    slot: int = -1  # the device slot holding it (-1: none)
    removed: bool = False


def serve_adapters(model: Model, served: Model, cfg: Any, *, slots: bool = True) -> tuple[Model, Adapters]:
    """The served model with adapter slots (`with_lora_slots`, per `EngineConfig`'s max_loras / max_lora_rank)
    and the `Adapters` that fill them; adapters are read against `model`'s own tree. `slots=False` (tensor
    parallel: each rank's shard has its own) leaves `served` as it is: set `Adapters.write` before serving."""
    params = served.params
    if slots:
        params = with_lora_slots(params, max_loras=cfg.max_loras, max_rank=cfg.max_lora_rank)
    adapters = Adapters(model.params, params, max_loras=cfg.max_loras, max_rank=cfg.max_lora_rank,
                        max_cpu_loras=cfg.max_cpu_loras)  # fmt: skip
    return attrs.evolve(served, params=params), adapters


class Adapters:
    """The engine's adapters and slots (see the module docstring)."""

    def __init__(self, base_params: Any, served_params: Any, *, max_loras: int, max_rank: int,
                 max_cpu_loras: int | None) -> None:  # fmt: skip
        self.base, self.served = base_params, served_params
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu = max(max_cpu_loras or max_loras, 1)
        self.names: dict[str, Adapter] = {}  # loaded, in load order
        self._host: OrderedDict[int, Adapter] = OrderedDict()  # uid -> adapter whose host copy is held, LRU first
        self.slot_owner: list[Adapter | None] = [None] * max_loras
        self.slot_users = [0] * max_loras  # running sequences per slot
        self._slot_tick = [0] * max_loras  # last use, for LRU among free slots
        self._tick, self._uid = 0, 0
        self._lock = threading.Lock()
        self.write: Callable[[int, LoRAParams, float], None] = functools.partial(write_slot, served_params)

    # ---- caller threads -----------------------------------------------------------------------------------
    def _read(self, path: str) -> tuple[LoRAParams, LoRAConfig]:
        folder = Path(path)
        if not folder.is_dir():
            raise LoRAError(f"LoRA adapter folder {path!r} does not exist", param="lora_path")
        try:
            lora, cfg = load_lora(folder, self.base)
        except (CheckpointError, UnsupportedModelError, ValueError, OSError) as err:
            raise LoRAError(f"LoRA adapter {path!r}: {err}", param="lora_path") from None
        for where, ad in lora.items():  # a NaN in one slot would reach every row of a step (0 * NaN is NaN)
            if not (torch.isfinite(ad.lora_a).all() and torch.isfinite(ad.lora_b).all()):
                raise LoRAError(f"LoRA adapter {path!r}: the factors of {where} hold NaN or infinite values",
                                param="lora_path")  # fmt: skip
        if cfg.r > self.max_rank:
            raise LoRAError(f"LoRA adapter {path!r} has rank {cfg.r}, above max_lora_rank {self.max_rank} "
                            "(astrai serve --max-lora-rank)", param="lora_path")  # fmt: skip
        return lora, cfg

    def load(self, name: str, path: str | os.PathLike) -> Adapter:
        """Read and check the folder, then register it under `name` (LoRAError naming the problem)."""
        if not isinstance(name, str) or not name or len(name) > 256:
            raise LoRAError(f"a LoRA adapter name must be a non-empty string of at most 256 characters, got "
                            f"{name!r}", param="lora_name")  # fmt: skip
        path = os.fspath(path)
        with self._lock:
            if name in self.names:
                raise LoRAError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
        lora, cfg = self._read(path)
        with self._lock:
            if name in self.names:  # loaded by another thread while this one read the files
                raise LoRAError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
            self._uid += 1
            adapter = self.names[name] = Adapter(name, path, self._uid, cfg, lora)
            self._keep(adapter)
        return adapter

    def unload(self, name: str) -> None:
        """Forget `name` for new requests; running ones finish with it (LoRANotFoundError when not loaded)."""
        with self._lock:
            adapter = self.names.pop(name, None)
            if adapter is None:
                raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
            adapter.removed = True
            if adapter.pins == 0:
                self._host.pop(adapter.uid, None)

    def pin(self, name: str, count: int) -> Adapter:
        """The adapter `name` for a request of `count` sequences; its host copy is read again if it was pushed
        out, and kept until `unpin` (LoRANotFoundError when no adapter has that name)."""
        with self._lock:
            adapter = self.names.get(name)
            if adapter is None:
                raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded", param="model")
            missing = adapter.lora is None
        if missing:  # pushed out of the host cache: read again, outside the lock
            lora, _ = self._read(adapter.path)
        with self._lock:
            if missing and adapter.lora is None:
                adapter.lora = lora
            adapter.pins += count
            self._keep(adapter)
        return adapter

    @contextlib.contextmanager
    def applied(self, name: str, model: Model) -> Iterator[Model]:
        """`model` with adapter `name` applied through `apply_lora` (the training path: an independent way to the
        same numbers as the slots), its host copy pinned while the block runs."""
        adapter = self.pin(name, 1)
        try:
            yield attrs.evolve(model, params=apply_lora(model.params, adapter.lora))
        finally:
            self.unpin(adapter)

    def unpin(self, adapter: Adapter) -> None:
        """One sequence of `adapter` ended."""
        with self._lock:
            adapter.pins -= 1
            if adapter.pins == 0 and adapter.removed:
                self._host.pop(adapter.uid, None)
                adapter.lora = None

    def _keep(self, adapter: Adapter) -> None:
        """Mark `adapter`'s host copy most recently used and push out the oldest unpinned ones past the cap."""
        self._host[adapter.uid] = adapter
        self._host.move_to_end(adapter.uid)
        for uid in list(self._host):
            if len(self._host) <= self.max_cpu:
                break
            old = self._host[uid]
            if old.pins == 0 and old is not adapter:
                del self._host[uid]
                old.lora = None

    # ---- the engine thread (scheduler) ---------------------------------------------------------------------
    def acquire(self, adapter: Adapter) -> int:
        """A slot holding `adapter` for one more running sequence, or -1 when every slot is held by others."""
        self._tick += 1
        slot = adapter.slot
        if slot < 0 or self.slot_owner[slot] is not adapter:
            free = [s for s in range(self.max_loras) if self.slot_users[s] == 0]
            if not free:
                return -1
            slot = min(free, key=lambda s: (self.slot_owner[s] is not None, self._slot_tick[s]))
            with self._lock:
                lora = adapter.lora
            if lora is None:  # cannot happen while pinned; never write a slot from nothing
                raise RuntimeError(f"LoRA adapter {adapter.name!r} has no host copy while a request uses it")
            evicted = self.slot_owner[slot]
            if evicted is not None:
                evicted.slot = -1
            self.write(slot, lora, adapter.config.scaling)
            self.slot_owner[slot], adapter.slot = adapter, slot
        self.slot_users[slot] += 1
        self._slot_tick[slot] = self._tick
        return slot

    def release(self, slot: int) -> None:
        """One running sequence left slot `slot`."""
        self.slot_users[slot] -= 1

    def running(self) -> dict[str, int]:
        """Running sequences per adapter name (may be one step stale)."""
        return {a.name: n for a, n in zip(self.slot_owner, self.slot_users, strict=True) if a is not None and n}

    def stats(self, waiting: Iterable[Any]) -> dict[str, Any]:
        """`EngineStats`' LoRA fields; `waiting`: the scheduler's queue (copied first: the engine thread may change
        it meanwhile)."""
        queued: dict[str, int] = {}
        for seq in list(waiting):
            if seq.adapter is not None:
                queued[seq.adapter.name] = queued.get(seq.adapter.name, 0) + 1
        return dict(lora_loaded=len(self.names), lora_running=self.running(), lora_waiting=queued)

    def loaded(self) -> dict[str, str]:
        """Loaded adapter name -> folder, in load order."""
        with self._lock:
            return {name: adapter.path for name, adapter in self.names.items()}

"""Tensor-parallel inference: N rank processes behind one scheduler (`TPRunner`, `EngineConfig.tensor_parallel_size`).

Rank 0 is the engine's own process: it schedules, samples and detokenizes. Before every forward it broadcasts the
step's host inputs (`StepInputs`: kind, tokens, paged metadata, rows to sample) to ranks 1..N-1, which run the
same forward on their shard of the weights and of the KV pool (`astrai.models.tp`); the collectives inside the
forward keep the ranks in lockstep and leave the full logits on every rank, and only rank 0 samples. The page
allocation, prefix cache and sampling state live on rank 0 alone: the metadata carries everything a rank needs.

Processes: the workers are `spawn`ed by rank 0 (torch.multiprocessing) and receive their shard through shared
memory, so no worker reads the checkpoint; they join a process group on 127.0.0.1 (NCCL on CUDA, rank r on
`cuda:r`; gloo on CPU). The step inputs travel as one pickled broadcast (`broadcast_object_list`): a few KB of
block tables per step.

Failure: a watchdog thread on rank 0 polls the workers; when one exits it calls `on_failure` with a message that
names the rank and its exit code (the engine fails every request with it and `astrai serve` exits with it), and
a worker whose parent is gone exits on its own. CUDA graphs: each rank captures its own decode graphs at start,
in the same bucket order, so the captured collectives pair up; the steps themselves run eagerly under tensor
parallel (the collectives are not traced by torch.compile yet).

Multi-LoRA serving (`lora_slots`): every rank's shard gets its own adapter slots (`with_lora_slots` on the shard),
and adapters split like their base linear (`astrai.models.tp.shard_lora`). Slots are written on rank 0's engine
thread (`Adapters.acquire` calls `TPRunner.write_slot`): rank 0 writes its shard at once and queues the write (slot,
scaling, the adapter's full host tensors); the next `run` broadcasts the queued writes together with the step, and
each worker writes its shard of them before that step's forward. So every rank's slots change between the same
two forwards, and a step never reads a slot before every rank holds its adapter.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from astrai.inference.runner import ModelRunner, StepInputs
from astrai.io.model import Model
from astrai.models.config import ModelConfig
from astrai.models.tp import check_tp, shard_lora, shard_params, tp_config
from astrai.nn.lora import LoRAAdapter, LoRAParams
from astrai.nn.lora_slots import with_lora_slots, write_slot
from astrai.ops.collectives import TensorParallel
from astrai.tree import to_device

__all__ = ["RankFailedError", "TPRunner", "tp_devices"]

TIMEOUT = datetime.timedelta(minutes=10)
"""Longest a collective may wait (gloo raises after it; on CUDA the watchdog reports a dead rank first)."""


def tp_devices(size: int) -> list[torch.device]:
    """Where each rank runs: `cuda:r` when the machine has `size` GPUs, else the CPU for every rank."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= size:
        return [torch.device("cuda", r) for r in range(size)]
    return [torch.device("cpu")] * size


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join(rank: int, size: int, port: int, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, timeout=TIMEOUT)  # fmt: skip


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:  # rank 0 is gone: nothing will ever be broadcast again
            os._exit(3)


_SlotWrite = tuple[int, LoRAParams, float]
"""A queued adapter slot write: (slot, the adapter's full factors on the CPU, scaling)."""


def _slotted(params: Any, lora_slots: tuple[int, int] | None) -> Any:
    if lora_slots is None:
        return params
    return with_lora_slots(params, max_loras=lora_slots[0], max_rank=lora_slots[1])


def _worker(
    rank: int, size: int, port: int, device: torch.device, model: Model, runner_kw: dict, parent: int, threads: int,
    full_cfg: ModelConfig, lora_slots: tuple[int, int] | None,
) -> None:  # fmt: skip
    """One rank 1..N-1: join the group, build the runner on the shard, replay rank 0's steps (and slot writes)
    until told to stop."""
    try:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
        if device.type == "cpu":  # the ranks share the machine's cores: one rank's share of the threads each
            torch.set_num_threads(max(1, threads // size))
        _join(rank, size, port, device)
        tp = TensorParallel(rank=rank, size=size)
        model = Model(config=model.config, params=_slotted(to_device(model.params, device), lora_slots))
        runner = ModelRunner(model, **runner_kw, tp=tp)
        with torch.inference_mode():
            while True:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, src=0)
                if box[0] is None:
                    break
                writes, step = box[0]
                for slot, lora, scaling in writes:  # before the forward: this step may read them
                    write_slot(runner.model.params, slot, shard_lora(lora, full_cfg, tp), scaling)
                runner.run(step)
        dist.destroy_process_group()
    except BaseException:
        print(f"astrai tensor-parallel rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)


class RankFailedError(RuntimeError):
    """A rank process exited: the step cannot complete (already reported through `on_failure`)."""


class TPRunner(ModelRunner):
    """Rank 0's runner: shards `model` over `size` ranks, starts ranks 1..N-1 and mirrors every forward to them."""

    def __init__(
        self,
        model: Model,
        *,
        size: int,
        on_failure: Callable[[str], None] | None = None,
        lora_slots: tuple[int, int] | None = None,
        **runner_kw: Any,
    ) -> None:
        """`model` is the full model (any device; it is sharded on the CPU); `lora_slots`: (max_loras,
        max_lora_rank) to give every rank's shard adapter slots (multi-LoRA serving); `runner_kw` are
        ModelRunner's."""
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("tensor-parallel inference starts its own process group: run it in a process that "
                               "has none (not under torchrun)")  # fmt: skip
        check_tp(model.config, size)
        self.size, self.on_failure, self._closing = size, on_failure, False
        self._lock, self._failed = threading.Lock(), False
        self._writes: list[_SlotWrite] = []  # slot writes not yet sent to ranks 1..N-1 (the next `run` sends them)
        devices, cfg, port = tp_devices(size), model.config, _free_port()
        self.full_cfg = cfg
        local_cfg = tp_config(cfg, size)
        full = to_device(model.params, "cpu")
        ctx = mp.get_context("spawn")
        self.procs = []
        for rank in range(1, size):
            shard = Model(config=local_cfg, params=shard_params(full, cfg, TensorParallel(rank=rank, size=size)))
            args = (rank, size, port, devices[rank], shard, runner_kw, os.getpid(), torch.get_num_threads(), cfg,
                    lora_slots)  # fmt: skip
            proc = ctx.Process(target=_worker, args=args, name=f"astrai-tp-rank{rank}", daemon=True)
            proc.start()
            self.procs.append(proc)
        self._threads = torch.get_num_threads()  # restored by close()
        if devices[0].type == "cpu":  # the ranks share the cores (the workers take the same share)
            torch.set_num_threads(max(1, self._threads // size))
        try:
            _join(0, size, port, devices[0])
        except Exception:
            self._kill()
            raise
        tp = TensorParallel(rank=0, size=size)
        params0 = _slotted(to_device(shard_params(full, cfg, tp), devices[0]), lora_slots)
        shard0 = Model(config=local_cfg, params=params0, tokenizer=model.tokenizer, eos_token_ids=model.eos_token_ids)
        del full
        super().__init__(shard0, **runner_kw, tp=tp)
        threading.Thread(target=self._watch, name="astrai-tp-watchdog", daemon=True).start()

    def write_slot(self, slot: int, lora: LoRAParams, scaling: float) -> None:
        """Put adapter `lora` (its full factors) in slot `slot` on every rank: rank 0's shard now, the other ranks'
        with the next step (`Adapters.write` under tensor parallel; on the engine thread, between steps)."""
        write_slot(self.model.params, slot, shard_lora(lora, self.full_cfg, self.tp), scaling)
        host = {path: LoRAAdapter(ad.lora_a.cpu(), ad.lora_b.cpu(), ad.scaling) for path, ad in lora.items()}
        self._writes.append((slot, host, scaling))

    def run(self, step: StepInputs) -> torch.Tensor:
        """Broadcast the queued slot writes and `step` to the other ranks, then run rank 0's part of the forward."""
        try:
            writes, self._writes = self._writes, []
            dist.broadcast_object_list([(writes, step)], src=0)
            return super().run(step)
        except Exception as err:  # a collective failed: say which rank is gone, rather than gloo's socket error
            message = self._dead_rank(wait=2.0)
            if message is None:
                raise
            self._report(message)
            raise RankFailedError(message) from err

    def _report(self, message: str) -> None:
        with self._lock:
            first, self._failed = not self._failed, True
        if first and self.on_failure is not None:
            self.on_failure(message)

    def _dead_rank(self, wait: float = 0.0) -> str | None:
        """A message naming the first rank process that has exited (waiting up to `wait` s for one), or None."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    return (f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; "
                            "the engine cannot continue without it")  # fmt: skip
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def set_model(self, model: Model) -> None:
        """Refused: every rank holds its own shard, so new weights would have to be re-sharded and sent to each."""
        raise RuntimeError("a tensor-parallel engine does not take new weights: its ranks hold their own shards")

    def _watch(self) -> None:
        while not self._closing:
            message = self._dead_rank()
            if message is not None and not self._closing:
                self._report(message)
                return
            time.sleep(0.2)

    def close(self, timeout: float = 10.0) -> None:
        """Tell the ranks to stop and wait for them (a dead rank is killed rather than waited on)."""
        if self._closing and not any(p.is_alive() for p in self.procs):
            return
        alive = all(p.is_alive() for p in self.procs)
        self._closing = True
        if alive:
            try:
                dist.broadcast_object_list([None], src=0)
            except Exception:  # noqa: BLE001 - a rank died meanwhile: kill below
                pass
        for proc in self.procs:
            proc.join(timeout)
        self._kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads)

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)

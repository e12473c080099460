"""Sharded training checkpoints for `--fsdp`: each rank writes only its own shards, so no rank holds a full copy.

A sharded checkpoint is an ordinary `step_NNNNNNNN/` folder (`astrai.train.checkpoint`: atomic temp folder, manifest
written last, `verify_checkpoint`, `keep_last`, the loop's fallback past corrupt ones) holding:
- `shards/rankRRRRR-of-WWWWW.safetensors`: rank R's local shard (`DTensor.to_local()`) of every trainable leaf
  (`model.<name>`: the full model, or the LoRA adapters) and of every optimizer tensor (`optimizer.<name>`);
  leaves that are not sharded (0-d step counters) are in rank 0's file only;
- `shards/index.json`: the world size, each tensor's global shape and whether it is split, the model's HF config,
  eos ids and LoRA config (what `export_checkpoint` needs), written by rank 0;
- `shards/tokenizer/` (when the run has one), `rng.safetensors` (rank 0's generators) and `state.json`, as in a
  gathered checkpoint; `manifest.json` covers every file, the shard files included.
There is no `model/` folder: `export_checkpoint` (or `python -m astrai.train.sharded_checkpoint CKPT OUT`) writes it
from the shards on one process, and the run's final `RUN/model` is still gathered as before.

Save protocol: rank 0 creates the temp folder and broadcasts its path; every rank writes and fsyncs its file; a
barrier; rank 0 writes the index, rng, state.json and manifest (`atomic_dir` fsyncs every file) and renames the
folder into place.

Resume on any world size: `load_sharded_` rebuilds each full tensor in turn from the saved shards (`Shard(0)`
splits rows as `torch.chunk` does, so concatenating the saved rows in rank order gives the tensor back) and copies
it into this run's leaf: a DTensor keeps its new shard (`load_into_shards_`), a plain tensor (one process) all of
it. The peak is one full tensor (and its pieces) at a time.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard

from astrai.io.checkpoint import read_json, write_json
from astrai.io.errors import CheckpointError
from astrai.io.hf import config_from_hf, config_to_hf
from astrai.io.lora import save_lora
from astrai.io.model import Model, save
from astrai.io.tokenizer import Tokenizer
from astrai.models.config import ModelConfig
from astrai.models.decoder import init_params
from astrai.nn.lora import LoRAConfig, init_lora
from astrai.train.checkpoint import (
    SHARD_INDEX,
    rng_state,
    shard_file,
    write_checkpoint,
    write_manifest,
)
from astrai.train.config import config_from_dict
from astrai.train.fsdp import load_into_shards_
from astrai.tree import from_named_tensors, named_tensors

INDEX_FORMAT = 1


def _named(trainable: Any, opt: Any) -> dict[str, Any]:
    return {**{f"model.{k}": v for k, v in named_tensors(trainable).items()},
            **{f"optimizer.{k}": v for k, v in named_tensors(opt).items()}}  # fmt: skip


def _split(leaf: Any) -> bool:
    return isinstance(leaf, DTensor) and list(leaf.placements) == [Shard(0)]


def all_finite(tree: Any) -> bool:
    """Whether every leaf of a sharded tree is finite on every rank (checks local shards; one all-reduce)."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in named_tensors(tree).values()]
    ok = all(bool(torch.isfinite(t).all()) for t in local)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.is_initialized() and dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save_sharded_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    trainable: Any,
    opt: Any,
    state: dict[str, Any],
    keep_last: int,
    model_cfg: ModelConfig,
    eos: tuple[int, ...],
    lora: LoRAConfig | None,
    tokenizer: Tokenizer | None,
) -> None:
    """Write checkpoint `step` of a sharded run: each rank its own shards (a collective: call it on every rank).

    Args:
        run_dir: the run folder (checkpoints go to `run_dir/checkpoints/step_NNNNNNNN`).
        step: the step the weights are after.
        trainable, opt: this rank's trees (DTensor leaves are saved as their local shard).
        state: state.json's fields besides the step (rank 0's are written).
        keep_last: how many checkpoints to keep.
        model_cfg, eos, lora, tokenizer: recorded for `export_checkpoint`.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    named = _named(trainable, opt)
    # replicated leaves (step counters) are written once, by rank 0
    local = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().contiguous().cpu()
             for k, v in named.items() if rank == 0 or _split(v)}  # fmt: skip

    def write_shard(tmp: Path) -> None:
        (tmp / "shards").mkdir(exist_ok=True)
        file = tmp / shard_file(rank, world)
        save_file(local, str(file))
        with open(file, "rb") as f:  # durable before the barrier (rank 0 fsyncs again: `atomic_dir`)
            os.fsync(f.fileno())

    if rank != 0:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)  # rank 0's temp folder
        write_shard(Path(box[0]))
        dist.barrier()  # every shard is written before rank 0 writes the manifest and renames the folder
        return

    def write(tmp: Path) -> None:
        dist.broadcast_object_list([str(tmp)], src=0)
        write_shard(tmp)
        dist.barrier()
        tensors = {k: {"shape": list(v.shape), "split": _split(v)} for k, v in named.items()}
        index = {"format": INDEX_FORMAT, "world_size": world, "tensors": tensors, "lora": lora is not None,
                 "model_config": config_to_hf(model_cfg), "eos_token_ids": list(eos)}  # fmt: skip
        write_json(tmp / SHARD_INDEX, index)
        if tokenizer is not None:
            tokenizer.save(tmp / "shards" / "tokenizer")
        save_file(rng_state(), str(tmp / "rng.safetensors"))
        write_json(tmp / "state.json", {"step": step, **state})
        write_manifest(tmp)

    write_checkpoint(run_dir, step, write, keep_last=keep_last)


class _Shards:
    """A sharded checkpoint's files opened lazily: `full(name)` reads one tensor's rows from every rank's file."""

    def __init__(self, path: Path, stack: contextlib.ExitStack) -> None:
        self.path = path
        self.index = read_json(path / SHARD_INDEX)
        self.tensors: dict[str, dict[str, Any]] = self.index["tensors"]
        world = int(self.index["world_size"])
        self.files = [path / shard_file(r, world) for r in range(world)]
        try:
            self.handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in self.files]
        except SafetensorError as err:
            raise CheckpointError(f"{path / 'shards'}: corrupt or truncated shard file ({err})") from None

    def full(self, name: str) -> torch.Tensor:
        entry = self.tensors[name]
        try:
            if entry["split"]:
                rows = [h.get_tensor(name) for h in self.handles]  # every rank's rows, in rank order
                out = torch.cat(rows) if len(rows) > 1 else rows[0]
            else:
                out = self.handles[0].get_tensor(name)
        except SafetensorError as err:
            raise CheckpointError(f"{self.path / 'shards'}: cannot read {name} ({err})") from None
        if list(out.shape) != entry["shape"]:
            raise CheckpointError(f"{self.path / 'shards'}: {name} has shape {list(out.shape)}, not {entry['shape']}")
        return out


def load_sharded_(path: str | Path, trainable: Any, opt: Any) -> None:
    """Copy a sharded checkpoint's weights and optimizer state into this run's trees, in place, one full tensor at a
    time (DTensor leaves keep their shard; a collective when they are sharded: call it on every rank).

    Raises:
        ValueError: the checkpoint's tensors are another model's or optimizer's (names or shapes differ).
        CheckpointError: a shard file is unreadable.
    """
    named = _named(trainable, opt)
    with contextlib.ExitStack() as stack:
        shards = _Shards(Path(path), stack)
        missing, unexpected = sorted(set(named) - set(shards.tensors)), sorted(set(shards.tensors) - set(named))
        if missing or unexpected:
            saved_muon = any(k.startswith("optimizer.muon.") for k in shards.tensors)
            if saved_muon != any(k.startswith("optimizer.muon.") for k in named):
                saved, wanted = ("muon", "adamw") if saved_muon else ("adamw", "muon")
                raise ValueError(f"the checkpoint's optimizer state is {saved}'s, not compatible with --optim.name "
                                 f"{wanted}: resume with --optim.name {saved}")  # fmt: skip
            raise ValueError(f"{path}: the sharded checkpoint does not match this run: {len(missing)} missing (e.g. "
                             f"{missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")  # fmt: skip
        for name, leaf in named.items():
            if list(shards.tensors[name]["shape"]) != list(leaf.shape):
                saved = shards.tensors[name]["shape"]
                raise ValueError(f"{path}: {name} has shape {saved}, this run's is {list(leaf.shape)}")
            load_into_shards_(None, {name: shards.full(name)}, {name: leaf})


def export_checkpoint(path: str | Path, out_dir: str | Path) -> Path:
    """Write a sharded checkpoint's weights as a model folder (one process; it holds the full weights): a HF folder
    that `astrai.load`/transformers read, or for a LoRA run the PEFT adapter folder the loop's checkpoints hold."""
    path = Path(path)
    with contextlib.ExitStack() as stack:
        shards = _Shards(path, stack)
        cfg = config_from_hf(shards.index["model_config"], source=str(path / SHARD_INDEX))
        names = [k for k in shards.tensors if k.startswith("model.")]
        tensors = {k.removeprefix("model."): shards.full(k) for k in names}
    template = init_params(attrs.evolve(cfg, dtype="float32"), device="meta")
    if shards.index["lora"]:
        lora_cfg = config_from_dict(read_json(path / "state.json")["config"]).lora
        adapters = from_named_tensors(init_lora(template, lora_cfg), tensors)
        return save_lora(adapters, lora_cfg, out_dir)
    tok_dir = path / "shards" / "tokenizer"
    tokenizer = Tokenizer.from_dir(tok_dir) if tok_dir.is_dir() else None
    model = Model(config=cfg, params=from_named_tensors(template, tensors), tokenizer=tokenizer,
                  eos_token_ids=tuple(shards.index["eos_token_ids"]))  # fmt: skip
    return save(model, out_dir)


if __name__ == "__main__":  # python -m astrai.train.sharded_checkpoint RUN/checkpoints/step_N OUT_DIR
    if len(sys.argv) != 3:
        sys.exit("usage: python -m astrai.train.sharded_checkpoint CHECKPOINT_DIR OUT_DIR")
    print(export_checkpoint(sys.argv[1], sys.argv[2]))

"""FSDP per block (`astrai.train.fsdp.BlockGather`) on 2 gloo ranks: the loss trajectory and the trained weights
equal one process on the same global batches (plain, gradient accumulation, LoRA on a sharded base, Muon,
activation checkpointing), the full-size gathered parameters alive at once stay within one unit (the whole-model
gather is the negative control), bf16 gathers halve them, and per-rank sharded checkpoints (saved by 2 ranks that
resumed a 1-process checkpoint) resume on 1 and on 2 ranks, fall back past a truncated shard file and export to
the gathered model.

The rank processes are plain `python` processes (torchrun's agent would add seconds), started once for every
variant (`fsdp_worker.py`); the 1-process reference runs here, from the same builders.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
from safetensors import safe_open

from astrai.configs.models import tiny
from astrai.io.errors import CheckpointError
from astrai.io.model import load
from astrai.train import loop
from astrai.train.checkpoint import verify_checkpoint
from astrai.train.config import config_to_dict
from astrai.train.metrics import read_metrics
from astrai.train.schedule import ScheduleConfig
from astrai.train.sharded_checkpoint import export_checkpoint
from astrai.tree import named_tensors
from helpers import run_ranks

_WORKER = Path(__file__).with_name("fsdp_worker.py")
_spec = importlib.util.spec_from_file_location("fsdp_worker", _WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

TRAJECTORY = ("block", "accum", "lora", "muon", "ckpt", "noprefetch")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, dict]:
    """Every variant trained on 2 gloo ranks (one pair of processes for all): name -> rank 0's results."""
    out = tmp_path_factory.mktemp("fsdp_block")
    run_ranks([sys.executable, str(_WORKER), str(out), *worker.VARIANTS], timeout=240)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in worker.VARIANTS}


def _one_process(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(losses, trained tree by name) of variant `name` in this process on the whole global batches."""
    variant = worker.VARIANTS[name]
    step, state, frozen = worker.setup(variant)
    losses = []
    for batch in worker.global_batches():
        metrics = step(state, worker.micro_batches(batch, variant.get("accum", 1), 0, 1), 3e-3, frozen)
        losses.append(metrics["loss"].item())
    return losses, named_tensors(state.trainable)


@pytest.mark.parametrize("name", TRAJECTORY)
def test_per_block_fsdp_matches_one_process(ranks, name):
    ref_losses, ref = _one_process(name)
    got = ranks[name]
    # Muon's Newton-Schulz runs in bf16 (torch.optim.Muon's choice), so the last-bit difference between a gradient
    # summed over 2 ranks and one computed in one matmul can flip a bf16 rounding: the whole-tree gather sees the
    # same (`test_whole_model_gather_gives_the_same_losses` pins per-block FSDP to it exactly)
    tol = 5e-5 if name == "muon" else 1e-5
    assert got["losses"] == pytest.approx(ref_losses, abs=tol)
    trained = named_tensors(got["trained"])
    assert trained.keys() == ref.keys()
    start = named_tensors(worker.setup(worker.VARIANTS[name])[1].trainable)
    moved = max((ref[k] - start[k]).abs().max().item() for k in ref)
    assert moved > 1e-3  # the steps changed the weights, so equal weights below mean equal updates
    worst = max((trained[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= (1e-3 if name == "muon" else 1e-5), (name, worst)


@pytest.mark.parametrize(("block", "model"), [("block", "model"), ("muon", "muon_model")])
def test_whole_model_gather_gives_the_same_losses(ranks, block, model):
    # per block, a tied embedding's gradient is two reduce-scatters (embedding and head units) summed in the shard,
    # one for the whole tree: last-bit differences, which Muon's bf16 Newton-Schulz can turn into ~1e-4 in the
    # weights and ~1e-5 in the next losses (9e-6 at step 3 on an AVX2-only EPYC, whose GEMMs round differently)
    loss_tol, tol = (5e-5, 1e-3) if block == "muon" else (1e-6, 1e-6)
    assert ranks[model]["losses"] == pytest.approx(ranks[block]["losses"], abs=loss_tol)
    got, ref = named_tensors(ranks[block]["trained"]), named_tensors(ranks[model]["trained"])
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= tol


def test_peak_gathered_bytes_stay_within_one_unit(ranks):
    bound = ranks["block"]["bound"]
    per_unit = bound["block"] + bound["embed"]  # the largest block + the embedding (head) unit
    for name in ("noprefetch", "ckpt"):  # one unit at a time (checkpointing never prefetches)
        assert 0 < max(ranks[name]["peaks"]) <= per_unit, (name, ranks[name]["peaks"], per_unit)
    # prefetch (the default): the next block's gather is alive while this one computes: at most two units
    for name in ("block", "accum", "lora", "muon"):
        unit = bound["lora_block"] if name == "lora" else bound["block"]  # a LoRA unit carries its adapters too
        two_units = max(2 * unit, unit + bound["embed"])
        assert 0 < max(ranks[name]["peaks"]) <= two_units, (name, ranks[name]["peaks"], two_units)
    assert max(ranks["block"]["peaks"]) > max(ranks["noprefetch"]["peaks"])  # the prefetch really overlapped
    assert ranks["block"]["gathers"] == ranks["noprefetch"]["gathers"]  # and gathered nothing twice
    # negative control: the whole-model gather holds every unit at once, far over the bound
    assert max(ranks["model"]["peaks"]) > per_unit
    assert max(ranks["model"]["peaks"]) >= bound["model"]
    # per block, each unit is gathered again for its backward (the embedding lookup needs no weights there)
    assert ranks["block"]["gathers"][0] > ranks["model"]["gathers"][0]


@pytest.mark.parametrize("name", ["block", "lora"])
def test_eval_pass_per_unit_equals_the_whole_tree_gather(ranks, name):
    (total, count), (ref_total, ref_count) = ranks[name]["eval"]
    assert count == ref_count > 0 and total.item() == pytest.approx(ref_total.item(), abs=1e-5)
    bound = ranks[name]["bound"]
    assert 0 < ranks[name]["eval_peak"] <= bound["block"] + bound["embed"] < bound["model"]


def test_bf16_gather_halves_the_gathered_bytes(ranks):
    bf16, fp32 = ranks["bf16"], ranks["block"]
    assert max(bf16["peaks"]) * 2 == pytest.approx(max(fp32["peaks"]), rel=0.05)
    ref_losses, _ = _one_process("block")
    diffs = [abs(a - b) for a, b in zip(bf16["losses"], ref_losses, strict=True)]
    assert max(diffs) < 5e-2 and max(diffs) > 1e-6, diffs  # close to fp32, yet computed in bf16


# ---- checkpoints: saved by 1 and resumed on 2 FSDP ranks, sharded by them and resumed on 2 and on 1 ----------


def _torchrun(cfg, path: Path, *extra: str) -> None:
    path.write_text(json.dumps(config_to_dict(cfg)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           "-m", "astrai.cli.main", "train", str(path), *extra]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl", kind="train")]


def _check_shard_files(ckpt: Path) -> None:
    """Per-rank shard files, each holding only its rows of every split tensor, covered by the manifest."""
    assert not (ckpt / "model").exists() and not (ckpt / "optimizer.safetensors").exists()
    index = json.loads((ckpt / "shards" / "index.json").read_text())
    files = [f"shards/rank{r:05d}-of-00002.safetensors" for r in range(2)]
    assert index["world_size"] == 2 and all((ckpt / f).is_file() for f in files)
    assert set(files) <= set(json.loads((ckpt / "manifest.json").read_text())["files"])
    split = {k: e["shape"] for k, e in index["tensors"].items() if e["split"]}
    assert any(k.startswith("optimizer.exp_avg.") for k in split) and "model.embed_tokens.weight" in split
    for rank, name in enumerate(files):
        with safe_open(str(ckpt / name), framework="pt") as f:
            for key, shape in split.items():
                rows = f.get_slice(key).get_shape()[0]
                assert rows == len(torch.arange(shape[0]).chunk(2)[rank]) < shape[0], (key, rank)


def test_sharded_checkpoint_resumes_on_one_and_on_two_ranks(train_cfg, tmp_path):
    schedule = ScheduleConfig(kind="cosine", warmup_steps=1, total_steps=4)
    base = attrs.evolve(train_cfg, steps=4, save_every=2, val_fraction=0.0, eval_every=0, schedule=schedule)
    single = attrs.evolve(base, out_dir=tmp_path / "single", batch_size=4)  # same global batch as 2 x 2
    loop.train(single, tiny())
    ref = _losses(single.out_dir)
    # one process saves a gathered checkpoint at step 1; 2 FSDP ranks resume it (1 -> 2) and save sharded ones
    run = tmp_path / "run"
    loop.train(attrs.evolve(single, out_dir=run, steps=1, save_every=1), tiny())
    two = attrs.evolve(base, out_dir=run, batch_size=2, fsdp=True, steps=3, save_every=1)
    _torchrun(two, tmp_path / "two.json", "--resume")
    steps = run / "checkpoints"
    _check_shard_files(steps / "step_00000002")
    # the gathered export at the end equals the last sharded checkpoint exported on one process
    final = named_tensors(load(run / "model").params)
    exported = named_tensors(load(export_checkpoint(steps / "step_00000003", tmp_path / "export")).params)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    at_two = named_tensors(load(export_checkpoint(steps / "step_00000002", tmp_path / "export2")).params)
    want = named_tensors(load(single.out_dir / "checkpoints" / "step_00000002" / "model").params)
    assert max((at_two[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    # 2 -> 2: the sharded step 3 resumes on 2 ranks
    shutil.copytree(run, tmp_path / "two_then_two")
    _torchrun(attrs.evolve(two, out_dir=tmp_path / "two_then_two", steps=4), tmp_path / "four.json", "--resume")
    # 2 -> 1 past a truncated shard file: verify names it, the loop falls back to step 2 and sets step 3 aside
    shutil.copytree(run, tmp_path / "two_then_one")
    bad = tmp_path / "two_then_one" / "checkpoints" / "step_00000003" / "shards" / "rank00001-of-00002.safetensors"
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="rank00001-of-00002.safetensors: truncated"):
        verify_checkpoint(bad.parent.parent)
    loop.train(attrs.evolve(single, out_dir=tmp_path / "two_then_one", resume=True), tiny())
    assert any(p.name.startswith("step_00000003.corrupt-") for p in bad.parent.parent.parent.iterdir())
    for name in ("two_then_two", "two_then_one"):
        losses = _losses(tmp_path / name)
        assert len(losses) == 4 and losses == pytest.approx(ref, abs=1e-5), name


def test_step_rejects_an_unknown_unit_and_a_gather_dtype_without_autocast():
    from astrai.train.optim import AdamWConfig
    from astrai.train.step import StepOptions, TrainStep

    cfg = worker.model_config()
    params = worker.init_params(cfg, seed=1)
    with pytest.raises(ValueError, match="fsdp_unit"):
        TrainStep(cfg, StepOptions(compile=False), AdamWConfig(), trainable=params, sharded=True, fsdp_unit="layer")
    with pytest.raises(ValueError, match="autocast"):
        TrainStep(cfg, StepOptions(compile=False), AdamWConfig(), trainable=params, sharded=True,
                  fsdp_param_dtype=torch.bfloat16)  # fmt: skip
    bf16 = StepOptions(compile=False, autocast_dtype=torch.bfloat16)
    step = TrainStep(cfg, bf16, AdamWConfig(), trainable=params, sharded=True, fsdp_param_dtype=torch.bfloat16)
    assert step.per_block
    assert not TrainStep(cfg, bf16, AdamWConfig(), trainable=params, sharded=True, fsdp_unit="model").per_block

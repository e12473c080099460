"""Tensor-parallel training (`astrai train --tp N`, `astrai.train.tp`) on gloo ranks equals one process in fp32.

Four rank processes (`tp_worker.py`, started once for every variant) train: TP 2 x DP 2 on the qwen3-shaped
`tiny` model; one KV head replicated over 2 ranks with tied embeddings over an odd vocab, gradient accumulation,
label smoothing and active clipping; a qwen2_moe-shaped model (expert parallel, gated shared expert, the
load-balancing loss); TP 4 (two ranks per KV head); TP 2 x FSDP 2 (2-D). The loss trajectory, the gradient norms
and the gathered trained weights equal the 1-process run on the same global batches; the negative control skips
`reduce_partial_grads` and trains different weights. A 2-"node" `torchrun` job (two agents meeting through the
c10d rendezvous) runs `astrai train --tp 2`, and its checkpoint (the full model and AdamW state) resumes on one
process and on TP 2 along the 1-process trajectory.
"""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from astrai.configs.models import tiny
from astrai.nn.lora import LoRAConfig
from astrai.train import loop
from astrai.train.config import DPOConfig, GRPOConfig, TrainConfig, config_to_dict
from astrai.train.metrics import read_metrics
from astrai.train.muon import MuonConfig
from astrai.train.optim import AdamWConfig, OptimConfig
from astrai.train.tp import check_tp_run
from astrai.tree import leaves, named_tensors
from helpers import run_ranks, wait_ranks

_WORKER = Path(__file__).with_name("tp_worker.py")
_spec = importlib.util.spec_from_file_location("tp_worker", _WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

MATCHING = ("dense", "clip", "moe", "tp4", "fsdp")


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(procs: list[subprocess.Popen], timeout: float) -> None:
    wait_ranks(procs, timeout)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, dict]:
    """Every variant trained on 4 gloo ranks (one set of processes for all): name -> rank 0's results."""
    out = tmp_path_factory.mktemp("tp_train")
    run_ranks([sys.executable, str(_WORKER), str(out), *worker.VARIANTS], world=4, timeout=240)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in worker.VARIANTS}


def _one_process(name: str, dp: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    variant = worker.VARIANTS[name]
    losses, norms, state = worker.train(variant, accum=variant.get("accum", 1) * dp)
    return losses, norms, named_tensors(state.trainable)


@pytest.mark.parametrize("name", MATCHING)
def test_tp_training_matches_one_process(ranks, name):
    got = ranks[name]
    losses, norms, ref = _one_process(name, got["dp"])
    assert got["losses"] == pytest.approx(losses, abs=1e-5)
    assert got["norms"] == pytest.approx(norms, rel=1e-5)
    trained = named_tensors(got["trained"])
    assert trained.keys() == ref.keys()
    start = named_tensors(worker.setup(worker.VARIANTS[name])[1].trainable)
    assert max((ref[k] - start[k]).abs().max().item() for k in ref) > 1e-3  # the steps moved the weights
    worst = max((trained[k] - ref[k]).abs().max().item() for k in ref)
    # Adam moves a weight by ~lr * g / (|g| + eps): entries with |g| near eps turn the last-bit difference between
    # a matmul split over 4 ranks and a whole one into ~1e-5 (1% of one step at lr 3e-3); the negative control
    # below is 100x further off
    assert worst <= 5e-5, (name, worst)
    if name == "clip":  # the threshold bit: the unclipped norm is far above max_grad_norm
        assert min(norms) > 10 * worker.VARIANTS["clip"]["clip"]


def test_skipping_the_partial_gradient_sum_trains_other_weights(ranks):
    _, _, ref = _one_process("broken", ranks["broken"]["dp"])
    trained = named_tensors(ranks["broken"]["trained"])
    assert max((trained[k] - ref[k]).abs().max().item() for k in ref) > 1e-3


@pytest.mark.parametrize("name", MATCHING)
def test_the_norm_from_shards_counts_each_replicated_leaf_once(ranks, name):
    got = ranks[name]
    full = torch.stack([t.pow(2).sum() for t in leaves(got["trained"])]).sum().sqrt().item()
    assert got["param_norm"] == pytest.approx(full, rel=1e-6)
    assert got["opt_round_trip"]  # unshard_adamw then shard_adamw gives the rank's state back


# ---- config refusals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"tp": 0}, "tp must be >= 1"),
        ({"lora": LoRAConfig(r=4)}, "--tp 2 with lora"),
        ({"dpo": DPOConfig()}, "--tp 2 with dpo"),
        ({"grpo": GRPOConfig()}, "--tp 2 with grpo"),
        ({"optim": OptimConfig(name="muon", muon=MuonConfig())}, "Newton-Schulz"),
    ],
)
def test_config_refuses_what_tp_does_not_support(changes, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(data=Path("x"), **{"tp": 2, **changes})


def test_launch_and_model_checks_name_the_flag():
    with pytest.raises(ValueError, match=r"--tp 2 needs WORLD_SIZE a multiple of 2, got 3"):
        check_tp_run(2, None, world=3)
    with pytest.raises(ValueError, match="torchrun"):
        check_tp_run(2, None, world=1)
    with pytest.raises(ValueError, match=r"--tp 3: the model does not split: .*num_attention_heads \(4\)"):
        check_tp_run(3, tiny(), world=3)
    check_tp_run(2, tiny(), world=4)  # 2 TP groups of 2


# ---- two torchrun "nodes" through the c10d rendezvous, and resuming their checkpoint ---------------------------


def _two_nodes(cfg: TrainConfig, path: Path, *extra: str) -> None:
    path.write_text(json.dumps(config_to_dict(cfg)))
    port = _port()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", path.stem, "-m", "astrai.cli.main", "train", str(path), "--tp", "2", *extra]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    _wait(procs, timeout=180)


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl", kind="train")]


@pytest.mark.slow  # ~30 s: two torchrun launches of two agents each, on 2 CPU cores
def test_two_node_tp_run_and_its_checkpoint_resume(train_cfg, tmp_path):
    base = attrs.evolve(train_cfg, steps=4, save_every=0, val_fraction=0.0, eval_every=0,
                        optim=AdamWConfig(lr=3e-3, eps=1e-6))  # fmt: skip
    single = attrs.evolve(base, out_dir=tmp_path / "single")
    loop.train(single, tiny())
    ref = _losses(single.out_dir)
    tp_run = attrs.evolve(base, out_dir=tmp_path / "tp", steps=2)  # --tp 2 comes from the command line
    _two_nodes(tp_run, tmp_path / "tp.json")
    assert json.loads((tp_run.out_dir / "config.json").read_text())["tp"] == 2
    assert _losses(tp_run.out_dir) == pytest.approx(ref[:2], abs=1e-5)
    # the checkpoint holds the full model and AdamW state: one process continues it ...
    shutil.copytree(tp_run.out_dir, tmp_path / "tp_then_one")
    loop.train(attrs.evolve(single, out_dir=tmp_path / "tp_then_one", resume=True), tiny())
    assert _losses(tmp_path / "tp_then_one") == pytest.approx(ref, abs=1e-5)
    # ... and so does TP 2 (this rank's shard of the weights and moments)
    _two_nodes(attrs.evolve(tp_run, steps=4), tmp_path / "tp_again.json", "--resume")
    assert _losses(tp_run.out_dir) == pytest.approx(ref, abs=1e-5)

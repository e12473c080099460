"""Data parallel on CPU: 2 gloo processes under torchrun reproduce the 1-process run with the same global batch,
plain (all-reduced gradients) and sharded (FSDP-style DTensor shards gathered one block at a time, stopped and
resumed halfway from per-rank shard files), also with LoRA (base and adapters sharded; the checkpoints hold the
adapters' shards, exported as the adapter folder a 1-process run saves; the final model is the merged one)."""

import json
import os
import subprocess
import sys

import attrs
import pytest
from safetensors.torch import load_file

from astrai.configs.models import tiny
from astrai.io.model import load
from astrai.nn.lora import LoRAConfig
from astrai.train import loop
from astrai.train.checkpoint import is_sharded
from astrai.train.config import config_to_dict
from astrai.train.metrics import read_metrics
from astrai.train.schedule import ScheduleConfig
from astrai.train.sharded_checkpoint import export_checkpoint
from astrai.tree import named_tensors
from helpers import assert_close


def _torchrun(cfg, path, *extra):
    path.write_text(json.dumps(config_to_dict(cfg)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           "-m", "astrai.cli.main", "train", str(path), *extra]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("fsdp", "lora"),
    [
        (False, None),
        # ~21 s; in CI, test_fsdp_block's sharded-checkpoint test resumes 2 FSDP ranks from sharded checkpoints
        # (1 -> 2, 2 -> 2 and 2 -> 1) against one process, and fsdp-lora below runs this test's sharded path
        pytest.param(True, None, marks=pytest.mark.slow),
        (True, LoRAConfig()),
    ],
    ids=["all-reduce", "fsdp", "fsdp-lora"],
)
def test_two_gloo_ranks_match_one_process(train_cfg, tmp_path, fsdp, lora):
    schedule = ScheduleConfig(kind="cosine", warmup_steps=1, total_steps=4)  # fixed, so a 2-step run can resume
    base = attrs.evolve(train_cfg, steps=4, save_every=2, val_fraction=0.0, eval_every=0, schedule=schedule,
                        lora=lora)  # fmt: skip
    single = loop.train(attrs.evolve(base, out_dir=tmp_path / "single", batch_size=4), tiny())
    cfg = attrs.evolve(base, out_dir=tmp_path / "ddp", batch_size=2, fsdp=fsdp)
    if fsdp:  # stop after 2 steps (each rank writes its shards), then resume from them
        _torchrun(attrs.evolve(cfg, steps=2), tmp_path / "ddp.json")
        _torchrun(cfg, tmp_path / "ddp.json", "--resume")
        step_2 = cfg.out_dir / "checkpoints" / "step_00000002"
        assert is_sharded(step_2) and not (step_2 / "model").exists()
        if lora is not None:  # the adapters exported from the shards equal those a 1-process run saved
            got = load_file(export_checkpoint(step_2, tmp_path / "export") / "adapter_model.safetensors")
            want = load_file(single.run_dir / "checkpoints" / step_2.name / "model" / "adapter_model.safetensors")
            assert got.keys() == want.keys()
            for name in want:
                assert_close(got[name], want[name], atol=1e-5, msg=name)
    else:
        _torchrun(cfg, tmp_path / "ddp.json")
    ddp_losses = [r["loss"] for r in read_metrics(cfg.out_dir / "metrics.jsonl", kind="train")]
    single_losses = [r["loss"] for r in read_metrics(tmp_path / "single" / "metrics.jsonl", kind="train")]
    assert len(ddp_losses) == 4 and ddp_losses == pytest.approx(single_losses, abs=1e-5)
    ddp, ref = named_tensors(load(cfg.out_dir / "model").params), named_tensors(load(single.model_dir).params)
    for name in ref:
        assert_close(ddp[name], ref[name], atol=1e-5, msg=name)

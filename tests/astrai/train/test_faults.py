"""Training survives bad checkpoints and diverging steps (issue 18, item 10), through the real interfaces.

One tiny run (6 eager steps, checkpoints at 3 and 6) is trained once per module; each test copies its folder,
damages real checkpoint files (truncate, flip bytes, drop the manifest) or makes a step diverge (lr = inf), then
resumes through `loop.train`, the in-process CLI, or the CLI in a subprocess where the one-line error matters.
Every test is bounded: a few tiny eager steps, and subprocesses run under a timeout.
"""

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import attrs
import pytest

from astrai.configs.models import tiny
from astrai.train import loop
from astrai.train.checkpoint import MANIFEST, checkpoint_dirs, verify_checkpoint
from astrai.train.config import TrainConfig
from astrai.train.metrics import read_metrics
from astrai.train.optim import AdamWConfig

CLI_TIMEOUT_S = 180


@pytest.fixture
def run(finished_run, tmp_path) -> TrainConfig:
    """A private copy of the finished run, resumable (`resume=True`) in its new folder."""
    shutil.copytree(finished_run.out_dir, tmp_path / "run")
    return attrs.evolve(finished_run, out_dir=tmp_path / "run", resume=True)


def _ckpt(cfg: TrainConfig, step: int):
    return cfg.out_dir / "checkpoints" / f"step_{step:08d}"


def _truncate(path, keep=0.5):
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))


def _flip(path, offset=-100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF  # inside the tensor data: the safetensors header still parses
    path.write_bytes(bytes(data))


def _losses(cfg: TrainConfig) -> list[float]:
    return [r["loss"] for r in read_metrics(cfg.out_dir / "metrics.jsonl", kind="train")]


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "astrai.cli.main", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def _truncate_optimizer(cfg):
    _truncate(_ckpt(cfg, 6) / "optimizer.safetensors")


def _flip_weights(cfg):
    _flip(_ckpt(cfg, 6) / "model" / "model.safetensors")


def _truncate_rng_of_old_checkpoints(cfg):  # saved before manifests: only the structure can be checked
    for step in (3, 6):
        (_ckpt(cfg, step) / MANIFEST).unlink()
    _truncate(_ckpt(cfg, 6) / "rng.safetensors")


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (_truncate_optimizer, r"step_00000006/optimizer.safetensors: truncated \(\d+ bytes, the manifest says \d+\)"),
        (_flip_weights, r"step_00000006/model/model.safetensors: corrupt \(SHA-256 differs from the manifest\)"),
        (_truncate_rng_of_old_checkpoints, r"step_00000006/rng.safetensors: corrupt or truncated safetensors file"),
    ],
)
def test_damaged_newest_checkpoint_warns_and_resumes_from_the_previous_one(run, finished_run, damage, problem, caplog):
    damage(run)
    with caplog.at_level(logging.WARNING, logger="astrai.train"):
        result = loop.train(run, tiny())
    warnings = [r.getMessage() for r in caplog.records]
    assert any(re.search(problem + ".*falling back to step_00000003", w) for w in warnings)
    assert result.steps == 6 and not result.already_finished
    assert _losses(run) == pytest.approx(_losses(finished_run), abs=1e-6)  # steps 4-6 replayed from step 3
    aside = [p.name for p in (run.out_dir / "checkpoints").glob("step_00000006.corrupt-*")]
    assert len(aside) == 1 and any(aside[0] in w for w in warnings)  # kept for inspection, never resumed
    assert [p.name for p in checkpoint_dirs(run.out_dir)] == ["step_00000003", "step_00000006"]
    assert verify_checkpoint(_ckpt(run, 6)) is True


def test_cli_warns_in_one_line_and_resumes_past_a_corrupt_checkpoint(run):
    _flip_weights(run)
    proc = _cli(str(run.out_dir), "--out-dir", str(run.out_dir), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "done: 6 steps" in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("warning: ") and "step_00000006/model/model.safetensors: corrupt" in lines[0]
    assert "falling back to step_00000003" in lines[0]


@pytest.mark.parametrize(
    ("damaged", "flags", "message"),
    [  # every checkpoint unusable: nothing to fall back to
        ({6: "optimizer.safetensors", 3: "rng.safetensors"}, ["--resume"],
         r"no valid checkpoint in .*step_00000006/optimizer.safetensors: truncated.*step_00000003/rng.safetensors: "
         r"truncated"),
        # an explicit --resume-from never falls back
        ({3: "optimizer.safetensors"}, ["--resume-from", "step_00000003"],
         r"step_00000003/optimizer.safetensors: truncated \(\d+ bytes, the manifest says \d+\)"),
    ],
)  # fmt: skip
def test_truncated_optimizer_or_rng_is_a_one_line_cli_error(run, damaged, flags, message):
    for step, name in damaged.items():
        _truncate(_ckpt(run, step) / name)
    flags = [str(_ckpt(run, 3)) if f == "step_00000003" else f for f in flags]
    proc = _cli(str(run.out_dir), "--out-dir", str(run.out_dir), *flags)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(message, errors[0]), proc.stderr


def test_resume_from_an_older_checkpoint_sets_newer_ones_aside(run, finished_run):
    result = loop.train(attrs.evolve(run, resume=False, resume_from=_ckpt(run, 3)), tiny())
    assert result.steps == 6 and _losses(run) == pytest.approx(_losses(finished_run), abs=1e-6)
    assert len(list((run.out_dir / "checkpoints").glob("step_00000006.abandoned-*"))) == 1
    saved = json.loads((run.out_dir / "config.json").read_text())
    assert saved["resume_from"] is None  # a later --resume takes the newest checkpoint, not this one


@pytest.mark.parametrize(
    ("save_every", "what"),
    [(1, "step 4: the updated weights are not finite"), (3, "step 5: loss nan, grad norm nan")],
)
def test_nonfinite_step_stops_without_saving_and_the_last_good_checkpoint_verifies(run, save_every, what):
    # lr = inf from step 4: the weights after step 4 are inf/nan, so step 5's loss and gradient are NaN
    cfg = attrs.evolve(run, resume=False, resume_from=_ckpt(run, 3), optim=AdamWConfig(lr=float("inf")),
                       save_every=save_every)  # fmt: skip
    with pytest.raises(loop.NonFiniteError, match=f"{what}; stopped without saving this step") as err:
        loop.train(cfg, tiny())
    assert f"the last good checkpoint is {_ckpt(run, 3)}" in str(err.value)
    assert [p.name for p in checkpoint_dirs(run.out_dir)] == ["step_00000003"]
    assert verify_checkpoint(_ckpt(run, 3)) is True
    assert not list((run.out_dir / "checkpoints").glob(".step_*"))  # no half-written save either


def test_nonfinite_cli_error_and_the_opt_out(run, capsys):
    from astrai.cli.main import main

    args = ["train", str(run.out_dir), "--out-dir", str(run.out_dir), "--resume-from", str(_ckpt(run, 3)),
            "--optim.lr", "inf"]  # fmt: skip
    with pytest.raises(SystemExit) as err:
        main(args)
    assert err.value.code == 2 and "error: step 5: loss nan, grad norm nan" in capsys.readouterr().err
    main([*args, "--no-stop-on-nonfinite"])  # trains on: the history shows the divergence
    assert "done: 6 steps" in capsys.readouterr().out and all(loss != loss for loss in _losses(run)[4:])


def test_resume_on_a_finished_run_says_it_is_finished(run, capsys):
    from astrai.cli.main import main

    before = {p: p.stat().st_mtime_ns for p in run.out_dir.rglob("*")}
    main(["train", str(run.out_dir), "--out-dir", str(run.out_dir), "--resume"])  # was a TypeError
    out = capsys.readouterr().out.replace("\n", "")
    assert "is already finished: its checkpoint is at step 6 (--steps 6); nothing to do" in out
    assert {p: p.stat().st_mtime_ns for p in run.out_dir.rglob("*")} == before  # nothing written
    shutil.rmtree(run.out_dir / "model")  # killed after the last checkpoint, before the final model
    result = loop.train(run, tiny())
    assert not result.already_finished and result.steps == 6 and (result.model_dir / "model.safetensors").is_file()

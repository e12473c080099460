"""Training checkpoints: atomic writes, keep-last-K, a kill between write and rename, manifest checksums."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from astrai.io.errors import CheckpointError
from astrai.train.checkpoint import (
    MANIFEST,
    checkpoint_dirs,
    latest_checkpoint,
    load_checkpoint,
    newest_valid_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

_SAMPLER = {"seed": 0, "epoch": 0, "batch": 1}  # load_checkpoint checks the sampler position is there


def _save(run, step, value, keep_last=2):
    def write_model(folder):
        save_file({"w": torch.full((3,), float(value))}, str(folder / "model.safetensors"))

    return save_checkpoint(run, step, write_model=write_model, optimizer={"m": torch.tensor([value])},
                           state={"tokens_seen": value, "sampler": _SAMPLER}, keep_last=keep_last)  # fmt: skip


def test_save_load_and_keep_last(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step, step)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_00000020", "step_00000030"]
    state, opt, rng = load_checkpoint(latest_checkpoint(tmp_path))
    assert state == {"step": 30, "tokens_seen": 30, "sampler": _SAMPLER} and opt["m"].item() == 30
    assert torch.equal(rng["cpu"], torch.get_rng_state())


def test_kill_between_write_and_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 10, 10)
    real_replace = os.replace

    def killed(src, dst):  # the process dies right before the rename that publishes step 20
        if "step_00000020" in str(dst):
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 20, 20)
    monkeypatch.setattr(os, "replace", real_replace)
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000010"
    state, opt, _ = load_checkpoint(latest)
    assert state["step"] == 10 and opt["m"].item() == 10
    # a leftover temp folder (as after SIGKILL) is ignored, then swept by the next save
    (tmp_path / "checkpoints" / ".step_00000020.tmp-dead").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_00000010"
    _save(tmp_path, 30, 30)
    assert not list((tmp_path / "checkpoints").glob(".step_*"))


def test_incomplete_checkpoint_is_named(tmp_path):
    path = _save(tmp_path, 5, 5)
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(CheckpointError, match="optimizer.safetensors is missing"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="optimizer.safetensors is missing"):
        verify_checkpoint(path)


def test_manifest_lists_every_file_and_catches_truncation_and_flipped_bytes(tmp_path):
    path = _save(tmp_path, 5, 5)
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert set(files) == {"model/model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"}
    assert verify_checkpoint(path) is True
    rng = path / "rng.safetensors"
    data = rng.read_bytes()
    rng.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, one byte flipped
    with pytest.raises(CheckpointError, match=r"rng.safetensors: corrupt \(SHA-256 differs"):
        verify_checkpoint(path)
    with open(path / "model" / "model.safetensors", "r+b") as f:
        f.truncate(40)
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated \(40 bytes, the manifest says \d+\)"):
        verify_checkpoint(path)


def test_checkpoint_without_manifest_is_checked_structurally(tmp_path):
    path = _save(tmp_path, 5, 5)
    (path / MANIFEST).unlink()  # as saved before manifests existed
    assert verify_checkpoint(path) is False
    with open(path / "optimizer.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(path / "optimizer.safetensors") - 2)
    with pytest.raises(CheckpointError, match="optimizer.safetensors: corrupt or truncated safetensors file"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="optimizer.safetensors: corrupt or truncated safetensors file"):
        load_checkpoint(path)


def test_newest_valid_checkpoint_falls_back_and_names_each_problem(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step, step, keep_last=3)
    dirs = checkpoint_dirs(tmp_path)
    (dirs[2] / "state.json").write_text('{"step": 30}')  # edited after the save: checksum differs
    warnings = []
    found = newest_valid_checkpoint(tmp_path, warn=warnings.append)
    assert found.step == 20 and found.verified and found.skipped == (dirs[2],) and found.optimizer["m"].item() == 20
    assert (
        len(warnings) == 1
        and "step_00000030/state.json" in warnings[0]
        and "falling back to step_00000020" in warnings[0]
    )
    for path in dirs[:2]:
        with open(path / "optimizer.safetensors", "r+b") as f:
            f.truncate(10)
    with pytest.raises(
        CheckpointError, match=r"no valid checkpoint in .*step_00000010/optimizer.safetensors: truncated"
    ):
        newest_valid_checkpoint(tmp_path, warn=warnings.append)
    assert newest_valid_checkpoint(tmp_path / "empty", warn=warnings.append) is None

"""Training checkpoints: atomic writes, keep-last-K, and a kill between write and rename."""

import os

import pytest
import torch
from safetensors.torch import save_file

from astrai.train.checkpoint import checkpoint_dirs, latest_checkpoint, load_checkpoint, save_checkpoint


def _save(run, step, value, keep_last=2):
    def write_model(folder):
        save_file({"w": torch.full((3,), float(value))}, str(folder / "model.safetensors"))

    return save_checkpoint(run, step, write_model=write_model, optimizer={"m": torch.tensor([value])},
                           state={"tokens_seen": value}, keep_last=keep_last)  # fmt: skip


def test_save_load_and_keep_last(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step, step)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_00000020", "step_00000030"]
    state, opt, rng = load_checkpoint(latest_checkpoint(tmp_path))
    assert state == {"step": 30, "tokens_seen": 30} and opt["m"].item() == 30
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
    with pytest.raises(FileNotFoundError, match="optimizer.safetensors is missing"):
        load_checkpoint(path)

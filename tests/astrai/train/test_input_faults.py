"""Bad training inputs end in one `error:` line (exit 2) or a warned fallback, never a traceback or lost checkpoints.

Each test damages a real input (token ids, offsets or GRPO answers in a shard, a checkpoint's state.json or RNG
states, the run's config.json or model shape), runs `astrai train` in-process through `astrai.cli.main.main`, and
checks the error line and what is left on disk; each has a positive control (the undamaged input trains). One tiny
run (6 eager steps, checkpoints at 3 and 6) is trained once per module and copied per test, so every run takes a
second or two.
"""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from astrai.cli.main import main
from astrai.train.checkpoint import MANIFEST, checkpoint_dirs


@pytest.fixture
def run_dir(finished_run, tmp_path):
    """A private copy of the finished run whose config.json points at the copy."""
    shutil.copytree(finished_run.out_dir, tmp_path / "run")
    _edit_json(tmp_path / "run" / "config.json", lambda c: c.update(out_dir=str(tmp_path / "run")))
    return tmp_path / "run"


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    data = edit(data) or data
    path.write_text(json.dumps(data))


def _train(capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `astrai train ARGS` run in-process."""
    try:
        main(["train", *args])
        code = 0
    except SystemExit as err:
        code = err.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(err: str) -> str:
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def _ckpt(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.mark.parametrize("bad_id", [None, 100, 60000])  # None: the undamaged shards (positive control)
def test_token_ids_outside_the_vocabulary_are_named_not_an_index_error(sft_data, tmp_path, capsys, bad_id):
    tokenizer, shards = sft_data
    data = shutil.copytree(shards, tmp_path / "shards")
    if bad_id is not None:  # the tokenizer (and so the model) has 100 ids: 100 is the first one past the table
        tokens = np.fromfile(data / "shard_0000" / "tokens.bin", dtype="<u2")
        tokens[::7] = bad_id
        tokens.tofile(data / "shard_0000" / "tokens.bin")
    code, out, err = _train_sft(capsys, data, tokenizer, tmp_path / "run")
    if bad_id is None:
        assert code == 0 and "done: 2 steps" in out, err
        return
    assert code == 2
    line = _one_error(err)
    assert f"{data}: item " in line and f"holds token id {bad_id} ('tokens')" in line
    assert "outside the model's vocabulary of 100 ids" in line
    assert not checkpoint_dirs(tmp_path / "run")


def _train_sft(capsys, data, tokenizer, out_dir) -> tuple[int, str, str]:
    return _train(capsys, "sft-tiny", "--data", str(data), "--tokenizer", str(tokenizer), "--model", "tiny",
                  "--seq-len", "64", "--batch-size", "4", "--steps", "2", "--no-compile", "--schedule.warmup-steps",
                  "1", "--out-dir", str(out_dir))  # fmt: skip


@pytest.mark.parametrize("corrupt", [False, True])  # False: the undamaged shards (positive control)
def test_decreasing_row_offsets_are_named_not_a_shape_error(sft_data, tmp_path, capsys, corrupt):
    tokenizer, shards = sft_data
    data = shutil.copytree(shards, tmp_path / "shards")
    if corrupt:  # row 1 gets length -2 while every row stays within seq_len: was a RuntimeError in __getitem__
        ends = np.fromfile(data / "shard_0000" / "row_offsets.bin", dtype="<i8")
        ends[1], ends[2] = ends[2] - 20, ends[2] - 22
        ends.tofile(data / "shard_0000" / "row_offsets.bin")
    code, out, err = _train_sft(capsys, data, tokenizer, tmp_path / "run")
    if not corrupt:
        assert code == 0 and "done: 2 steps" in out, err
        return
    assert code == 2 and "shard_0000: row_offsets decreases at row 1 (a corrupt shard)" in _one_error(err)


@pytest.mark.parametrize("step", ["abc", -5, 10**6, True])
def test_garbage_step_in_state_json_falls_back_and_sets_no_valid_checkpoint_aside(run_dir, capsys, caplog, step):
    for s in (3, 6):  # saved before manifests: state.json is not checksummed, so only its contents can be checked
        (_ckpt(run_dir, s) / MANIFEST).unlink()
    _edit_json(_ckpt(run_dir, 6) / "state.json", lambda st: st.update(step=step))
    _edit_json(run_dir / "config.json", lambda c: c.update(steps=7))
    with caplog.at_level(logging.WARNING, logger="astrai.train"):
        code, out, err = _train(capsys, str(run_dir), "--resume")
    # before: step -5 set step_3 and step_6 aside as "abandoned"; 10**6 called the run finished; "abc" a ValueError
    assert code == 0 and "done: 7 steps" in out, err
    warning = next(r.getMessage() for r in caplog.records if "state.json" in r.getMessage())
    assert "step_00000006/state.json" in warning and "falling back to step_00000003" in warning
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert not [n for n in names if "abandoned" in n]  # the valid step_3 was resumed, not set aside
    assert len([n for n in names if n.startswith("step_00000006.corrupt-")]) == 1  # kept for inspection


def _garbage_sampler(ckpt):
    _edit_json(ckpt / "state.json", lambda st: st.update(sampler={"x": 1}))
    return "state.json: 'sampler' must hold an int seed"


def _rng(dtype, size):
    def damage(ckpt):  # was a RuntimeError / TypeError from torch.set_rng_state, after the weights were loaded
        save_file({"cpu": torch.zeros(size, dtype=dtype)}, str(ckpt / "rng.safetensors"))
        return f"rng.safetensors: the 'cpu' generator state is {str(dtype).removeprefix('torch.')} of shape ({size},)"

    return damage


@pytest.mark.parametrize(
    "damage",
    [None, _garbage_sampler, _rng(torch.uint8, 10), _rng(torch.float32, 5056)],
    ids=["intact", "sampler", "rng-size", "rng-dtype"],
)  # intact: the undamaged (unverified) checkpoint resumes (positive control)
def test_unusable_state_or_rng_with_resume_from_is_one_error_line(run_dir, capsys, damage):
    ckpt = _ckpt(run_dir, 3)
    (ckpt / MANIFEST).unlink()  # saved before manifests: only the contents can be checked
    problem = damage(ckpt) if damage is not None else None
    code, out, err = _train(capsys, str(run_dir), "--resume-from", str(ckpt), "--out-dir", str(run_dir.parent / "b"))
    if damage is None:
        assert code == 0 and "done: 6 steps" in out, err
        return
    assert code == 2
    assert f"step_00000003/{problem}" in _one_error(err)
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_00000003", "step_00000006"]  # nothing moved


@pytest.mark.parametrize("other_shape", [False, True])  # False: the unchanged config resumes (positive control)
def test_checkpoint_of_another_model_shape_is_named(run_dir, capsys, other_shape):
    if other_shape:  # without the 100-id tokenizer the tiny model has its own 512-id vocabulary
        _edit_json(run_dir / "config.json", lambda c: c.update(tokenizer=None))
    code, out, err = _train(capsys, str(run_dir), "--resume-from", str(_ckpt(run_dir, 3)))
    if not other_shape:
        assert code == 0 and "done: 6 steps" in out, err
        return
    assert code == 2
    line = _one_error(err)
    assert "step_00000003/model: tensor 'embed_tokens.weight' has shape (100, 128)" in line
    assert "this run's model has (512, 128)" in line
    assert "another model" in line
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_00000003", "step_00000006"]  # nothing set aside


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: [1, 2], "expected a JSON object of fields, got list"),  # was an AttributeError traceback
        (lambda c: "sft", "expected a JSON object of fields, got str"),
        (lambda c: None, "expected a JSON object of fields, got NoneType"),
        (lambda c: {**c, "steps": True}, "expected int @ $.steps"),  # was read as --steps 1
        (lambda c: {**c, "seq_len": 64.7}, "expected int @ $.seq_len"),  # was truncated to 64
        (lambda c: {**c, "compile": 1}, "expected bool @ $.compile"),
    ],
)
def test_run_config_json_with_wrong_types_is_one_error_line(run_dir, capsys, edit, message):
    code, out, err = _train(capsys, str(run_dir), "--resume")  # positive control: the intact run is finished
    assert code == 0 and "is already finished" in " ".join(out.split()), err
    config = run_dir / "config.json"
    config.write_text(json.dumps(edit(json.loads(config.read_text()))))
    code, _, err = _train(capsys, str(run_dir), "--resume")
    line = _one_error(err)
    assert code == 2 and "invalid train config: " in line and message in line


@pytest.mark.parametrize("answers", [None, [{"x": 1}, "4"], [3, None]])  # None: the intact shards (positive control)
def test_grpo_answers_that_are_not_strings_are_named(sft_data, tmp_path, capsys, answers):
    tokenizer, _ = sft_data
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "What is 2 + 2?", "answer": "4"}\n')
    flags = ["--tokenizer", str(tokenizer), "--model", "tiny", "--steps", "1", "--seq-len", "64", "--batch-size", "2",
             "--grpo.num-generations", "2", "--grpo.max-completion-tokens", "4", "--no-compile"]  # fmt: skip
    code, _, err = _train(capsys, "grpo-tiny", "--data", str(jsonl), "--out-dir", str(tmp_path / "a"), *flags)
    assert code == 0, err  # renders the JSONL into a/prompts (grpo shards with answers.json)
    data = shutil.copytree(tmp_path / "a" / "prompts", tmp_path / "prompts")
    if answers is not None:  # was accepted: every reward compared a dict or int to a string and scored 0
        (data / "shard_0000" / "answers.json").write_text(json.dumps(answers))
    code, out, err = _train(capsys, "grpo-tiny", "--data", str(data), "--out-dir", str(tmp_path / "b"), *flags)
    if answers is None:
        assert code == 0 and "done: 1 steps" in out, err
        return
    kind = type(answers[0]).__name__
    assert code == 2 and f"shard_0000: answers.json row 0 is {kind}, not a string or null" in _one_error(err)

"""`astrai.save` / `save_lora` replace only a previous save of the same kind, never unrelated user files.

A save swaps a whole folder into place, so a red-team audit found it deleting a project folder's sources
(`astrai.save(m, "proj")`) and hiding a model's `config.json` when given that file as the output. These tests
attack it with such folders and files and check that everything survives, that the error names the path and
the unexpected entries, and that no `.tmp-` / `.old-` folder is left behind; positive controls check that
re-saving over a previous save (model or adapter) still works.
"""

from __future__ import annotations

import os
import shutil

import attrs
import pytest
import torch

import astrai
import astrai.io.checkpoint as ckpt
from astrai.io.lora import load_lora, save_lora
from astrai.models.decoder import init_params
from astrai.nn.lora import LoRAConfig, init_lora
from helpers import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("src") / "model")


@pytest.fixture(scope="module")
def model(model_dir):
    return astrai.load(model_dir)


def _tree(folder):
    """Every path under `folder` (relative) -> file bytes (None for folders): what a user would miss."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_save_into_a_project_folder_is_refused_and_deletes_nothing(model, tmp_path):
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "train.py").write_text("x\n")
    (proj / "notes.txt").write_text("precious\n")
    (proj / "config.json").write_text('{"mine": true}\n')  # a model-like name does not make it a model folder
    before = _tree(proj)
    with pytest.raises(FileExistsError) as err:
        astrai.save(model, proj)
    message = str(err.value)
    assert str(proj) in message and "notes.txt" in message and "src" in message
    assert "config.json" not in message  # only the unexpected entries are named
    assert _tree(proj) == before
    assert _leftovers(tmp_path) == []


def test_save_to_an_existing_file_is_refused_and_the_model_still_loads(model, model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    before = _tree(folder)
    with pytest.raises(FileExistsError, match="config.json: it exists and is a file"):
        astrai.save(model, folder / "config.json")
    assert _tree(folder) == before and _leftovers(folder) == []
    astrai.load(folder)


def test_save_under_a_file_is_a_clear_error(model, tmp_path):
    (tmp_path / "notes.txt").write_text("precious\n")
    with pytest.raises(NotADirectoryError, match="is a file"):
        astrai.save(model, tmp_path / "notes.txt" / "out")
    assert (tmp_path / "notes.txt").read_text() == "precious\n" and _leftovers(tmp_path) == []


def test_resave_over_a_previous_save_replaces_it(model, tmp_path):
    out = tmp_path / "out"
    astrai.save(model, out)
    (out / "chat_template.jinja").write_text("{{ messages }}")  # HF extras a model folder may hold
    (out / "special_tokens_map.json").write_text("{}")
    other = attrs.evolve(model, params=init_params(model.config, seed=7))
    assert astrai.save(other, out) == out.resolve()
    again = astrai.load(out)
    assert torch.equal(again.params.embed_tokens.weight, other.params.embed_tokens.weight)
    assert not torch.equal(again.params.embed_tokens.weight, model.params.embed_tokens.weight)  # really replaced
    assert not (out / "chat_template.jinja").exists()  # the previous save's files went with it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("target", [".", ".."])
def test_save_over_the_working_directory_is_refused(model, tmp_path, monkeypatch, target):
    # an empty (or previous-save) working directory would pass the entry check; swapped out, the user's shell sits
    # in a deleted folder. Control: a subfolder of it saves.
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match="current working directory"):
        astrai.save(model, target)
    assert _tree(tmp_path) == before and work.is_dir() and os.path.samefile(os.getcwd(), work)
    astrai.save(model, "model")
    assert astrai.load(work / "model").config == model.config


def test_save_into_an_empty_folder(model, tmp_path):
    (tmp_path / "empty").mkdir()
    astrai.save(model, tmp_path / "empty")
    astrai.load(tmp_path / "empty")


def test_a_failed_swap_puts_the_previous_folder_back(model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    astrai.save(model, out)
    before = _tree(out)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == 2:  # the first moves the old folder aside, the second would move the new one in
            raise OSError("rename failed")
        real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"):
        astrai.save(model, out)
    assert [p.name[:9] for p in calls] == ["out", ".out.tmp-", ".out.old-"]  # aside, failed move in, back
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_refusal_comes_before_any_writing(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    written = []
    with pytest.raises(FileExistsError, match="keep.txt"):
        ckpt.atomic_dir(tmp_path / "out", written.append, replaces=("*.json",), kind="test folder")
    assert written == [] and _leftovers(tmp_path) == []
    ckpt.atomic_dir(tmp_path / "out", lambda d: (d / "a.json").write_text("{}"))  # replaces=None: any folder
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.json"]


def test_save_lora_refuses_foreign_files_and_replaces_its_own(model, tmp_path):
    cfg = LoRAConfig(r=2)
    lora = init_lora(model.params, cfg)
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "train.py").write_text("x\n")
    with pytest.raises(FileExistsError, match="train.py"):
        save_lora(lora, cfg, out)
    assert sorted(p.name for p in out.iterdir()) == ["train.py"] and _leftovers(tmp_path) == []
    (out / "train.py").unlink()
    save_lora(lora, cfg, out)
    save_lora(lora, cfg, out)  # again over its own previous save
    load_lora(out, model.params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]

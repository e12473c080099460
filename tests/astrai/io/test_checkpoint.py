"""HF folder I/O: sharded loads, dtype casts, saves transformers can load, atomic replace, named errors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import astrai
from astrai.io.checkpoint import CheckpointError
from astrai.models.decoder import forward
from helpers import assert_close, save_hf, tiny_hf_model


def _logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


def test_sharded_folder_loads_like_single_file(tmp_path):
    hf = tiny_hf_model("llama")
    single = astrai.load(save_hf(hf, tmp_path / "single"))
    sharded_dir = save_hf(hf, tmp_path / "sharded", max_shard_size="100KB")
    assert os.path.exists(os.path.join(sharded_dir, "model.safetensors.index.json"))
    sharded = astrai.load(sharded_dir)
    ids = torch.randint(0, 256, (1, 8))
    assert torch.equal(forward(single.params, single.config, ids), forward(sharded.params, sharded.config, ids))


def test_dtype_cast_on_load(tmp_path):
    model = astrai.load(save_hf(tiny_hf_model("qwen2"), tmp_path), dtype="bfloat16")
    from astrai.tree import leaves

    assert {t.dtype for t in leaves(model.params)} == {torch.bfloat16}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_save_then_transformers_loads_same_logits(family, tied, tmp_path):
    import transformers

    hf = tiny_hf_model(family, tie_word_embeddings=tied)
    model = astrai.load(save_hf(hf, tmp_path / "orig"))
    out = astrai.save(model, tmp_path / "saved")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf)
    ids = torch.randint(0, 256, (2, 10))
    assert_close(_logits(reloaded, ids), _logits(hf, ids), atol=1e-6)
    again = astrai.load(out)
    assert torch.equal(forward(again.params, again.config, ids), forward(model.params, model.config, ids))


def test_save_replaces_atomically_and_failed_save_keeps_old(tmp_path, monkeypatch):
    model = astrai.load(save_hf(tiny_hf_model("llama"), tmp_path / "orig"))
    target = tmp_path / "out"
    astrai.save(model, target)
    before = load_file(target / "model.safetensors")
    import astrai.io.checkpoint as ckpt

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        astrai.save(model, target)
    after = load_file(target / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["orig", "out"]  # no temp folders left behind


def _break(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_bad_folders_raise_named_errors(tmp_path):
    good = tmp_path / "good"
    save_hf(tiny_hf_model("llama"), good)

    with pytest.raises(CheckpointError, match="no such model folder"):
        astrai.load(tmp_path / "nope")

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        astrai.load(empty)

    def variant(name, edit_config=None, edit_tensors=None, raw=None):
        folder = tmp_path / name
        folder.mkdir()
        for f in good.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        if edit_config:
            cfg = json.loads((folder / "config.json").read_text())
            edit_config(cfg)
            (folder / "config.json").write_text(json.dumps(cfg))
        if edit_tensors:
            _break(folder, edit_tensors)
        if raw:
            (folder / "model.safetensors").write_bytes(raw)
        return folder

    with pytest.raises(astrai.UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        astrai.load(variant("gpt2", edit_config=lambda c: c.update(model_type="gpt2")))
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.up_proj.weight.*missing"):
        astrai.load(variant("missing", edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight")))
    with pytest.raises(CheckpointError, match=r"model.norm.weight.*shape \(65,\).*expects \(64,\)"):
        astrai.load(variant("shape", edit_tensors=lambda t: t.update({"model.norm.weight": torch.ones(65)})))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        astrai.load(
            variant("extra", edit_tensors=lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(64)}))
        )
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupt"):
        astrai.load(variant("corrupt", raw=b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage"))
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        bad = variant("badjson")
        (bad / "config.json").write_text("{oops")
        astrai.load(bad)
    with pytest.raises(astrai.UnsupportedModelError, match="hidden_act='gelu'"):
        astrai.load(variant("act", edit_config=lambda c: c.update(hidden_act="gelu")))
    with pytest.raises(CheckpointError, match=r"missing required field\(s\) \['hidden_size'\]"):
        astrai.load(variant("nohidden", edit_config=lambda c: c.pop("hidden_size")))
    with pytest.raises(CheckpointError, match="hidden_size"):
        astrai.load(variant("typo", edit_config=lambda c: c.update(hidden_size="wide")))

"""PEFT-format LoRA adapter folders: round trip with PEFT's names and config, and errors naming file and tensor."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from astrai.io.errors import CheckpointError, UnsupportedModelError
from astrai.io.lora import load_lora, save_lora
from astrai.io.model import load
from astrai.models.decoder import forward
from astrai.nn.lora import LoRAAdapter, LoRAConfig, apply_lora, init_lora
from astrai.tree import named_tensors
from helpers import TINY, save_hf, tiny_hf_model

PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.lora_[AB]\.weight")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    # biases on attention and MLP, as in tests/astrai/nn/test_lora.py
    return save_hf(tiny_hf_model("llama", attention_bias=True, mlp_bias=True), tmp_path_factory.mktemp("hf"))


@pytest.fixture
def model(hf_dir):
    return load(hf_dir)


def _randomise_b(lora, seed=1, std=0.2):
    # fresh adapters have B = 0; give B values so that a round trip that lost them would show
    g = torch.Generator().manual_seed(seed)
    return {
        p: LoRAAdapter(ad.lora_a, torch.randn(ad.lora_b.shape, generator=g) * std, ad.scaling) for p, ad in lora.items()
    }


# ---- PEFT files ------------------------------------------------------------------------------------------------


def test_save_load_round_trip_with_peft_names(hf_dir, model, tmp_path):
    cfg = LoRAConfig(r=4, alpha=12, targets=("q_proj", "down_proj"))
    lora = _randomise_b(init_lora(model.params, cfg))
    out = save_lora(lora, cfg, tmp_path / "adapter", base_model="tiny-llama")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors = load_file(out / "adapter_model.safetensors")
    assert len(tensors) == 2 * 2 * TINY["num_hidden_layers"] and all(PEFT_KEY.fullmatch(k) for k in tensors)
    a = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    assert torch.equal(a, lora["blocks.1.mlp.down_proj"].lora_a)
    meta = json.loads((out / "adapter_config.json").read_text())
    assert meta["peft_type"] == "LORA" and (meta["r"], meta["lora_alpha"]) == (4, 12)
    assert meta["target_modules"] == ["down_proj", "q_proj"] and meta["base_model_name_or_path"] == "tiny-llama"

    fresh = load(hf_dir)  # a new base tree from disk
    loaded, loaded_cfg = load_lora(out, fresh.params)
    assert loaded_cfg == cfg and list(loaded) == list(lora)
    for name, t in named_tensors(lora).items():
        assert torch.equal(named_tensors(loaded)[name], t), name
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    assert torch.equal(
        forward(apply_lora(fresh.params, loaded), fresh.config, ids),
        forward(apply_lora(model.params, lora), model.config, ids),
    )


def test_save_rejects_adapters_that_disagree_with_the_config(model, tmp_path):
    lora = init_lora(model.params, LoRAConfig(r=4))
    with pytest.raises(ValueError, match=r"rank 4 and scaling 8\.0, the config says r=8"):
        save_lora(lora, LoRAConfig(r=8), tmp_path / "a")
    with pytest.raises(ValueError, match="not among the config's targets"):
        save_lora(lora, LoRAConfig(r=4, targets=("k_proj",)), tmp_path / "a")
    with pytest.raises(ValueError, match="no LoRA adapters to save"):
        save_lora({}, LoRAConfig(), tmp_path / "a")
    assert not (tmp_path / "a").exists()


@pytest.fixture
def saved(model, tmp_path):
    cfg = LoRAConfig(r=4)
    folder = save_lora(init_lora(model.params, cfg), cfg, tmp_path / "adapter")
    return folder, load_file(folder / "adapter_model.safetensors")


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_load_reports_missing_files(model, saved, tmp_path):
    with pytest.raises(CheckpointError, match=r"nowhere/adapter_config\.json: file not found"):
        load_lora(tmp_path / "nowhere", model.params)
    folder, _ = saved
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors: file not found"):
        load_lora(folder, model.params)


def test_load_reports_bad_tensors_by_name(model, saved):
    folder, tensors = saved
    weights = folder / "adapter_model.safetensors"
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"

    save_file({**tensors, name: torch.zeros(7, 4)}, weights)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}' has shape \(7, 4\), expected \(32, 4\)"):
        load_lora(folder, model.params)

    save_file({k: v for k, v in tensors.items() if k != name}, weights)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}' is missing"):
        load_lora(folder, model.params)

    extra = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    save_file({**tensors, extra: torch.zeros(4, 64)}, weights)
    with pytest.raises(CheckpointError, match=r"unexpected tensor .*k_proj\.lora_A\.weight' \(adapter for blocks\.0"):
        load_lora(folder, model.params)

    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        load_lora(folder, model.params)


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"peft_type": "IA3"}, UnsupportedModelError, "peft_type 'IA3' is not supported"),
        ({"use_dora": True}, UnsupportedModelError, "'use_dora' = True is not supported"),
        ({"rank_pattern": {"q_proj": 8}}, UnsupportedModelError, "'rank_pattern'"),
        ({"target_modules": ["q_proj", "lm_head"]}, UnsupportedModelError, "LM head is never a LoRA target"),
        ({"target_modules": ["c_attn"]}, UnsupportedModelError, "unknown LoRA target 'c_attn'"),
        ({"target_modules": "model\\.(q_proj"}, CheckpointError, "is not a valid regex"),
        ({"target_modules": r".*\.c_attn"}, CheckpointError, "match no projection of this model"),
        ({"target_modules": 7}, CheckpointError, "must be a list of module names or a regex"),
        ({"target_modules": r".*attn\.(q|k)_proj"}, CheckpointError, r"unexpected tensor .*v_proj\.lora_A\.weight'"),
        ({"r": 8}, CheckpointError, r"has shape \(4, 64\), expected \(8, 64\)"),
    ],
)
def test_load_reports_bad_configs(model, saved, changes, error, match):
    folder, _ = saved
    _edit_config(folder, **changes)
    with pytest.raises(error, match=match):
        load_lora(folder, model.params)


def test_load_accepts_peft_training_fields_and_all_linear(model, tmp_path):
    cfg = LoRAConfig(r=2, targets="all-linear")
    folder = save_lora(init_lora(model.params, cfg), cfg, tmp_path / "adapter")
    # written by PEFT during training: dropout is a training-only knob, nulls for unset patterns
    _edit_config(folder, target_modules="all-linear", lora_dropout=0.05, rank_pattern=None, layer_replication=None)
    lora, loaded_cfg = load_lora(folder, model.params)
    assert len(lora) == 14 and loaded_cfg.target_names == cfg.target_names

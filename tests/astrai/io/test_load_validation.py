"""`astrai.load` input validation: devices, dtypes, config.json values, layer/expert counts, weight dtypes and
finiteness, eos ids and chat-template types each fail early with an error naming the problem.

Every attack edits one thing in a copy of a tiny random model folder; the unedited folder (and legal variants of
the edited field) loading is the positive control. Attacks that used to hang run under a wall-clock deadline so a
regression fails instead of hanging.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import astrai
from astrai.io.errors import CheckpointError
from helpers import deadline, save_hf, tiny_hf_model, tiny_model_dir

MISSING = "/nonexistent/astrai-model"  # a bad device or dtype must be reported before the path is even looked at


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return Path(tiny_model_dir(tmp_path_factory.mktemp("base") / "model"))


def variant(base: Path, tmp_path: Path, *, config: dict | None = None, drop: tuple[str, ...] = (),
            files: dict[str, dict] | None = None) -> Path:  # fmt: skip
    """A copy of `base` with config.json keys set (`config`) or removed (`drop`) and JSON files merged."""
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    edits = {"config.json": config or {}, **(files or {})}
    for name, changes in edits.items():
        path = folder / name
        data = json.loads(path.read_text()) if path.is_file() else {}
        data.update(changes)
        for key in drop if name == "config.json" else ():
            data.pop(key, None)
        path.write_text(json.dumps(data))
    return folder


# ---- device and dtype ---------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_on_a_cpu_only_torch_is_a_clear_error_before_reading(device):
    with pytest.raises(ValueError, match=r"device 'cuda(:0)?' requested but CUDA is not available \(use 'cpu'"):
        astrai.load(MISSING, device=device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_index_past_the_visible_devices():
    with pytest.raises(ValueError, match="CUDA device"):
        astrai.load(MISSING, device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize(("device", "match"), [("gpu", "not a device name torch knows"), (3.5, "not a device")])
def test_unknown_device_names(device, match):
    with pytest.raises(ValueError, match=match):
        astrai.load(MISSING, device=device)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks a machine without MPS")
def test_mps_without_mps():
    with pytest.raises(ValueError, match="device 'mps' is not available"):
        astrai.load(MISSING, device="mps")


def test_cpu_and_auto_devices_load(base):
    assert astrai.load(base, device="cpu").device == torch.device("cpu")
    assert astrai.load(base, device="auto").device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, "float64", "fp16", 16])
def test_unsupported_dtypes_are_a_value_error_before_reading(dtype):
    with pytest.raises(ValueError, match=r"dtype must be one of \['auto', 'bfloat16', 'float', 'float16'"):
        astrai.load(MISSING, dtype=dtype)


@pytest.mark.parametrize(("dtype", "expected"), [
    ("half", torch.float16), ("float", torch.float32), ("auto", torch.float32), (None, torch.float32),
    (torch.bfloat16, torch.bfloat16), ("torch.float16", torch.float16),
])  # fmt: skip
def test_cli_dtype_names_work_in_the_api(base, dtype, expected):
    model = astrai.load(base, dtype=dtype)
    assert model.dtype == expected
    assert model.config.torch_dtype == expected


# ---- config.json values -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("config", "match"), [
    ({"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite number > 0, got nan"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a finite number > 0, got -1"),
    ({"rope_theta": 0, "rope_parameters": None}, "rope_theta must be a finite number > 0, got 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, r"rope_parameters.rope_theta must be"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -1}}, r"rope_scaling.factor must be a finite number > 0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "high_freq_factor .* must be greater"),
    ({"eos_token_id": 99999}, r"eos_token_id 99999 is outside the vocabulary \[0, 300\)"),
    ({"eos_token_id": -1}, r"eos_token_id -1 is outside the vocabulary"),
    ({"eos_token_id": [2, "3"]}, "eos_token_id must be an integer, a list of integers or null"),
    ({"bos_token_id": 300}, r"bos_token_id 300 is outside the vocabulary"),
    ({"sliding_window": -5}, "sliding_window must be an integer >= 0 or null, got -5"),
    ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"hidden_size": "32"}, "hidden_size must be a positive integer, got '32'"),
    ({"hidden_size": 32.0}, "hidden_size must be a positive integer, got 32.0"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"initializer_range": math.inf}, "initializer_range must be a finite number >= 0"),
    ({"layer_types": ["full_attention", "chunked_attention"], "use_sliding_window": True, "sliding_window": 8},
     r"layer_types \['chunked_attention'\] are not supported"),
])  # fmt: skip
def test_bad_config_values_name_the_field(base, tmp_path, config, match):
    with pytest.raises(CheckpointError, match=match):
        astrai.load(variant(base, tmp_path, config=config))


@pytest.mark.parametrize("config", [
    {},  # the folder as saved
    {"sliding_window": None},
    {"sliding_window": 4096},  # Qwen2.5 configs: a window that use_sliding_window false leaves unused
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}},
    {"eos_token_id": [2, 0]},
    {"pad_token_id": -1},  # only carried for round trips (old Llama conversions)
])  # fmt: skip
def test_legal_config_values_load(base, tmp_path, config):
    assert astrai.load(variant(base, tmp_path, config=config)).config.vocab_size == 300


@pytest.mark.parametrize("extra", [{}, {"use_sliding_window": True, "sliding_window": 8}])
def test_huge_layer_count_fails_against_the_weights_without_building(base, tmp_path, extra):
    folder = variant(base, tmp_path, config={"num_hidden_layers": 10**9, **extra})
    with deadline(20), pytest.raises(CheckpointError, match="num_hidden_layers is 1000000000 but the weights hold 2"):
        astrai.load(folder)


def test_huge_expert_count_fails_against_the_weights(tmp_path):
    hf = tiny_hf_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    folder = Path(save_hf(hf, tmp_path / "moe"))
    assert astrai.load(folder).config.moe.num_experts == 4  # positive control
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_experts": 10**9}))
    with deadline(20), pytest.raises(CheckpointError, match="num_experts is 1000000000 but the weights hold 4"):
        astrai.load(folder)


# ---- weights ------------------------------------------------------------------------------------------------


def _rewrite(folder: Path, name: str, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = edit(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})


def test_integer_typed_weights_are_refused(base, tmp_path):
    folder = variant(base, tmp_path)
    _rewrite(folder, "model.norm.weight", lambda t: t.view(torch.int32))  # same bytes, header says I32
    with pytest.raises(CheckpointError, match="'model.norm.weight' is stored as int32; parameters must be stored"):
        astrai.load(folder)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_weights_are_refused_when_cast(base, tmp_path, value):
    folder = variant(base, tmp_path)
    assert astrai.load(folder, dtype="bfloat16").dtype == torch.bfloat16  # positive control
    _rewrite(folder, "model.layers.1.mlp.up_proj.weight", lambda t: t.index_fill(0, torch.tensor([3]), value))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' holds 32 NaN or infinite"):
        astrai.load(folder, dtype="bfloat16")


def test_cast_overflow_is_named(base, tmp_path):
    folder = variant(base, tmp_path)
    _rewrite(folder, "model.norm.weight", lambda t: t.index_fill(0, torch.tensor([0]), 1e30))
    assert astrai.load(folder, dtype="bfloat16").dtype == torch.bfloat16  # bfloat16 holds 1e30
    with pytest.raises(CheckpointError, match="values up to 1e\\+30, beyond float16's range"):
        astrai.load(folder, dtype="float16")


# ---- eos ids and chat templates -----------------------------------------------------------------------------


def test_generation_config_eos_outside_the_vocabulary(base, tmp_path):
    folder = variant(base, tmp_path, files={"generation_config.json": {"eos_token_id": [2, 99999]}})
    with pytest.raises(CheckpointError, match=r"eos token id 99999 .* outside the vocabulary \[0, 300\)"):
        astrai.load(folder)


@pytest.mark.parametrize("template", [5, {"default": "x"}, [{"name": "default"}]])
def test_non_string_chat_template_is_refused_at_load(base, tmp_path, template):
    folder = variant(base, tmp_path, files={"tokenizer_config.json": {"chat_template": template}})
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="tokenizer_config.json: chat_template"):
        astrai.load(folder)


@pytest.mark.parametrize(
    "template", ["{{ messages[0]['content'] }}", [{"name": "default", "template": "{{ messages[0]['content'] }}"}]]
)
def test_string_and_named_chat_templates_load(base, tmp_path, template):
    folder = variant(base, tmp_path, files={"tokenizer_config.json": {"chat_template": template}})
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = astrai.load(folder).tokenizer
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"

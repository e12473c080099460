"""Multi-LoRA serving against bad adapters and bad settings (issue 44, item 6), and against PEFT itself.

Each bad adapter is one clear `LoRAError` naming the problem, raised on the loading thread, and nothing else is
disturbed: the adapters already loaded keep serving, with the same output. The PEFT test serves an adapter that
PEFT made and saved, in a batch beside the base model, and compares the engine's greedy tokens and logprobs with
`PeftModel`'s logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from astrai.inference.engine import Engine, EngineConfig, LoRAError, LoRANotFoundError
from astrai.inference.params import SamplingParams
from astrai.io.lora import save_lora
from astrai.io.model import load
from astrai.models.config import ModelConfig
from astrai.models.decoder import init_params
from astrai.nn.lora import LoRAAdapter, LoRAConfig
from helpers import TINY, random_lora, save_hf, tiny_hf_model, tiny_model_dir

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(tiny_model_dir(tmp_path_factory.mktemp("base")))


@pytest.fixture
def good(model, tmp_path):
    cfg = LoRAConfig(r=4, alpha=8, targets="all-linear")
    return str(save_lora(random_lora(model.params, cfg, seed=5), cfg, tmp_path / "good"))


def _engine(model, **config):
    options = {"compile": False, "kv_budget_tokens": 1024, "enable_lora": True, "max_lora_rank": 8, "seed": 0,
               "background": False, **config}  # fmt: skip
    return Engine(model, EngineConfig(**options))


def _bad_folders(model, good, tmp_path):
    """name -> (folder, what the error must say)."""
    import shutil

    out = {}
    big = LoRAConfig(r=16, alpha=16, targets=("q_proj",))
    out["rank"] = (save_lora(random_lora(model.params, big, 1), big, tmp_path / "rank"), "above max_lora_rank 8")
    lacks = shutil.copytree(good, tmp_path / "lacks")
    config = json.loads((lacks / "adapter_config.json").read_text())
    (lacks / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["c_attn"]}))
    out["targets"] = (lacks, "c_attn")
    other = ModelConfig(model_type="qwen3", vocab_size=model.config.vocab_size, hidden_size=48, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        qk_norm=True)  # fmt: skip
    cfg = LoRAConfig(r=4, alpha=8, targets=("q_proj",))
    out["other base"] = (save_lora(random_lora(init_params(other), cfg, 2), cfg, tmp_path / "other"), "shape")
    out["missing"] = (tmp_path / "nowhere", "does not exist")
    half = shutil.copytree(good, tmp_path / "half")
    (half / "adapter_model.safetensors").unlink()
    out["half-written"] = (half, "file not found")
    cut = shutil.copytree(good, tmp_path / "cut")
    weights = cut / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    out["truncated"] = (cut, "corrupt or unreadable")
    nan = random_lora(model.params, cfg, 3)
    path = next(iter(nan))
    nan[path] = LoRAAdapter(nan[path].lora_a, torch.full_like(nan[path].lora_b, float("nan")), nan[path].scaling)
    out["nan"] = (save_lora(nan, cfg, tmp_path / "nan"), "NaN or infinite")
    return out


def test_bad_adapters_are_clear_errors_and_disturb_nothing(model, good, tmp_path):
    with _engine(model) as engine:
        engine.load_lora("good", good)
        before = engine.generate(["hello world"], GREEDY, lora="good")[0].outputs[0].token_ids
        for what, (folder, message) in _bad_folders(model, good, tmp_path).items():
            with pytest.raises(LoRAError, match=message) as err:
                engine.load_lora(what, folder)
            assert err.value.param == "lora_path", what
            assert what not in engine.loras()
        with pytest.raises(LoRAError, match="already loaded") as err:
            engine.load_lora("good", good)
        assert err.value.param == "lora_name"
        with pytest.raises(LoRANotFoundError, match="'nope'") as err:
            engine.submit("hello world", GREEDY, lora="nope")
        assert err.value.param == "model"
        with pytest.raises(LoRANotFoundError):
            engine.unload_lora("nope")
        assert engine.loras() == {"good": good}
        after = engine.generate(["hello world"], GREEDY, lora="good")[0].outputs[0].token_ids
        assert after == before
        assert engine.stats().lora_loaded == 1 and engine.scheduler.waiting == type(engine.scheduler.waiting)()


def test_lora_needs_enabling_and_sane_settings(model, good):
    with Engine(model, EngineConfig(compile=False, kv_budget_tokens=1024)) as engine:
        with pytest.raises(LoRAError, match="enable-lora"):
            engine.load_lora("good", good)
        with pytest.raises(LoRAError, match="enable-lora"):
            engine.submit("hello", GREEDY, lora="good")
        with pytest.raises(LoRAError):
            engine.unload_lora("good")
    for bad, message in [({"max_cpu_loras": 1, "max_loras": 2}, "max_cpu_loras"), ({"max_loras": 0}, ">= 1"),
                         ({"fuse_projections": True}, "fuse_projections")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EngineConfig(enable_lora=True, **bad)


# ---- against PEFT ---------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_peft_adapter_serves_as_peft_model_computes_it(tmp_path):
    peft = pytest.importorskip("peft")
    hf = tiny_hf_model("llama", attention_bias=True, mlp_bias=True)
    folder = save_hf(hf, tmp_path / "hf")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False,
                             task_type="CAUSAL_LM")  # fmt: skip
    theirs = peft.get_peft_model(tiny_hf_model("llama", attention_bias=True, mlp_bias=True), config).eval()
    theirs.save_pretrained(tmp_path / "peft")
    prompt = torch.randint(0, TINY["vocab_size"], (9,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    with Engine(load(folder), EngineConfig(compile=False, kv_budget_tokens=1024, enable_lora=True)) as engine:
        engine.load_lora("peft", tmp_path / "peft")
        base, ours = (c.outputs[0] for c in engine.generate([prompt, prompt], params, lora=[None, "peft"]))
    ids = torch.tensor([prompt + list(ours.token_ids[:-1])])
    with torch.no_grad():
        logprobs = torch.log_softmax(theirs(ids).logits[0, len(prompt) - 1 :].float(), -1)
    assert list(ours.token_ids) == logprobs.argmax(-1).tolist()
    expected = logprobs.gather(-1, torch.tensor(ours.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(ours.logprobs), expected, atol=1e-4, rtol=0)
    assert base.token_ids != ours.token_ids  # negative control: the adapter changes the output

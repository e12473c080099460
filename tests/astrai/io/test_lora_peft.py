"""LoRA adapters against PEFT itself: astrai's saved adapters load in `peft.PeftModel`, and PEFT's load in astrai.

Both directions compare logits on the same tiny llama (biases on), the same adapter weights, in fp32:
- astrai `save_lora` -> `PeftModel.from_pretrained(transformers model, folder)`;
- PEFT `get_peft_model(...).save_pretrained` (B initialised non-zero) -> astrai `load_lora` + `apply_lora`.
Negative control: the adapters move the logits well past the tolerance, so an adapter that was dropped fails.
"""

import pytest
import torch

from astrai.io.lora import load_lora, save_lora
from astrai.io.model import load
from astrai.models.decoder import forward
from astrai.nn.lora import LoRAAdapter, LoRAConfig, apply_lora, init_lora
from helpers import TINY, save_hf, tiny_hf_model

peft = pytest.importorskip("peft")  # a test-only reference (pyproject's dev extras)
transformers = pytest.importorskip("transformers")

TOL = 2e-5
# peft 0.21 still asks transformers 5 the deprecated `is_gradient_checkpointing` (its own business, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf(tiny_hf_model("llama", attention_bias=True, mlp_bias=True), tmp_path_factory.mktemp("hf"))


def _hf(hf_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()


def _ids():
    return torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(3))


def _assert_adapter_matters(with_adapter, base):
    assert (with_adapter - base).abs().max() > 100 * TOL, "the adapter does not change the logits: vacuous test"


def test_astrai_adapter_loads_in_peft(hf_dir, tmp_path):
    model = load(hf_dir)
    cfg = LoRAConfig(r=4, alpha=12, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    g = torch.Generator().manual_seed(1)
    lora = {p: LoRAAdapter(ad.lora_a, torch.randn(ad.lora_b.shape, generator=g) * 0.2, ad.scaling)
            for p, ad in init_lora(model.params, cfg).items()}  # fmt: skip
    folder = save_lora(lora, cfg, tmp_path / "adapter", base_model=str(hf_dir))
    ids = _ids()
    with torch.no_grad():
        base = _hf(hf_dir)(ids).logits
        theirs = peft.PeftModel.from_pretrained(_hf(hf_dir), str(folder)).eval()(ids).logits
    ours = forward(apply_lora(model.params, lora), model.config, ids)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    _assert_adapter_matters(theirs, base)


LAYERS = TINY["num_hidden_layers"]
PEFT_TARGETS = {  # PEFT's target_modules -> how many projections it adapts in the tiny model
    "list": (["q_proj", "k_proj", "gate_proj"], 3 * LAYERS),
    "all-linear": ("all-linear", 7 * LAYERS),
    "regex": (r".*\.(v_proj|up_proj)", 2 * LAYERS),
    "one-layer": (["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"], 2),
}


@pytest.mark.parametrize("kind", list(PEFT_TARGETS))
def test_peft_adapter_loads_in_astrai(hf_dir, tmp_path, kind):
    targets, adapted = PEFT_TARGETS[kind]
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False,
                             task_type="CAUSAL_LM")  # fmt: skip
    theirs = peft.get_peft_model(_hf(hf_dir), config).eval()
    theirs.save_pretrained(tmp_path / "peft")
    ids = _ids()
    with torch.no_grad():
        expected = theirs(ids).logits
        base = _hf(hf_dir)(ids).logits
    model = load(hf_dir)
    lora, cfg = load_lora(tmp_path / "peft", model.params)
    assert (cfg.r, cfg.alpha) == (8, 16) and len(lora) == adapted
    torch.testing.assert_close(forward(apply_lora(model.params, lora), model.config, ids), expected, atol=TOL, rtol=0)
    _assert_adapter_matters(expected, base)

"""MoE decoders (qwen3_moe, qwen2_moe, mixtral) against transformers on the same random weights."""

import json

import pytest
import torch
import torch.nn.functional as F

from astrai.data.batch import LMBatch
from astrai.inference.generate import generate_ids
from astrai.io.checkpoint import save_params
from astrai.io.errors import CheckpointError
from astrai.io.model import load
from astrai.models.decoder import forward, hidden_states
from astrai.nn.mlp import MLPParams
from astrai.nn.moe import MoEParams, load_balancing_loss
from astrai.train.optim import AdamWConfig
from astrai.train.step import StepOptions, TrainStep, init_train_state, lm_loss
from astrai.tree import tree_map
from helpers import assert_close, assert_logits_match_hf, hf_and_loaded, randomize_routers, save_hf, tiny_hf_model

MOE = dict(num_experts_per_tok=2, num_hidden_layers=3)
CASES = {
    # layer 1 dense through mlp_only_layers; renormalised top-k
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    # layers 0 and 2 dense through decoder_sparse_step; shared expert with its sigmoid gate; raw top-k weights
    "qwen2_moe": (
        "qwen2_moe",
        dict(num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=2),
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4)),
}
SPARSE = {"qwen3_moe": (True, False, True), "qwen2_moe": (False, True, False), "mixtral": (True, True, True)}


def _hf(case: str):
    family, overrides = CASES[case]
    return randomize_routers(tiny_hf_model(family, **MOE, **overrides))


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    return hf_and_loaded(request.param, _hf(request.param), tmp_path_factory)


def test_logits_match_transformers(pair):
    case, hf, model = pair
    assert tuple(isinstance(b.mlp, MoEParams) for b in model.params.blocks) == SPARSE[case]
    assert all(isinstance(b.mlp, MoEParams | MLPParams) for b in model.params.blocks)
    assert_logits_match_hf(model, hf, torch.randint(0, hf.config.vocab_size, (2, 17)), msg=case)


def test_aux_loss_matches_transformers(pair):
    case, hf, model = pair
    ids = torch.randint(0, hf.config.vocab_size, (2, 11))
    with torch.no_grad():
        expected = hf(ids, output_router_logits=True).aux_loss
    _, aux = hidden_states(model.params, model.config, ids, return_aux=True)
    assert int(aux.layers) == sum(SPARSE[case])
    assert_close(load_balancing_loss(aux), expected, atol=1e-5, msg=case)


def test_train_loss_with_aux_matches_transformers(pair):
    # transformers: loss = mean CE + router_aux_loss_coef * aux_loss; lm_loss with one micro-batch is the same
    case, hf, model = pair
    coef = 0.25
    hf.config.router_aux_loss_coef = coef
    hf.router_aux_loss_coef = coef
    tokens = torch.randint(0, hf.config.vocab_size, (2, 10))
    batch = LMBatch(
        tokens=tokens[:, :-1],
        targets=tokens[:, 1:],
        loss_mask=torch.ones(2, 9),
        positions=torch.arange(9).repeat(2, 1),
    )
    with torch.no_grad():
        out = hf(batch.tokens, labels=None, output_router_logits=True)
        ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), batch.targets.reshape(-1))
        expected = ce + coef * out.aux_loss
    opts = StepOptions(compile=False, moe_aux_loss_coef=coef)
    loss, task, _ = lm_loss(model.params, batch, batch.loss_mask.sum(), cfg=model.config, opts=opts, packed=False)
    assert_close(loss, expected, atol=1e-5, msg=case)
    assert_close(task / 18, ce, atol=1e-5, msg=case)


def test_train_step_reports_router_stats_from_transformers_routers(pair):
    """The step's moe_* metrics (averaged over micro-batches) against statistics of transformers' router logits."""
    case, hf, model = pair
    k, batches = hf.config.num_experts_per_tok, []
    for seed in range(2):
        tokens = torch.randint(0, hf.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))
        batches.append(LMBatch(tokens=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=torch.ones(2, 9),
                               positions=torch.arange(9).repeat(2, 1)))  # fmt: skip
    expected = {"moe_entropy": [], "moe_load_max": [], "moe_dead_fraction": []}
    with torch.no_grad():
        for batch in batches:
            layers = [lg.float() for lg in hf(batch.tokens, output_router_logits=True).router_logits if lg is not None]
            entropy, load, dead = [], [], []
            for logits in layers:  # [N, E] of each MoE layer
                probs = logits.softmax(-1)
                counts = torch.bincount(probs.topk(k, -1).indices.reshape(-1), minlength=probs.shape[-1]).float()
                entropy.append(-(probs * probs.log()).sum(-1).mean())
                load.append(counts.max() / (probs.shape[0] * k / probs.shape[-1]))
                dead.append((counts == 0).float().mean())
            for name, values in zip(expected, (entropy, load, dead), strict=True):
                expected[name].append(torch.stack(values).mean())
    step = TrainStep(model.config, StepOptions(compile=False), AdamWConfig(lr=1e-3), trainable=model.params)
    state = init_train_state(tree_map(torch.clone, model.params), AdamWConfig(lr=1e-3))  # the fixture stays intact
    metrics = step(state, batches, lr=1e-3)
    for name, values in expected.items():
        assert_close(metrics[name], torch.stack(values).mean(), atol=1e-5, msg=f"{case} {name}")
    assert metrics["moe_aux_loss"] > 0


def test_save_then_transformers_loads_same_logits(pair, tmp_path):
    import transformers

    case, hf, model = pair
    save_params(tmp_path, model.config, model.params)
    names = set(json.loads((tmp_path / "config.json").read_text()))
    assert "model_type" in names
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, 9))
    with torch.no_grad():
        assert_close(reloaded(ids).logits, hf(ids).logits, atol=1e-6, msg=case)
    again = load(tmp_path)
    assert again.config == model.config
    assert_close(forward(again.params, again.config, ids), forward(model.params, model.config, ids), atol=0)


def test_missing_and_extra_expert_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = _hf("mixtral")
    folder = save_hf(hf, tmp_path / "m")
    weights = load_file(f"{folder}/model.safetensors")
    dropped = dict(weights)
    del dropped["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(dropped, f"{folder}/model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight.*missing"):
        load(folder)
    extra = dict(weights)
    extra["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = torch.zeros(8)
    save_file(extra, f"{folder}/model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*experts\.4\.w1"):
        load(folder)


def test_greedy_generation_matches_transformers(tmp_path):
    hf = _hf("qwen3_moe")
    model = load(save_hf(hf, tmp_path))
    prompts = [[5, 17, 99, 3, 42], [7, 7, 200]]
    ours = generate_ids(model, prompts, max_tokens=6, temperature=0.0, stop_token_ids=[])
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert got == out[0, len(prompt) :].tolist()

"""The engine serving fused projections (`EngineConfig.fuse_projections`, `astrai.inference.layout`).

Reference: transformers' greedy generate on the same weights (qwen2: q/k/v biases), for eager and compiled
steps with staggered arrivals (mixed steps); then the engine's weight updates (`update_params(tree)` and an
in-place step + `update_params()`) against a fresh unfused engine on the new weights, with the served fused
storage reused. The default (None) fuses on CUDA only, skips with a warning when the copy would not fit, and
tensor parallel never fuses.
"""

from __future__ import annotations

import logging
import time
import types

import pytest
import torch

import astrai
from astrai.inference import layout
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.nn.attention import FusedAttentionParams
from astrai.tree import leaves
from helpers import DEVICE, save_hf, tiny_hf_model

NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny_hf_model("qwen2", max_position_embeddings=256)
    # on a GPU machine the engine runs the Triton kernels (and CUDA graphs); the reference stays on the CPU
    return hf, astrai.load(save_hf(hf, tmp_path_factory.mktemp("m")), device=DEVICE)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (5, 23, 1, 40, 9, 17)]


def _hf_greedy(hf, prompts):
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=0)  # fmt: skip
            out.append(gen[0, len(p) :].tolist())
    return out


def _staggered(engine, prompts):
    handles = [engine.submit(p, GREEDY) for p in prompts[:3]]
    time.sleep(0.02)  # the rest arrive while the first decode: mixed steps
    handles += [engine.submit(p, GREEDY) for p in prompts[3:]]
    return [list(h.result().outputs[0].token_ids) for h in handles]


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_fused_engine_matches_transformers(pair, prompts, compile):
    hf, model = pair
    with Engine(
        model, EngineConfig(fuse_projections=True, compile=compile, page_size=4, max_step_tokens=32, max_running=8)
    ) as eng:
        served = eng.runner.model.params
        assert all(isinstance(b.attn, FusedAttentionParams) for b in served.blocks)
        assert _staggered(eng, prompts) == _hf_greedy(hf, prompts)


def test_weight_updates_reach_the_fused_copy(pair, prompts, tmp_path):
    _, model = pair
    other = astrai.load(save_hf(tiny_hf_model("qwen2", seed=5, max_position_embeddings=256), tmp_path), device=DEVICE)
    cfg = EngineConfig(fuse_projections=True, compile=False, background=False)
    with Engine(other, EngineConfig(compile=False, background=False, fuse_projections=False)) as plain:
        expected = [list(c.outputs[0].token_ids) for c in plain.generate(prompts, GREEDY)]
    mine = astrai.load(save_hf(tiny_hf_model("qwen2", max_position_embeddings=256), tmp_path / "mine"), device=DEVICE)
    with Engine(mine, cfg) as engine:
        before = [list(c.outputs[0].token_ids) for c in engine.generate(prompts, GREEDY)]
        pointers = [t.data_ptr() for t in leaves(engine.runner.model.params.blocks[0].attn.qkv_proj)]
        engine.update_params(other.params)  # new tensors: written into the served fused storage
        assert [t.data_ptr() for t in leaves(engine.runner.model.params.blocks[0].attn.qkv_proj)] == pointers
        assert [list(c.outputs[0].token_ids) for c in engine.generate(prompts, GREEDY)] == expected
        assert expected != before  # negative control: the two models differ
        # an optimizer step in place on the served checkpoint-layout tensors, then update_params()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for t in leaves(other.params):
                t.add_(torch.randn(t.shape, generator=gen).to(t.device) * 0.2)
        engine.update_params()
        changed = [list(c.outputs[0].token_ids) for c in engine.generate(prompts, GREEDY)]
    with Engine(other, EngineConfig(compile=False, background=False, fuse_projections=False)) as plain:
        assert changed == [list(c.outputs[0].token_ids) for c in plain.generate(prompts, GREEDY)]
    assert changed != expected


def test_the_default_fuses_on_cuda_only_and_when_the_copy_fits(pair, monkeypatch, caplog):
    _, model = pair
    cuda = model.device.type == "cuda"
    assert layout.should_fuse(model, None, tensor_parallel=False) == cuda  # CPU: off by default
    with Engine(model, EngineConfig(compile=False, background=False)) as engine:
        assert (engine.runner.model is model) != cuda  # on CPU the model's own tensors, no copy
    need = layout.fused_bytes(model.params)
    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0), params=model.params)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need * 4, need * 8))
    assert layout.should_fuse(on_cuda, None, tensor_parallel=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need * 4 - 4, need * 8))
    with caplog.at_level(logging.WARNING, logger="astrai.inference.layout"):
        assert not layout.should_fuse(on_cuda, None, tensor_parallel=False)
    assert "not fusing q/k/v and gate/up" in caplog.text
    assert not layout.should_fuse(on_cuda, False, tensor_parallel=False)
    with caplog.at_level(logging.WARNING, logger="astrai.inference.layout"):
        assert not layout.should_fuse(model, True, tensor_parallel=True)  # the ranks shard the unfused layout
    assert "ignored under tensor parallel" in caplog.text

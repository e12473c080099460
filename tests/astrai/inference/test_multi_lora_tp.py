"""Multi-LoRA serving under tensor parallel (issue 44): adapters split like their base linear, slot writes reach
every rank before the forward that reads them.

Layout (no processes): for every tensor-parallel test family (one KV head replicated over 2 ranks, MoE shared
experts, MLA) and every rank, the shard of the merged model equals the shard merged with `shard_lora`'s part of
the adapter. Engine (rank 0 here, rank 1 spawned, gloo): a mixed batch of the base model and two adapters of
different ranks and targets gives the greedy tokens of a one-rank LoRA engine and of each merged model, with the
chosen tokens' logprobs within 1e-4 of the one-rank engine's (a row-parallel update added twice, or a slot written
on rank 0 only, moves them far more); one slot serving two adapters in turn (rewritten while serving) does too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import attrs
import pytest
import torch

from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.inference.tp import TPRunner
from astrai.io.lora import save_lora
from astrai.io.model import load
from astrai.models.tp import shard_lora, shard_params
from astrai.nn.lora import LoRAConfig, merge_lora
from astrai.nn.lora_slots import slot_linears
from astrai.ops.collectives import TensorParallel
from astrai.tree import named_tensors
from helpers import random_lora, tiny_model_dir

ADAPTERS = {  # different ranks, different targets
    "qv2": LoRAConfig(r=2, alpha=4, targets=("q_proj", "v_proj")),
    "all8": LoRAConfig(r=8, alpha=8, targets="all-linear"),
}
NAMES = [None, "qv2", "all8", "all8", None, "qv2"]
TEXTS = ["hello world", "the quick brown fox", "lazy dog", "this is a tiny corpus", "fox and dog", "hello fox"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)


def _tp_configs():
    path = Path(__file__).parents[1] / "models" / "tp_worker.py"
    spec = importlib.util.spec_from_file_location("tp_worker", path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker.configs()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_shard_of_merged_model_is_shard_merged_with_its_adapter_part(family):
    from astrai.models.decoder import init_params

    cfg = _tp_configs()[family]
    params = init_params(cfg, seed=1)
    lora = random_lora(params, LoRAConfig(r=4, alpha=8, targets="all-linear"), seed=3)
    assert len(lora) >= 4  # q and o at least, on every layer
    for rank in range(2):
        tp = TensorParallel(rank=rank, size=2)
        want = named_tensors(shard_params(merge_lora(params, lora), cfg, tp))
        got = named_tensors(merge_lora(shard_params(params, cfg, tp), shard_lora(lora, cfg, tp)))
        assert want.keys() == got.keys()
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, atol=1e-6, rtol=0, msg=f"rank {rank}: {name}")
    with pytest.raises(ValueError, match="lm_head"):
        shard_lora({"lm_head": next(iter(lora.values()))}, cfg, TensorParallel(rank=0, size=2))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(tiny_model_dir(tmp_path_factory.mktemp("base")))  # 4 query heads, 2 KV heads: 1 of each per rank


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    """name -> (adapter tree, PEFT folder)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        lora = random_lora(model.params, cfg, seed=i + 1)
        out[name] = (lora, str(save_lora(lora, cfg, root / name)))
    return out


def _generate(model, adapters, names, **config):
    """(token ids, chosen-token logprobs) of TEXTS under `names`, every request submitted at once; the most
    adapters running in one step and the slot writes."""
    options = {"compile": False, "kv_budget_tokens": 1024, "page_size": 4, "max_step_tokens": 16, "max_running": 4,
               "seed": 0, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "background": False,
               **config}  # fmt: skip
    with Engine(model, EngineConfig(**options)) as engine:
        if options.get("tensor_parallel_size", 1) > 1:
            assert isinstance(engine.runner, TPRunner) and engine.runner.lora
            assert slot_linears(engine.runner.model.params)  # rank 0's shard holds the slots
        for name in ADAPTERS:
            engine.load_lora(name, adapters[name][1])
        writes, write = [], engine.adapters.write
        engine.adapters.write = lambda slot, lora, scaling: writes.append(slot) or write(slot, lora, scaling)
        handles = [engine.submit(t, GREEDY, lora=n) for t, n in zip(TEXTS, names, strict=True)]
        most = 0
        while engine.step():
            most = max(most, len(engine.stats().lora_running))
        outs = [h.result().outputs[0] for h in handles]
    return [o.token_ids for o in outs], torch.tensor([o.logprobs for o in outs]), most, writes


def _merged(model, adapters, name):
    params = model.params if name is None else merge_lora(model.params, adapters[name][0])
    with Engine(attrs.evolve(model, params=params), EngineConfig(compile=False, kv_budget_tokens=1024)) as engine:
        return [c.outputs[0].token_ids for c in engine.generate(TEXTS, GREEDY)]


@pytest.fixture(scope="module")
def refs(model, adapters):
    return {name: _merged(model, adapters, name) for name in [None, *ADAPTERS]}


@pytest.mark.parametrize("max_loras", [2, 1], ids=["mixed", "slot_rewritten"])
def test_two_ranks_serve_adapters_as_one_rank_and_merged_models(model, adapters, refs, max_loras):
    one, one_lp, _, _ = _generate(model, adapters, NAMES, max_loras=max_loras)
    two, two_lp, most, writes = _generate(model, adapters, NAMES, max_loras=max_loras, tensor_parallel_size=2)
    assert most == max_loras  # mixed: both adapters in one step; rewritten: one slot, each adapter in turn
    if max_loras == 1:
        assert writes.count(0) >= 2  # slot 0 was written again while the engine served
    assert two == one
    assert (two_lp - one_lp).abs().max() <= 1e-4
    for i, name in enumerate(NAMES):
        assert two[i] == refs[name][i], (i, name)
    assert len({refs[name][0] for name in refs}) == len(refs)  # negative control: every adapter changes the text

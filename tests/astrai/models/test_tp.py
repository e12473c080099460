"""Tensor parallel (`astrai.models.tp`, `astrai.ops.collectives`): 2 gloo ranks equal one process in fp32.

Per family (llama with one KV head for two ranks and tied embeddings over an odd vocab; qwen3 with qk-norm;
qwen3_moe and qwen2_moe with expert parallel and a gated shared expert; deepseek_v3 with MLA and grouped sigmoid
routing), each with every bias its config can carry, filled with random non-zero values: dense logits, paged
prefill + decode through the KV pool, the gradients of a next-token loss (the 1-process gradient sharded the same
way is the reference), and unsharding back to the full tree. Negative controls: without `reduce_partial_grads`
some gradients are wrong; a row-parallel bias (o_proj, down_proj) on every rank instead of once gives wrong logits.
"""

import importlib.util
import json
import sys
from pathlib import Path

import attrs
import pytest

from astrai.configs.models import tiny
from astrai.models.decoder import init_params
from astrai.models.tp import check_tp, shard_params, tp_config, vocab_rows
from astrai.nn.lora import LoRAConfig, apply_lora, init_lora
from astrai.ops.collectives import TensorParallel
from helpers import run_ranks

_WORKER = Path(__file__).with_name("tp_worker.py")
_spec = importlib.util.spec_from_file_location("tp_worker", _WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

FAMILIES = ("llama", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("tp")
    run_ranks([sys.executable, str(_WORKER), str(out), *FAMILIES], timeout=180)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_equal_one_process(results, family):
    r = results[family]
    assert r["dense_max_diff"] <= 1e-5 * max(1.0, r["logits_scale"])
    assert r["paged_max_diff"] <= 1e-5 * max(1.0, r["logits_scale"])
    assert r["grad_names_equal"] and r["grad_max_diff"] <= 1e-5
    assert r["unshard_names_equal"] and r["unshard_max_diff"] == 0.0
    # each rank holds about half the parameters (norms, routers and MLA down-projections are replicated)
    assert r["shard_numel"] < 0.6 * r["full_numel"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_bias_is_random_and_a_row_bias_counts_once(results, family):
    r = results[family]
    # zero biases (init_params') would hide a row-parallel bias added on every rank or unsharded wrongly
    assert r["nonzero_bias_leaves"] == r["bias_leaves"] and r["row_bias_leaves"] >= 2  # o_proj in each layer
    # negative control: the row-parallel biases on both ranks are added twice, far past the tolerance above
    assert r["row_bias_on_every_rank_max_diff"] > 1e-2 * max(1.0, r["logits_scale"])


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_shards_equal_the_int8_model(results, family):
    r = results[family]
    assert r["int8_dense_max_diff"] <= 1e-5 * max(1.0, r["logits_scale"])
    assert r["int8_paged_max_diff"] <= 1e-5 * max(1.0, r["logits_scale"])
    assert r["int8_unshard_exact"]
    assert r["int8_vs_float_max_diff"] > 1e-4  # negative control: the quantized model is not the float one


@pytest.mark.parametrize("family", FAMILIES)
def test_partial_gradients_need_the_reduction(results, family):
    assert results[family]["unreduced_max_diff"] > 1e-4


def test_local_config_divides_heads_and_widths():
    cfg = worker.configs()["qwen2_moe"]
    local = tp_config(cfg, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (2, 1, 48)
    assert local.moe.shared_expert_intermediate_size == 24 and local.moe.num_experts == 8  # routing stays global
    assert tp_config(worker.configs()["llama"], 2).num_key_value_heads == 1  # one KV head, replicated
    assert tp_config(worker.configs()["deepseek_v3"], 2).mla.num_heads == 2
    assert vocab_rows(cfg, 2) == 51 and tp_config(cfg, 1) is cfg


def test_sizes_that_do_not_divide_are_named():
    cfg = tiny()
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tp(cfg, 3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tp(attrs.evolve(cfg, num_attention_heads=6, num_key_value_heads=3, intermediate_size=384), 2)
    with pytest.raises(ValueError, match="moe.num_experts"):
        check_tp(attrs.evolve(worker.configs()["qwen3_moe"], moe=attrs.evolve(
            worker.configs()["qwen3_moe"].moe, num_experts=6, num_experts_per_tok=2)), 4)  # fmt: skip


def test_lora_trees_are_refused():
    cfg = tiny()
    base = init_params(cfg)
    params = apply_lora(base, init_lora(base, LoRAConfig(r=4)))
    with pytest.raises(ValueError, match="LoRA"):
        shard_params(params, cfg, TensorParallel(rank=0, size=2))
    with pytest.raises(ValueError, match="rank 2"):
        TensorParallel(rank=2, size=2)

"""One rank of the tensor-parallel model checks (`test_tp.py` starts 2 of these with RANK / WORLD_SIZE set).

For every family each rank builds the full random model and its own shard, then compares, in fp32:
dense logits, a paged prefill + decode through the KV pool, the gradients of a next-token loss (the full
model's gradient tree, sharded the same way, is the reference) and `unshard_params`. Every family runs with every
bias its config can carry (`with_biases`), filled with random values (`helpers.random_biases`): `init_params` makes
them zero, and a zero bias hides a row-parallel bias added on every rank or unsharded from the wrong one. Writes
rank 0's measurements to `<out>/<family>.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

from astrai.inference.cache import init_kv_cache, make_attn_meta
from astrai.models.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from astrai.models.decoder import forward, init_params
from astrai.models.quantize import quantize_params
from astrai.models.tp import reduce_partial_grads, region_replicated, shard_params, tp_config, unshard_params
from astrai.nn.mlp import MLPParams
from astrai.ops.collectives import TensorParallel
from astrai.tree import leaves, named_tensors, replace, tree_map

sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/, for `helpers` when run as a rank script
from helpers import random_biases  # noqa: E402


def _base(**kw) -> dict:
    return dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128) | kw  # fmt: skip


def configs() -> dict[str, ModelConfig]:
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    return {
        # one KV head for 2 ranks (replicated), tied embeddings over an odd vocab (padded shards), every bias
        "llama": ModelConfig(
            **_base(
                num_key_value_heads=1,
                tie_word_embeddings=True,
                attention_bias=True,
                attention_out_bias=True,
                mlp_bias=True,
            )
        ),  # fmt: skip
        "qwen3": ModelConfig(**_base(model_type="qwen3", qk_norm=True)),
        "qwen3_moe": ModelConfig(
            **_base(model_type="qwen3_moe", qk_norm=True, ffn_type="moe", moe=attrs.evolve(moe, mlp_only_layers=(0,)))
        ),  # fmt: skip
        "qwen2_moe": ModelConfig(
            **_base(
                model_type="qwen2_moe",
                attention_bias=True,
                ffn_type="moe",
                moe=attrs.evolve(moe, shared_expert_intermediate_size=48, shared_expert_gate=True),
            )
        ),  # fmt: skip
        "deepseek_v3": ModelConfig(
            **_base(
                model_type="deepseek_v3",
                num_key_value_heads=4,
                attn_type="mla",
                rope=RopeConfig(interleaved=True),
                mla=MLAConfig(
                    num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12
                ),
                ffn_type="moe",
                moe=attrs.evolve(
                    moe,
                    scoring="sigmoid",
                    n_group=4,
                    topk_group=2,
                    e_score_correction_bias=True,
                    routed_scaling_factor=2.5,
                    shared_expert_intermediate_size=32,
                    first_k_dense_replace=1,
                ),
            )
        ),  # fmt: skip
    }


def with_biases(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with every bias switch on: q/k/v, o_proj and the dense MLP's gate/up/down (MLA: q_a, kv_a, o_proj).
    MoE experts, shared experts and routers have no bias in any family."""
    return attrs.evolve(cfg, attention_bias=True, attention_out_bias=True, mlp_bias=True)


def _row_biases_on_every_rank(shard, full):
    """`shard` with each row-parallel projection's (o_proj, dense down_proj) whole bias on this rank too: the bug
    that adding the bias once (on rank 0, before the sum) avoids. The negative control of the bias layout."""
    blocks = []
    for s, f in zip(shard.blocks, full.blocks, strict=True):
        mlp = s.mlp
        if isinstance(mlp, MLPParams):
            mlp = replace(mlp, down_proj=replace(mlp.down_proj, bias=f.mlp.down_proj.bias))
        blocks.append(replace(s, attn=replace(s.attn, o_proj=replace(s.attn.o_proj, bias=f.attn.o_proj.bias)), mlp=mlp))
    return replace(shard, blocks=tuple(blocks))


def _paged_logits(params, cfg, tp, prompts: list[list[int]], decode_tokens: list[int]) -> torch.Tensor:
    """Prefill `prompts` together, then one decode step per sequence; returns both steps' logits stacked."""
    page = 4
    cache = init_kv_cache(cfg, 16, page, dtype=torch.float32, device="cpu")
    pages, nxt = [], 1
    for p in prompts:
        n = -(-(len(p) + 1) // page)
        pages.append(list(range(nxt, nxt + n)))
        nxt += n
    meta = make_attn_meta(pages, [0] * len(prompts), [len(p) for p in prompts], page_size=page, device="cpu")
    tokens = torch.tensor([t for p in prompts for t in p])
    last = torch.tensor(list(torch.tensor([len(p) for p in prompts]).cumsum(0) - 1))
    first = forward(params, cfg, tokens, meta=meta, cache=cache, logits_positions=last, tp=tp)
    meta = make_attn_meta(pages, [len(p) for p in prompts], [1] * len(prompts), page_size=page, device="cpu",
                          decode=True)  # fmt: skip
    second = forward(params, cfg, torch.tensor(decode_tokens), meta=meta, cache=cache, tp=tp)
    return torch.cat([first, second])


def check(name: str, cfg: ModelConfig, tp: TensorParallel) -> dict:
    full = random_biases(init_params(cfg, seed=3), seed=4)
    local_cfg = tp_config(cfg, tp.size)
    shard = shard_params(full, cfg, tp)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    out: dict = {}

    ref = forward(full, cfg, tokens)
    got = forward(shard, local_cfg, tokens, tp=tp)
    out["dense_max_diff"] = (ref - got).abs().max().item()
    out["logits_scale"] = ref.abs().max().item()
    biases = {n: t for n, t in named_tensors(full).items() if n.endswith("bias")}
    out["bias_leaves"] = len(biases)
    out["nonzero_bias_leaves"] = sum(bool(t.abs().min() > 0) for t in biases.values())
    out["row_bias_leaves"] = sum(".o_proj." in n or ".down_proj." in n for n in biases)
    twice = forward(_row_biases_on_every_rank(shard, full), local_cfg, tokens, tp=tp)
    out["row_bias_on_every_rank_max_diff"] = (ref - twice).abs().max().item()

    prompts, nxt = [[5, 9, 3, 7, 1], [2, 4, 6]], [11, 13]
    out["paged_max_diff"] = (
        (_paged_logits(full, cfg, None, prompts, nxt) - _paged_logits(shard, local_cfg, tp, prompts, nxt)).abs().max()
    ).item()

    def loss_of(params, c, group):
        logits = forward(params, c, tokens[:, :-1], tp=group)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    full_req = tree_map(lambda t: t.detach().requires_grad_(), full)
    shard_req = tree_map(lambda t: t.detach().requires_grad_(), shard)
    ref_grads = _grads(loss_of(full_req, cfg, None), leaves(full_req))
    grad_tree = _rebuild(full_req, ref_grads)
    loss = loss_of(shard_req, local_cfg, tp)
    got_grads = dict(zip(map(id, leaves(shard_req)), _grads(loss, leaves(shard_req)), strict=True))
    partial = [got_grads[id(t)] for t in region_replicated(shard_req)]
    lone_grads = {k: v.clone() for k, v in got_grads.items()}
    reduce_partial_grads(_rebuild(shard_req, [got_grads[id(t)] for t in leaves(shard_req)]), cfg, tp)
    expected = named_tensors(shard_params(grad_tree, cfg, tp))
    actual = {n: got_grads[id(t)] for n, t in named_tensors(shard_req).items()}
    out["grad_names_equal"] = sorted(expected) == sorted(actual)
    out["grad_max_diff"] = max((expected[n] - actual[n]).abs().max().item() for n in expected)
    out["grad_scale"] = max(g.abs().max().item() for g in expected.values())
    out["partial_leaves"] = len(partial)

    # negative control: without reduce_partial_grads some leaves are wrong (when the model has such leaves)
    out["unreduced_max_diff"] = max((expected[n] - lone_grads[id(t)]).abs().max().item()
                                    for n, t in named_tensors(shard_req).items())  # fmt: skip

    back = named_tensors(unshard_params(shard, cfg, tp))
    ref_named = named_tensors(full)
    out["unshard_names_equal"] = sorted(back) == sorted(ref_named)
    out["unshard_max_diff"] = max((back[n] - ref_named[n]).abs().max().item() for n in ref_named)
    out["shard_numel"] = sum(t.numel() for t in leaves(shard))
    out["full_numel"] = sum(t.numel() for t in leaves(full))

    # int8 weight-only: the shards of the quantized tree (weights and their scales split alike) run the same
    # logits as the quantized model in one process, and unshard back to it bit for bit
    qfull = quantize_params(full)
    qshard = shard_params(qfull, cfg, tp)
    out["int8_dense_max_diff"] = (
        (forward(qfull, cfg, tokens) - forward(qshard, local_cfg, tokens, tp=tp)).abs().max().item()
    )
    out["int8_paged_max_diff"] = (
        (_paged_logits(qfull, cfg, None, prompts, nxt) - _paged_logits(qshard, local_cfg, tp, prompts, nxt)).abs().max()
    ).item()
    qback, qref = named_tensors(unshard_params(qshard, cfg, tp)), named_tensors(qfull)
    out["int8_unshard_exact"] = sorted(qback) == sorted(qref) and all(torch.equal(qback[n], qref[n]) for n in qref)
    out["int8_vs_float_max_diff"] = (forward(qfull, cfg, tokens) - ref).abs().max().item()
    return out


def _grads(loss, tensors):
    # unused leaves (the routing bias only picks experts) get zero gradients
    grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads, strict=True)]


def _rebuild(template, tensors):
    it = iter(tensors)
    return tree_map(lambda _: next(it), template)


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2:]
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    tp = TensorParallel(rank=dist.get_rank(), size=dist.get_world_size())
    cfgs = {name: with_biases(cfg) for name, cfg in configs().items()}
    for name in names:
        result = check(name, cfgs[name], tp)
        if tp.rank == 0:
            with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The engine's compiled steps do not guard on the parameters (`step.without_param_guards`); the engine checks a
new tree itself (`layout.layout_difference`) before it serves it.

References: the eager forward on the same tree, and the guards Dynamo builds without the filter. A tree of the
served layout (new values) must run through the graph already compiled and give its own logits; one of another
structure, dtype or stride must be refused with a ValueError naming the difference, by `Engine.update_params`
and by `ModelRunner.set_model`.
"""

from __future__ import annotations

import pytest
import torch

from astrai.configs.models import tiny
from astrai.inference.cache import init_kv_cache, make_attn_meta
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.layout import layout_difference
from astrai.inference.step import SERVED_STEP_OPTIONS, compile_step, decode_step, without_param_guards
from astrai.io.model import Model
from astrai.models.decoder import init_params
from astrai.nn.lora import LoRAConfig, apply_lora, init_lora
from astrai.tree import cast, replace, tree_map


def _decode_inputs(cfg):
    cache = init_kv_cache(cfg, 16, 4, dtype=torch.float32, device="cpu")
    meta = make_attn_meta([[1, 2]], [5], [1], page_size=4, device="cpu", decode=True, rows=1, width=2)
    return torch.tensor([7]), meta, cache


def test_the_filter_drops_exactly_the_parameter_guards():
    cfg = tiny(vocab_size=97)
    seen, kept = [], []

    def spy(entries):  # every guard Dynamo built, and the filter's verdict on each
        keep = without_param_guards(entries)
        seen.extend((e.name, e.guard_type) for e in entries)
        kept.extend(e.name for e, k in zip(entries, keep, strict=True) if k)
        return keep

    step = compile_step(decode_step, cfg=cfg, options={"guard_filter_fn": spy})
    with torch.inference_mode():
        step(init_params(cfg, seed=0), *_decode_inputs(cfg))
    on_params = [n for n, _ in seen if n.startswith(("params", "type(params"))]
    assert len(on_params) > 50 and any(g == "TENSOR_MATCH" for n, g in seen if n.startswith("params."))
    assert not any(n.startswith(("params", "type(params")) for n in kept)
    # everything else stays: the metadata, the cache, the config and the globals
    assert any(n.startswith("meta.") for n in kept) and any(n.startswith("cache.") for n in kept)
    assert any(n.startswith("cfg.") for n in kept) and len(kept) == len(seen) - len(on_params)


def test_a_tree_of_the_served_layout_runs_the_compiled_graph_with_its_own_values():
    cfg = tiny(vocab_size=97)
    a, b = init_params(cfg, seed=0), init_params(cfg, seed=1)
    step = compile_step(decode_step, cfg=cfg, options=SERVED_STEP_OPTIONS)
    tokens, meta, cache = _decode_inputs(cfg)
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        got_a = step(a, tokens, meta, cache)
        got_b = step(b, tokens, meta, cache)
        ref_b = decode_step(b, tokens, meta, cache, cfg=cfg)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompile for new tensors
    assert (got_b - ref_b).abs().max() <= 1e-5 and not torch.allclose(got_a, got_b)


def test_the_served_steps_drop_the_wrappers_size_asserts():
    # inductor's wrapper asserts every input's size and stride per call unless told not to; the served options
    # turn that off (the engine checks the parameters, Dynamo's guards the rest). Against vacuity: the captured
    # source is the wrapper (its `call`, with the attention op and the graph inputs unpacked), and the step's
    # logits are the eager forward's.
    from torch._inductor.utils import run_and_get_code

    cfg = tiny(vocab_size=97)
    params, (tokens, meta, cache) = init_params(cfg, seed=0), _decode_inputs(cfg)
    with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
        step = compile_step(decode_step, cfg=cfg, options=SERVED_STEP_OPTIONS)
        out, source = run_and_get_code(step, params, tokens, meta, cache)
        assert (out - decode_step(params, tokens, meta, cache, cfg=cfg)).abs().max() <= 1e-5
    code = "\n".join(source)
    assert "def call(" in code and "arg0_1" in code
    assert "assert_size_stride(" not in code and "assert_alignment(" not in code


def test_trees_of_another_layout_are_refused_by_name():
    cfg = tiny(vocab_size=97)
    params = init_params(cfg, seed=0)
    assert layout_difference(params, init_params(cfg, seed=3)) is None
    assert "float16" in layout_difference(params, cast(params, torch.float16))
    w = params.blocks[0].attn.o_proj.weight
    strided = torch.empty(w.shape[::-1]).t().copy_(w)  # same shape and values, column-major
    o_proj = replace(params.blocks[0].attn.o_proj, weight=strided)
    other = replace(params, blocks=(replace(params.blocks[0], attn=replace(params.blocks[0].attn, o_proj=o_proj)),
                                    *params.blocks[1:]))  # fmt: skip
    assert "stride" in layout_difference(params, other)
    lora = apply_lora(params, init_lora(params, LoRAConfig(r=2), seed=0))
    assert "structure" in layout_difference(params, lora)
    model = Model(config=cfg, params=params, tokenizer=None, eos_token_ids=())
    with Engine(model, EngineConfig(background=False, compile=False, kv_budget_tokens=256)) as engine:
        for bad, word in ((cast(params, torch.float16), "float16"), (other, "stride"), (lora, "structure")):
            with pytest.raises(ValueError, match=word):
                engine.update_params(bad)
            with pytest.raises(ValueError, match=word):
                engine.runner.set_model(Model(config=cfg, params=bad, tokenizer=None, eos_token_ids=()))
        engine.update_params(tree_map(lambda t: t * 2, params))  # the served layout: taken

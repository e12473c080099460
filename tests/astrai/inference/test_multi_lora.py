"""Multi-LoRA serving (issue 44): one step mixes the base model and several adapters, each row exact.

References: the model with each adapter merged (`merge_lora`, an independent path: the adapter folded into the
weights in fp32) run on the same inputs; PEFT's own `PeftModel` in test_multi_lora_peft.py. Negative controls:
every adapter moves its rows' logits far past the tolerance, so a dropped or misrouted adapter fails.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from astrai.inference.cache import init_kv_cache, logits_rows, make_attn_meta
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.inference.step import LoRARows, compile_step, decode_step, prefill_step
from astrai.io.lora import save_lora
from astrai.io.model import load
from astrai.nn.lora import LoRAConfig, merge_lora
from astrai.nn.lora_slots import with_lora_slots, write_slot
from helpers import random_lora, tiny_model_dir

TOL = 1e-5
ADAPTERS = {  # four ranks, different targets
    "r2": LoRAConfig(r=2, alpha=4, targets=("q_proj", "v_proj")),
    "r4": LoRAConfig(r=4, alpha=8, targets="all-linear"),
    "r8": LoRAConfig(r=8, alpha=8, targets=("gate_proj", "up_proj", "down_proj")),
    "r16": LoRAConfig(r=16, alpha=32, targets=("k_proj", "o_proj", "down_proj")),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(tiny_model_dir(tmp_path_factory.mktemp("base")))


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    """name -> (adapter tree, config, PEFT folder)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        lora = random_lora(model.params, cfg, seed=i + 1)
        out[name] = (lora, cfg, str(save_lora(lora, cfg, root / name)))
    return out


def merged(model, adapters, name):
    return model if name is None else attrs.evolve(model, params=merge_lora(model.params, adapters[name][0]))


# ---- the step functions: a batch of base + 4 adapters, prefill then decode, eager and compiled -----------------

PROMPTS = [[5, 9, 14, 3, 8, 2, 7], [11, 4, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 17], [7, 7, 7, 7, 7]]
NAMES = [None, "r2", "r4", "r8", "r16"]
SLOTS = [-1, 3, 0, 2, 1]  # shuffled: a slot index mix-up routes a row to another adapter


def _run_steps(prefill, decode, params, cfg, slots=None, next_tokens=None):
    """Prefill every prompt in one ragged step, then decode one token each; logits of both steps."""
    cache = init_kv_cache(cfg, 64, 4, dtype=torch.float32, device="cpu")
    pages = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(PROMPTS))]
    lens = [len(p) for p in PROMPTS]
    meta = make_attn_meta(pages, [0] * len(lens), lens, page_size=4, device="cpu")
    kw = {}
    if slots is not None:
        seg = torch.tensor(slots)
        kw = {"lora": LoRARows(torch.repeat_interleave(seg, torch.tensor(lens)), meta.cu_seqlens_q.long(), seg)}
    first = prefill(params, torch.tensor(sum(PROMPTS, [])), meta, cache, logits_rows(meta), **kw)
    tokens = first.argmax(-1) if next_tokens is None else next_tokens
    meta = make_attn_meta(pages, lens, [1] * len(lens), page_size=4, device="cpu", decode=True)
    kw = {} if slots is None else {"lora": LoRARows(torch.tensor(slots))}
    return first, decode(params, tokens, meta, cache, **kw), tokens


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mixed_batch_rows_equal_their_merged_models(model, adapters, compiled):
    cfg = model.config
    served = with_lora_slots(model.params, max_loras=4, max_rank=16)
    for name, slot in zip(NAMES, SLOTS, strict=True):
        if name is not None:
            write_slot(served, slot, adapters[name][0], adapters[name][1].scaling)
    eager = (lambda *a, **k: prefill_step(*a, cfg=cfg, **k)), (lambda *a, **k: decode_step(*a, cfg=cfg, **k))
    prefill, decode = (compile_step(prefill_step, cfg=cfg), compile_step(decode_step, cfg=cfg)) if compiled else eager
    first, second, tokens = _run_steps(prefill, decode, served, cfg, SLOTS)
    base_first, base_second, _ = _run_steps(*eager, model.params, cfg, next_tokens=tokens)
    for row, name in enumerate(NAMES):
        ref_first, ref_second, _ = _run_steps(*eager, merged(model, adapters, name).params, cfg, next_tokens=tokens)
        torch.testing.assert_close(first[row], ref_first[row], atol=TOL, rtol=0, msg=f"prefill row {row} ({name})")
        torch.testing.assert_close(second[row], ref_second[row], atol=TOL, rtol=0, msg=f"decode row {row} ({name})")
        if name is not None:  # negative control: the adapter matters
            assert (first[row] - base_first[row]).abs().max() > 100 * TOL
            assert (second[row] - base_second[row]).abs().max() > 100 * TOL
    if compiled:  # a new mix of adapters over the same shapes must not recompile
        with torch._dynamo.config.patch(error_on_recompile=True):
            _run_steps(prefill, decode, served, cfg, [2, -1, 1, 3, 0], next_tokens=tokens)


# ---- the engine ---------------------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TEXTS = ["hello world", "the quick brown fox", "lazy dog", "this is a tiny corpus"]


def lora_engine(model, adapters, names=("r2", "r4", "r8", "r16"), **config):
    options = {"compile": False, "kv_budget_tokens": 2048, "page_size": 16, "seed": 0, "enable_lora": True,
               "max_loras": 4, "max_lora_rank": 16, **config}  # fmt: skip
    engine = Engine(model, EngineConfig(**options))
    for name in names:
        engine.load_lora(name, adapters[name][2])
    return engine


def reference(model, adapters, name, prompts=TEXTS, params=GREEDY):
    with Engine(merged(model, adapters, name), EngineConfig(compile=False, kv_budget_tokens=2048)) as engine:
        return [c.outputs[0].token_ids for c in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def refs(model, adapters):
    return {name: reference(model, adapters, name) for name in [None, *ADAPTERS]}


def test_engine_mixes_adapters_in_one_batch_as_each_alone(model, adapters, refs):
    names = [None, "r2", "r4", "r8", "r16"] * 4
    prompts = [TEXTS[i % len(TEXTS)] for i in range(len(names))]
    with lora_engine(model, adapters) as engine:
        outs = engine.generate(prompts, GREEDY, lora=names)
        assert engine.stats().lora_loaded == 4
        assert engine.pool.num_used == engine.radix.num_cached_pages  # every running page was given back
        assert sum(engine.adapters.slot_users) == 0
    for i, (out, name) in enumerate(zip(outs, names, strict=True)):
        assert out.outputs[0].token_ids == refs[name][i % len(TEXTS)], (i, name)
    assert len({refs[name][0] for name in refs}) == len(refs)  # negative control: every adapter changes the text


def test_prefix_cache_is_keyed_by_adapter(model, adapters):
    prompt = list(range(3, 3 + 40))  # two full 16-token pages
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with lora_engine(model, adapters, background=False) as engine:
        cached = [engine.generate([prompt], params, lora=name)[0].cached_tokens for name in ["r2", "r4", "r2", None]]
        assert cached == [0, 0, 32, 0], cached  # r4 and the base never read r2's K/V; r2 again hits
        # a later adapter loaded under the same name is another adapter: its requests miss the old one's pages
        engine.unload_lora("r2")
        engine.load_lora("r2", adapters["r8"][2])
        again = engine.generate([prompt], params, lora="r2")[0]
        assert again.cached_tokens == 0
        assert again.outputs[0].token_ids == tuple(reference(model, adapters, "r8", [prompt], params)[0])


def test_requests_wait_for_a_slot_and_then_complete(model, adapters, refs):
    names = ["r2", "r4", None, "r8", "r2", "r16"]
    with lora_engine(model, adapters, max_loras=1, background=False) as engine:
        handles = [engine.submit(TEXTS[i % len(TEXTS)], GREEDY, lora=n) for i, n in enumerate(names)]
        waited = False
        while engine.step():
            stats = engine.stats()
            assert len(stats.lora_running) <= 1  # one slot: never two adapters at once
            waited |= bool(stats.lora_waiting) and bool(stats.lora_running)
        outs = [h.result() for h in handles]
    assert waited, "no request ever waited for a slot: the test did not exercise slot exhaustion"
    for i, (out, name) in enumerate(zip(outs, names, strict=True)):
        assert out.outputs[0].token_ids == refs[name][i % len(TEXTS)], (i, name)


def test_unloading_finishes_running_requests_and_refuses_new_ones(model, adapters, refs):
    from astrai.inference.engine import LoRANotFoundError

    with lora_engine(model, adapters, background=False) as engine:
        handle = engine.submit(TEXTS[0], GREEDY, lora="r4")
        engine.step()  # admitted: holds the slot
        engine.unload_lora("r4")
        assert "r4" not in engine.loras()
        with pytest.raises(LoRANotFoundError, match="r4"):
            engine.submit(TEXTS[0], GREEDY, lora="r4")
        assert handle.result().outputs[0].token_ids == refs["r4"][0]
        adapter = next(a for a in engine.adapters.slot_owner if a is not None and a.name == "r4")
        assert adapter.lora is None and adapter.pins == 0  # its host copy went with its last request
        assert engine.generate([TEXTS[1]], GREEDY)[0].outputs[0].token_ids == refs[None][1]  # the engine goes on


def test_host_cache_reads_a_pushed_out_adapter_again(model, adapters, refs):
    with lora_engine(model, adapters, max_loras=1, max_cpu_loras=1, background=False) as engine:
        first = engine.adapters.names["r2"]
        assert first.lora is None  # three later loads pushed it out of a one-adapter host cache
        assert engine.generate([TEXTS[0]], GREEDY, lora="r2")[0].outputs[0].token_ids == refs["r2"][0]


def test_generate_takes_adapter_folders_per_prompt(model, adapters):
    import astrai

    folders = [adapters["r8"][2], None, adapters["r2"][2]]
    params = SamplingParams(max_tokens=10, temperature=0.0)  # astrai.generate's defaults, EOS ends a completion
    expected = []
    for i, name in enumerate(["r8", None, "r2"]):
        with Engine(merged(model, adapters, name), EngineConfig(compile=False, kv_budget_tokens=2048)) as engine:
            expected.append(engine.generate([TEXTS[i]], params)[0].outputs[0].text)
    assert astrai.generate(model, TEXTS[:3], max_tokens=10, lora=folders) == expected
    assert astrai.generate(model, TEXTS[:1], max_tokens=10) == [
        astrai.generate(merged(model, adapters, None), TEXTS[:1], max_tokens=10)[0]
    ]  # the base, same engine
    with pytest.raises(ValueError, match="one folder"):
        astrai.generate(model, TEXTS[:3], lora=folders[:2])


def test_decode_graph_buffers_carry_each_rows_slot(model, adapters, refs):
    """The CUDA-graph path (called directly on CPU): each row's slot lives in a buffer of its own; a smaller batch
    after a larger one must not read the slots the larger one left behind, and base-only steps read -1."""
    names = ["r16", "r2", None, "r4", "r8", "r2", None, "r16"]
    with lora_engine(model, adapters, background=False, max_running=8) as engine:
        runner = engine.runner
        runner.graphs = runner.make_decode_graphs(capture=False)
        sizes = []
        run = runner.graphs.run
        runner.graphs.run = lambda tokens, meta, *lora: sizes.append(tokens.shape[0]) or run(tokens, meta, *lora)
        handles = [engine.submit(TEXTS[i % 4], GREEDY, lora=n) for i, n in enumerate(names)]
        for _ in range(4):
            engine.step()
        late = [engine.submit(TEXTS[1], GREEDY, lora=n) for n in ("r8", None)]  # join a shrinking batch
        outs = [h.result() for h in handles + late]
    assert len(set(sizes)) >= 2 and sizes != sorted(sizes)  # smaller batches after larger ones
    for i, (out, name) in enumerate(zip(outs, [*names, "r8", None], strict=True)):
        assert out.outputs[0].token_ids == refs[name][i % 4 if i < len(names) else 1], (i, name)

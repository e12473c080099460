"""ops.packed_linear: oneDNN packs of CPU weights, used by ops.linear eagerly and inside compiled graphs."""

import gc
import logging

import pytest
import torch
import torch.nn.functional as F

from astrai.cpu_kernels import matvec as cpu_matvec
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.inference.runner import pack_cpu_weights
from astrai.io.model import load
from astrai.models.decoder import projection_groups, projection_weights
from astrai.ops import packed_linear as packed
from astrai.ops.linear import MAX_REDUCE_ROWS, SMALL_WEIGHT_BYTES, linear, linears
from helpers import TOLERANCES, assert_close, save_hf, tiny_hf_model

pytestmark = pytest.mark.skipif(not packed.AVAILABLE, reason="this torch build has no oneDNN linear")


def _swap_pack(weight, stand_in):
    """Make `weight`'s pack hold `stand_in` instead: an output that follows it proves the pack was used."""
    packed._store([weight], torch.ops.mkldnn._reorder_linear_weight(stand_in))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_product_equals_f_linear_eager_and_compiled(dtype):
    weight, bias = torch.randn(48, 40).to(dtype), torch.randn(48).to(dtype)
    # bf16 packs only where oneDNN's bf16 path runs (AVX512-BW/VL/DQ); elsewhere (an AVX2 CPU) packing it raised,
    # and every bf16 engine failed to start: there it is left unpacked and the products still equal F.linear
    packs = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (dtype in packed.PACKABLE_DTYPES) == packs
    assert packed.pack_weights([weight]) == (weight.nbytes if packs else 0) and packed.is_packed(weight) == packs
    atol, rtol = TOLERANCES[dtype]
    torch._dynamo.reset()
    compiled = torch.compile(linear, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        for shape in [(1, 40), (MAX_REDUCE_ROWS + 8, 40), (3, 7, 40)]:
            x = torch.randn(shape).to(dtype)
            for b in (None, bias):
                expected = F.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
                for name, fn in (("eager", linear), ("compiled", compiled)):
                    out = fn(x, weight, b)
                    assert out.shape == (*shape[:-1], 48) and out.dtype == dtype
                    assert_close(out, expected, atol=atol * 10, rtol=rtol, msg=f"{name} {shape} bias={b is not None}")


def test_the_pack_is_what_runs_eagerly_and_compiled():
    weight, x = torch.randn(32, 24), torch.randn(MAX_REDUCE_ROWS + 4, 24)
    packed.pack_weights([weight])
    _swap_pack(weight, 2 * weight)  # negative control: a product through F.linear would not double
    torch._dynamo.reset()
    compiled = torch.compile(linear, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        assert_close(linear(x, weight), 2 * F.linear(x, weight), atol=1e-4)
        assert_close(compiled(x, weight), 2 * F.linear(x, weight), atol=1e-4)
        # few rows under compile keep the multiply + row-sum loop, which reads the weight itself
        assert_close(compiled(x[:2], weight), F.linear(x[:2], weight), atol=1e-4)


def test_a_weight_changed_in_place_is_repacked_and_an_unpacked_one_runs_f_linear():
    weight, x = torch.randn(32, 24), torch.randn(20, 24)
    packed.pack_weights([weight])
    with torch.no_grad():
        weight.mul_(-3.0)
    with torch.inference_mode():
        assert_close(linear(x, weight), F.linear(x, weight), atol=1e-4)
        other = torch.randn(32, 24)
        assert not packed.is_packed(other)
        assert torch.equal(linear(x, other), F.linear(x, other))


def test_packs_are_released_with_their_weights():
    weight = torch.randn(64, 64)
    gc.collect()  # packs of earlier tests' garbage would otherwise be released below too
    before = packed.packed_bytes()
    packed.pack_weights([weight])
    assert packed.packed_bytes() == before + weight.nbytes
    del weight
    gc.collect()
    assert packed.packed_bytes() == before


def test_weights_made_under_inference_mode_pack():
    # a model loaded inside torch.inference_mode holds inference tensors, which have no version counter
    with torch.inference_mode():
        weight, x = torch.randn(24, 16), torch.randn(12, 16)
    packed.pack_weights([weight])
    assert_close(packed.run_packed(x, weight, None), F.linear(x, weight), atol=1e-5)
    with torch.inference_mode():
        weight.mul_(2)  # untracked: the pack is stale until repacked
        packed.repack([weight])
    assert_close(packed.run_packed(x, weight, None), F.linear(x, weight), atol=1e-5)


def test_gradients_and_autocast_bypass_the_pack():
    weight = torch.randn(16, 8)
    packed.pack_weights([weight])
    _swap_pack(weight, torch.zeros_like(weight))  # the pack would give zeros
    x = torch.randn(12, 8, requires_grad=True)
    out = linear(x, weight)
    out.sum().backward()
    assert_close(out, F.linear(x, weight), atol=1e-5)
    assert_close(x.grad, weight.sum(0).expand(12, 8), atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert linear(x, weight).dtype == torch.bfloat16  # autocast's own product, not the fp32 pack
    assert not packed.packable(torch.randn(4, 4, requires_grad=True))
    assert not packed.packable(torch.randn(4, 4).to(torch.int8))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_group_pack_runs_q_k_v_as_one_product(compiled):
    weights = [torch.randn(out, 24) for out in (32, 8, 8)]
    biases = [torch.randn(32), None, torch.randn(8)]
    x = torch.randn(MAX_REDUCE_ROWS + 4, 24)
    expected = [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    torch._dynamo.reset()
    fn = torch.compile(linears, fullgraph=True, dynamic=False) if compiled else linears
    with torch.inference_mode():
        unpacked = fn(x, weights, biases)  # no pack: one product each
        assert packed.pack_group(weights) == sum(w.nbytes for w in weights) and packed.is_group_packed(weights)
        assert not packed.is_group_packed(weights[:2]) and not packed.is_group_packed(weights[::-1])
        outs = fn(x, weights, biases)
        for got, ungrouped, want in zip(outs, unpacked, expected, strict=True):
            assert_close(got, want, atol=1e-4)
            assert_close(ungrouped, want, atol=1e-4)
        # negative control: the group's pack is what runs (a pack of doubled weights doubles the products)
        packed._store(weights, torch.ops.mkldnn._reorder_linear_weight(2 * torch.cat(weights)))
        outs = fn(x, weights, [None] * 3)
        for got, w in zip(outs, weights, strict=True):
            assert_close(got, 2 * F.linear(x, w), atol=1e-4)
        with torch.no_grad():  # changed in place: repacked on use
            weights[1].mul_(-1)
        assert_close(fn(x, weights, biases)[1], F.linear(x, weights[1]), atol=1e-4)


def test_projection_groups_cover_every_projection_and_the_tied_head(tmp_path):
    tied = load(save_hf(tiny_hf_model("qwen2", tie_word_embeddings=True), tmp_path / "tied"))
    untied = load(save_hf(tiny_hf_model("qwen2", tie_word_embeddings=False), tmp_path / "untied"))
    layers = tied.config.num_hidden_layers
    for model, head in ((tied, tied.params.embed_tokens.weight), (untied, untied.params.lm_head.weight)):
        groups = projection_groups(model.params)
        assert [len(g) for g in groups] == [3, 1, 2, 1] * layers + [1] and groups[-1][0] is head
        block = model.params.blocks[0]
        assert groups[0] == (block.attn.q_proj.weight, block.attn.k_proj.weight, block.attn.v_proj.weight)
        assert groups[2] == (block.mlp.gate_proj.weight, block.mlp.up_proj.weight)
    assert not any(w is untied.params.embed_tokens.weight for w in projection_weights(untied.params))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(save_hf(tiny_hf_model("qwen2", max_position_embeddings=256), tmp_path_factory.mktemp("m")))


def _greedy(engine, prompts):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
    return [(c.outputs[0].token_ids, c.outputs[0].logprobs) for c in engine.generate(prompts, params)]


def test_engine_with_packed_weights_equals_the_unpacked_engine(model):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (int(n),), generator=gen).tolist() for n in torch.randint(3, 40, (16,))]
    runs = {}
    for pack in (False, True):
        with Engine(model, EngineConfig(max_running=16, background=False, pack_weights=pack)) as engine:
            runs[pack] = _greedy(engine, prompts)
    assert all(packed.is_group_packed(g) for g in projection_groups(model.params))
    for (ids_off, lp_off), (ids_on, lp_on) in zip(runs[False], runs[True], strict=True):
        assert ids_on == ids_off
        assert_close(torch.tensor(lp_on), torch.tensor(lp_off), atol=1e-4)


def test_the_engine_serves_new_weights_through_new_packs(model, tmp_path):
    other = load(save_hf(tiny_hf_model("qwen2", seed=5, max_position_embeddings=256), tmp_path))
    prompts = [[5, 6, 7, 8], list(range(1, 30))] * 8
    with Engine(other, EngineConfig(max_running=16, background=False, pack_weights=False)) as engine:
        expected = _greedy(engine, prompts)
    with Engine(model, EngineConfig(max_running=16, background=False)) as engine:
        _greedy(engine, prompts)
        engine.update_params(other.params)
        assert all(packed.is_group_packed(g) for g in projection_groups(other.params))
        assert [ids for ids, _ in _greedy(engine, prompts)] == [ids for ids, _ in expected]
        # changed behind the pack's back (`.data` shares no version counter): update_params() repacks
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for w in projection_weights(other.params):
                w.data.copy_(torch.randn(w.shape, generator=gen) * 0.3)  # a different (and less flat) model
        engine.update_params()
        changed = _greedy(engine, prompts)
    with Engine(other, EngineConfig(max_running=16, background=False, pack_weights=False)) as engine:
        assert [ids for ids, _ in _greedy(engine, prompts)] == [ids for ids, _ in changed]
    assert [ids for ids, _ in changed] != [ids for ids, _ in expected]


def test_packing_is_skipped_with_a_warning_when_memory_is_short(tmp_path, monkeypatch, caplog):
    import astrai.inference.runner as runner

    fresh = load(save_hf(tiny_hf_model("qwen2", seed=7), tmp_path))
    monkeypatch.setattr(runner, "_available_memory", lambda: 1024)
    with caplog.at_level(logging.WARNING, logger="astrai.inference.runner"):
        assert not pack_cpu_weights(fresh)
    assert "not packing the CPU weights" in caplog.text
    assert not any(packed.is_group_packed(g) for g in projection_groups(fresh.params))


def test_few_rows_of_a_small_weight_keep_the_loop_and_of_a_large_one_take_the_pack():
    """Compiled fp32 products of 4-8 rows take the pack for weights above `SMALL_WEIGHT_BYTES` and inductor's loop
    below it (a tiny model's verify rows: the pack's call cost more than its product); the swapped pack tells which
    ran. On an AVX-512 CPU the large weight takes the matvec kernel's blocked form instead (up to
    `F32_KERNEL_MAX_ROWS`), which reads the weight itself: the product comes out unswapped."""
    rows = MAX_REDUCE_ROWS - 3
    kernel = cpu_matvec.supports(torch.float32)
    for side, large in ((64, False), (384, True)):  # 16 KiB; 576 KiB > SMALL_WEIGHT_BYTES
        assert (side * side * 4 > SMALL_WEIGHT_BYTES) == large
        uses_pack = large and not kernel
        weight, x = torch.randn(side, side), torch.randn(rows, side)
        packed.pack_weights([weight])
        _swap_pack(weight, 2 * weight)
        torch._dynamo.reset()
        compiled = torch.compile(linear, fullgraph=True, dynamic=False)
        with torch.inference_mode():
            expected = (2 if uses_pack else 1) * F.linear(x, weight)
            assert_close(compiled(x, weight), expected, atol=1e-3, rtol=1e-4, msg=f"{side}x{side}")

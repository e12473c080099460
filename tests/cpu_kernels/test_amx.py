"""cpu_kernels/amx.c: the AMX tile kernel of batched bf16 products equals torch's fp32 product, is what the matvec op
runs from AMX_MIN_ROWS rows, and is what compiled batched decode calls (up to `ops.linear.AMX_MAX_ROWS` rows).

Skipped on CPUs without AMX (or whose OS does not grant its tile state); on a CPU whose flags list amx_bf16 the
kernel must be ready, so a box with AMX cannot pass by silently running the row kernel.
"""

import types

import pytest
import torch
import torch.nn.functional as F

from astrai.cpu_kernels import library
from astrai.cpu_kernels import matvec as cpu_matvec
from astrai.inference.runner import ModelRunner
from astrai.ops import linear as ops_linear
from astrai.ops.linear import AMX_MAX_ROWS, F32_KERNEL_MAX_ROWS, MAX_REDUCE_ROWS, kernel_rows, linears
from helpers import assert_close
from tests.cpu_kernels.test_matvec import _cpu_flags, call_kernel

AMX_MIN_ROWS = 2  # matvec.c's: the op's entry takes the tiles from this many rows


def _needs_amx() -> None:
    if not cpu_matvec.supports(torch.bfloat16) or not library.load().features & library.AMX:
        pytest.skip("this CPU (or its OS) has no AMX tiles for bf16")


def _direct(name: str, x: torch.Tensor, weights: list[torch.Tensor], threads: int = 2) -> tuple[int, torch.Tensor]:
    """amx.c's entry (`astrai_amx_bf16`) or the row kernel's (`astrai_matvec_bf16_rows`) called directly."""
    return call_kernel(name, x, weights, threads)


def _bound(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    # exact bf16 products, fp32 sums: the rounding error grows with the sum of |x w|
    return 1e-6 * (x.double().abs() @ torch.cat(weights).double().abs().T) + 1e-30


def test_amx_is_ready_where_the_cpu_lists_it():
    if "amx_bf16" not in _cpu_flags() or not cpu_matvec.supports(torch.bfloat16):
        pytest.skip("this CPU does not list amx_bf16")
    assert library.load().features & library.AMX  # the OS granted the tile state to this process
    assert cpu_matvec.amx()


@pytest.mark.parametrize("rows", [2, 5, 16, 17, 40, 64, 65, 130])
@pytest.mark.parametrize("k", [32, 62, 576, 1000])
def test_tiles_match_the_fp32_product(rows, k):
    # every tail: x blocks of 16 rows with 1-15 left, more than 64 rows (two and three passes), K not a multiple of
    # 32 (62, 1000: a zero-padded last step), weights of 7 and 200 rows (a short tile of 7 and of 8), three of them
    # sharing x as q/k/v do
    _needs_amx()
    gen = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weights = [torch.randn(n, k, generator=gen).bfloat16() for n in (7, 200, 16)]
    status, out = _direct("astrai_amx_bf16", x, weights)
    expected = x.double() @ torch.cat(weights).double().T
    assert status == 0
    assert ((out.double() - expected).abs() <= _bound(x, weights)).all()  # and no NaN: every output written
    # negative control: the weights' order decides where each one's columns land
    _, swapped = _direct("astrai_amx_bf16", x, weights[::-1])
    assert not torch.allclose(swapped, out)
    assert torch.equal(swapped[:, :16], out[:, 207:])


def test_the_op_runs_the_tiles_from_their_bound_and_the_row_kernel_below():
    _needs_amx()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 576, generator=gen).bfloat16() for n in (320, 64)]
    for rows in (1, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, 16, 64, 80):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        _, tiles = _direct("astrai_amx_bf16", x, weights)
        _, row_kernel = _direct("astrai_matvec_bf16_rows", x, weights)
        out = cpu_matvec.matvec(x, weights)
        # the two kernels sum in different orders, so their results differ in the last bits: which one ran shows
        assert not torch.equal(tiles, row_kernel)
        assert torch.equal(out, tiles if rows >= AMX_MIN_ROWS else row_kernel), rows
        assert_close(out, cpu_matvec.matvec_ref(x, weights), atol=1e-4 * 576**0.5, rtol=1e-5)


def test_odd_widths_and_one_thread_fall_back_or_agree():
    _needs_amx()
    x, weight = torch.randn(20, 33).bfloat16(), torch.randn(50, 33).bfloat16()
    status, _ = _direct("astrai_amx_bf16", x, [weight])
    assert status == -1  # an odd K has no 32-bit pairs: the op's entry runs the row kernel instead
    assert_close(cpu_matvec.matvec(x, [weight]), cpu_matvec.matvec_ref(x, [weight]), atol=1e-4, rtol=1e-5)
    # each output is one tile's sum on one thread, whichever thread: the split cannot change a bit
    x, weight = torch.randn(40, 320).bfloat16(), torch.randn(517, 320).bfloat16()
    assert torch.equal(_direct("astrai_amx_bf16", x, [weight], 1)[1], _direct("astrai_amx_bf16", x, [weight], 2)[1])


@pytest.mark.parametrize("rows", [MAX_REDUCE_ROWS + 1, 40, AMX_MAX_ROWS, AMX_MAX_ROWS + 1])
def test_compiled_batched_bf16_products_take_the_tiles_up_to_their_bound(rows, monkeypatch):
    _needs_amx()
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(ops_linear, "SMALL_WEIGHT_BYTES", 0)  # these test weights are small
    x = torch.randn(rows, 64).bfloat16()
    weights = [torch.randn(n, 64).bfloat16() for n in (64, 16, 16)]
    biases = [torch.randn(64).bfloat16(), None, torch.randn(16).bfloat16()]
    torch._dynamo.reset()
    outs, (code,) = run_and_get_code(torch.compile(linears, fullgraph=True), x, weights, biases)
    calls = code.count("torch.ops.astrai.cpu_matvec.default(")
    assert calls == (1 if rows <= AMX_MAX_ROWS else 0)  # q/k/v in one call; past the bound, oneDNN's pack
    for out, w, b in zip(outs, weights, biases, strict=True):
        expected = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert_close(out, expected.bfloat16(), atol=2e-2)
    # negative control: with the tiles off (ASTRAI_CPU_AMX=0), these rows leave the kernel
    monkeypatch.setattr(cpu_matvec, "amx", lambda: False)
    torch._dynamo.reset()
    _, (code,) = run_and_get_code(torch.compile(linears, fullgraph=True), x, weights, biases)
    assert "cpu_matvec.default(" not in code


def test_the_runner_warms_and_pads_past_the_tiles_bound():
    # a compiled CPU step specialises on the row bounds of `ops.linear`: the decode warm-up covers the graph past
    # AMX_MAX_ROWS, and a compiled prefill step pads to past it, so one prefill graph serves every size
    _needs_amx()
    assert kernel_rows(torch.bfloat16) == AMX_MAX_ROWS and kernel_rows(torch.float32) == F32_KERNEL_MAX_ROWS
    runner = types.SimpleNamespace(device=torch.device("cpu"), model=types.SimpleNamespace(dtype=torch.bfloat16),
                                   max_running=128)  # fmt: skip
    assert ModelRunner.prefill_min_rows(runner) == AMX_MAX_ROWS + 1
    assert AMX_MAX_ROWS + 1 in ModelRunner.decode_warm_sizes(runner)
    runner.model.dtype = torch.float32  # negative control: fp32 has no tiles; its blocked kernel's bound instead
    assert ModelRunner.prefill_min_rows(runner) == F32_KERNEL_MAX_ROWS + 1
    sizes = ModelRunner.decode_warm_sizes(runner)
    assert AMX_MAX_ROWS + 1 not in sizes and F32_KERNEL_MAX_ROWS + 1 in sizes


@pytest.mark.slow
def test_a_batched_bf16_engine_decodes_through_the_tiles(tmp_path, monkeypatch):
    # the engine's compiled decode steps of 12 rows call the kernel (its tiles), and greedy text equals the same
    # engine's with the tiles off (oneDNN's packed GEMM): both multiply bf16 exactly and sum in fp32
    _needs_amx()
    import astrai
    from astrai.inference.engine import Engine, EngineConfig
    from astrai.inference.params import SamplingParams
    from helpers import save_hf, tiny_hf_model

    monkeypatch.setattr(ops_linear, "SMALL_WEIGHT_BYTES", 0)  # the tiny model's weights are small
    model = astrai.load(save_hf(tiny_hf_model("llama"), tmp_path), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (int(n),), generator=gen).tolist() for n in torch.randint(2, 30, (12,))]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run() -> tuple[list[list[int]], list[int]]:
        torch._dynamo.reset()
        with torch.profiler.profile(record_shapes=True) as profile:
            with Engine(model, EngineConfig(compile=True, kv_budget_tokens=2048, background=False)) as engine:
                out = [list(r.outputs[0].token_ids) for r in engine.generate(prompts, greedy)]
        calls = [e for e in profile.events() if e.name == "astrai::cpu_matvec" and e.input_shapes and e.input_shapes[0]]
        return out, [e.input_shapes[0][0] for e in calls]

    tiles, rows = run()
    assert 12 in rows  # the twelve requests' decode steps
    monkeypatch.setattr(cpu_matvec, "amx", lambda: False)
    packed, rows = run()
    assert 12 not in rows  # negative control: without the tiles, 12 rows go to oneDNN
    assert tiles == packed

"""int8 weight-only models: `quantize_params`, `astrai.load(..., quantize="int8")`, the CLIs' `--quantize`.

Two references. A model whose weights are already on the int8 grid (integer rows times a per-row scale:
`dequantize_params(quantize_params(p))`) quantizes exactly, so its quantized logits equal the float model's
to rounding and greedy text is identical, through `forward`, the compiled step and the engine. On plain random
weights the quantized logits stay within a stated tolerance of fp32, and differ from them (negative control).
The forward checks run with random non-zero biases on every projection that can carry one (`init_params` makes
them zero, which hides a bias scaled by the int8 scale), with the CPU kernels and as under `ASTRAI_CPU_KERNELS=0`,
and in bf16 on both sides of the kernel's row bound (past it the weight is widened, the branch CUDA takes).
Tensor-parallel shards of a quantized tree: tests/astrai/models/test_tp.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

import astrai
from astrai.cli.main import main
from astrai.io.model import Model, load, save
from astrai.models.decoder import forward, init_params
from astrai.models.quantize import dequantize_params, is_quantized, quantize_params
from astrai.nn.lora import LoRAConfig, apply_lora, init_lora
from astrai.ops.linear import INT8_EAGER_MAX_ROWS
from astrai.tree import named_tensors, nbytes
from helpers import cpu_kernels_off, random_biases, tiny_model_dir
from tests.astrai.models.tp_worker import configs, with_biases

FAMILIES = ["llama", "qwen3_moe", "qwen2_moe", "deepseek_v3"]  # tied head, MoE, shared expert, MLA


def on_grid(cfg, seed=0):
    """Float params every quantizable weight of which is exactly representable in int8 with a per-row scale, and
    whose biases (kept in float by quantization) are random where `cfg` has them."""
    params = dequantize_params(quantize_params(init_params(cfg, seed=seed)))
    return random_biases(params, seed=seed + 100) if cfg.attention_bias else params


@pytest.fixture(params=["kernels", "no_kernels"])
def kernels(request) -> Iterator[bool]:
    """Whether the CPU kernels may run: once as they are here, once as under `ASTRAI_CPU_KERNELS=0`."""
    if request.param == "kernels":
        yield True
    else:
        with cpu_kernels_off():
            yield False


@pytest.mark.parametrize("family", FAMILIES)
def test_on_grid_weights_give_the_float_logits(family, kernels):
    # 20 rows of fp32: the CPU kernel with the kernels, else the widened weight through F.linear
    cfg = with_biases(configs()[family])
    exact = on_grid(cfg)
    q = quantize_params(exact)
    assert torch.equal(dequantize_params(q).blocks[0].attn.o_proj.weight, exact.blocks[0].attn.o_proj.weight)
    assert q.blocks[0].attn.o_proj.bias.abs().min() > 0  # random, kept in float
    tokens = torch.randint(0, cfg.vocab_size, (2, 10))
    ref = forward(exact, cfg, tokens)
    assert (forward(q, cfg, tokens) - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("rows", [8, INT8_EAGER_MAX_ROWS[torch.bfloat16] + 8])
def test_bf16_int8_with_biases_on_both_sides_of_the_kernel_rows(rows, kernels):
    # a bf16 model: up to 24 rows the kernel (with the kernels), past them the widened weight in bf16. Reference:
    # the float model the quantized tree stands for (its dequantized weights and its biases), in fp32
    cfg = with_biases(configs()["llama"])
    q = quantize_params(astrai.tree.cast(random_biases(init_params(cfg, seed=4), seed=5), torch.bfloat16))
    tokens = torch.randint(0, cfg.vocab_size, (1, rows))
    ref = forward(astrai.tree.cast(dequantize_params(q), torch.float32), cfg, tokens)
    diff = (forward(q, cfg, tokens).float() - ref).abs().max().item()
    assert diff <= 2e-2 * max(1.0, ref.abs().max().item())  # bf16 activations


@pytest.mark.parametrize("family", FAMILIES)
def test_random_weights_stay_within_tolerance_and_differ(family):
    cfg = configs()[family]
    params = init_params(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10))
    ref, got = forward(params, cfg, tokens), forward(quantize_params(params), cfg, tokens)
    diff, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    # stated tolerance: 3% of the largest logit (measured 0.5-2.2% on these tiny random models)
    assert diff <= 0.03 * scale
    assert diff > 1e-4  # negative control: the weights really were rounded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
def test_compiled_decode_step_equals_eager(dtype, rows):
    # few rows: the compiled CPU step multiplies the int8 weights in the matvec kernel or inductor's loop
    # (astrai.ops.linear), the eager one in the kernel where it runs, else widened for F.linear
    from torch._inductor.utils import run_and_get_code

    from astrai.cpu_kernels import matvec
    from astrai.ops.linear import MIN_KERNEL_ROWS

    cfg = with_biases(configs()["qwen3_moe"])  # random biases: fp32's one row is the loop's own bias add
    q = quantize_params(astrai.tree.cast(random_biases(init_params(cfg, seed=2), seed=3), dtype))
    tokens = torch.randint(0, cfg.vocab_size, (rows, 1))
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, t: forward(p, cfg, t), fullgraph=False, dynamic=False)
    eager = forward(q, cfg, tokens)
    out, code = run_and_get_code(compiled, q, tokens)
    kernel = matvec.supports(dtype) and rows >= MIN_KERNEL_ROWS
    assert any("cpu_matvec.default(" in c for c in code) == kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: rounding of the activations between the two paths
    assert (out.float() - eager.float()).abs().max() <= tol * max(1.0, eager.abs().max().item())


def test_what_is_quantized_and_what_is_kept():
    cfg = configs()["deepseek_v3"]
    params = init_params(cfg)
    q = quantize_params(params)
    names = named_tensors(q)
    int8 = {n for n, t in names.items() if t.dtype == torch.int8}
    assert "embed_tokens.weight" in int8 and "blocks.0.attn.o_proj.weight" in int8
    assert "blocks.1.mlp.experts.gate_proj.weight" not in names and "blocks.1.mlp.experts.gate_proj" in int8
    kept = ["blocks.1.mlp.gate.weight", "blocks.0.attn.kv_b_proj.weight", "norm.weight", "blocks.0.attn_norm.weight"]
    assert not int8 & set(kept) and all(n in names for n in kept)
    assert nbytes(q) < 0.35 * nbytes(params)
    no_embed = quantize_params(params, embeddings=False)
    assert no_embed.embed_tokens.weight.dtype == torch.float32 and is_quantized(no_embed)
    untied = init_params(configs()["qwen3"])
    assert quantize_params(untied, embeddings=False).lm_head.scale is None
    assert quantize_params(untied).lm_head.weight.dtype == torch.int8


def test_refusals():
    cfg = configs()["qwen3"]
    params = init_params(cfg)
    q = quantize_params(params)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(q)
    with pytest.raises(ValueError, match="one of"):
        quantize_params(params, "int4")
    lora = LoRAConfig(r=2, alpha=4)
    with pytest.raises(ValueError, match="merge them"):
        quantize_params(apply_lora(params, init_lora(params, lora)))
    with pytest.raises(ValueError, match="QLoRA"):
        init_lora(q, lora)
    model = Model(config=cfg, params=q)
    with pytest.raises(ValueError, match="int8-quantized"):
        save(model, "/nonexistent/never/written")


@pytest.fixture(scope="module")
def on_grid_dir(tmp_path_factory):
    """A tiny model folder (with tokenizer) whose weights sit on the int8 grid."""
    folder = tiny_model_dir(tmp_path_factory.mktemp("q") / "src")
    model = load(folder)
    exact = Model(config=model.config, params=dequantize_params(quantize_params(model.params)),
                  tokenizer=model.tokenizer, eos_token_ids=model.eos_token_ids)  # fmt: skip
    return str(save(exact, tmp_path_factory.mktemp("q") / "grid"))


def test_load_quantized_generates_the_same_greedy_text(on_grid_dir):
    full, q = load(on_grid_dir), load(on_grid_dir, quantize="int8")
    assert q.quantization == "int8" and full.quantization is None
    assert q.dtype == torch.float32 and q.num_parameters == full.num_parameters
    assert "int8 weights" in repr(q) and q.nbytes < 0.35 * full.nbytes
    prompts = ["hello world", "the quick brown fox"]
    kw = dict(max_tokens=12, temperature=0.0, stop_token_ids=[])
    texts_q = astrai.generate(q, prompts, **kw)
    assert texts_q == astrai.generate(full, prompts, **kw)
    assert len(set(texts_q)) == 2 and all(texts_q)
    with pytest.raises(ValueError, match="quantize must be one of"):
        load(on_grid_dir, quantize="fp4")


def test_batched_int8_decode_through_the_kernel_matches_the_float_model(on_grid_dir):
    # 5, 12 and 24 rows decoding: the compiled int8 products take the matvec kernel at every row count (fp32: its
    # blocked GEMM from 22 rows, as the 96-token prefill does; astrai.ops.linear); the float model runs eagerly
    # through F.linear: independent paths, exact weights
    from torch.profiler import ProfilerActivity, profile

    from astrai.cpu_kernels import matvec
    from astrai.inference.engine import Engine, EngineConfig
    from astrai.inference.params import SamplingParams

    full, q = load(on_grid_dir), load(on_grid_dir, quantize="int8")
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)

    def run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
        handles = [engine.submit(p, params) for p in prompts]
        while engine.step():
            pass
        return [h.result().outputs[0].token_ids for h in handles]

    config = dict(background=False, max_running=24, prefix_cache=False)
    with Engine(q, EngineConfig(**config)) as engine, Engine(full, EngineConfig(compile=False, **config)) as eager:
        for n in (5, 12, 24):
            prompts = [torch.randint(3, q.config.vocab_size, (4,), generator=gen).tolist() for _ in range(n)]
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                tokens = run(engine, prompts)
            assert tokens == run(eager, prompts), n
            calls = [e.input_shapes for e in prof.events() if e.name == "astrai::cpu_matvec"]
            rows = {shapes[0][0] for shapes in calls if shapes and len(shapes[0]) == 2}  # x [rows, K]
            if matvec.supports(torch.float32):  # the decode steps' and the prefill's products went through the kernel
                assert {n, 4 * n} <= rows, (n, rows)


def test_cli_flags(on_grid_dir, capsys, tmp_path):
    main(["generate", on_grid_dir, "--prompt", "hello world", "--max-tokens", "6", "--quantize", "int8"])
    quantized = capsys.readouterr().out
    assert "weights: int8 weight-only" in quantized
    main(["generate", on_grid_dir, "--prompt", "hello world", "--max-tokens", "6"])
    plain = capsys.readouterr().out
    assert "int8" not in plain and plain.splitlines()[-1] == quantized.splitlines()[-1]
    main(["generate", on_grid_dir, "--prompt", "hello world", "--max-tokens", "6", "--quantization", "int8"])
    assert capsys.readouterr().out == quantized  # vLLM's spelling
    data = tmp_path / "t.jsonl"
    data.write_text('{"text": "the quick brown fox jumps over the lazy dog"}\n')
    main(["eval", "ppl", on_grid_dir, "--data", str(data), "--quantize", "int8"])
    ppl_q, err = capsys.readouterr()
    assert "weights: int8 weight-only" in err
    main(["eval", "ppl", on_grid_dir, "--data", str(data)])
    # the same report to rounding: exact weights, but the int8 product runs in another kernel (summation order)
    got, want = (json.loads(out.splitlines()[-1]) for out in (ppl_q, capsys.readouterr().out))
    assert got["tokens"] == want["tokens"] == 16 and got["ppl"] == pytest.approx(want["ppl"], rel=1e-6)
    with pytest.raises(SystemExit):
        main(["generate", on_grid_dir, "--prompt", "hi", "--quantize", "int4"])

"""The compiled prefill step (issue 16 item 1): the same tokens and log-probs as the eager step, under staggered
arrivals with chunked prefill, prefix-cache hits and mixed steps; and one graph for every prefill step."""

import functools

import attrs
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import astrai
from astrai.inference import runner as runner_module
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.inference.step import compile_step, prefill_step
from helpers import DEVICE, save_hf, tiny_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = tiny_hf_model("qwen2", max_position_embeddings=512)
    return astrai.load(save_hf(hf, tmp_path_factory.mktemp("m")), device=DEVICE)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 256, (24,), generator=gen).tolist()
    lengths = [5, 40, 3, 17, 1, 64, 2, 30, 9, 12]
    tails = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]
    return [shared + t if i % 3 == 2 else t for i, t in enumerate(tails)]  # every third one: a prefix hit


def _params(i: int) -> SamplingParams:
    # some requests stop after their prefill (steps with no decoding row), the others decode beside new prompts
    return SamplingParams(max_tokens=1 if i % 4 == 1 else 6, temperature=0.0, ignore_eos=True, logprobs=True,
                          top_logprobs=2)  # fmt: skip


def _run(model, prompts, *, compile: bool, setup=None):
    cfg = EngineConfig(compile=compile, compile_prefill=True, page_size=4, max_step_tokens=48, max_running=8,
                       kv_budget_tokens=4096, background=False)  # fmt: skip
    with Engine(model, cfg) as engine:
        if setup is not None:
            setup(engine.runner)
        handles = [engine.submit(prompts[0], _params(0))]
        engine.step()  # a step of one request and 5 tokens: padded to more requests and tokens
        handles += [engine.submit(p, _params(i + 1)) for i, p in enumerate(prompts[1:4])]
        for _ in range(3):  # the first prompts are mid-prefill or decoding when the next ones arrive
            engine.step()
        handles += [engine.submit(p, _params(i + 4)) for i, p in enumerate(prompts[4:])]
        return [h.result().outputs[0] for h in handles]


def _logprobs(out) -> list[float]:
    return [lp for lp in out.logprobs] + [alt for step in out.top_logprobs for _, alt in step]


def _spy(calls: list):
    def setup(runner):
        compiled = runner.compiled_prefill

        def spy(params, tokens, meta, cache, rows, **kwargs):
            calls.append((tokens.shape[0], int((meta.seq_lens == 0).sum()), rows.shape[0]))
            return compiled(params, tokens, meta, cache, rows, **kwargs)

        runner.compiled_prefill = spy

    return setup


def test_compiled_prefill_equals_eager(model, prompts):
    eager = _run(model, prompts, compile=False)
    calls = []
    compiled = _run(model, prompts, compile=True, setup=_spy(calls))
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    diff = max(abs(a - b) for c, e in zip(compiled, eager, strict=True) for a, b in zip(_logprobs(c), _logprobs(e),
                                                                                         strict=True))  # fmt: skip
    assert diff <= 1e-5, f"log-probs differ by {diff}"
    # not vacuous: the compiled step ran every prefill step, some of them padded (few tokens or one request)
    assert len(calls) >= 5
    assert all(t > runner_module.MAX_REDUCE_ROWS and r > runner_module.MAX_REDUCE_ROWS for t, _, r in calls)
    assert any(pad for _, pad, _ in calls) and not all(pad for _, pad, _ in calls)


def _count_graphs(model, prompts, monkeypatch, *, pad: bool) -> tuple[int, list]:
    if not pad:
        monkeypatch.setattr(runner_module, "prefill_padding", lambda *_: 0)
        monkeypatch.setattr(runner_module, "PREFILL_MIN_ROWS", 0)
    counter, calls = CompileCounter(), []

    def setup(runner):
        # dynamo's tracing with a counting backend (no inductor): each new graph is one more frame
        runner.compiled_prefill = compile_step(prefill_step, cfg=runner.cfg, backend=counter)
        if pad:  # what the engine does at start: the warm-up's graph must then serve every step
            runner.warm_prefill()
            assert counter.frame_count == 1
            assert not any(t.any() for t in (*runner.cache.k, *runner.cache.v)), "the warm-up wrote to the KV pool"
        _spy(calls)(runner)

    outputs = _run(model, prompts, compile=False, setup=setup)
    return counter.frame_count, calls, outputs


def test_one_graph_serves_every_prefill_step(model, prompts, monkeypatch):
    torch._dynamo.reset()
    graphs, calls, outputs = _count_graphs(model, prompts, monkeypatch, pad=True)
    assert graphs == 1, f"{graphs} graphs for {len(calls)} prefill steps and the warm-up"
    assert len(set(calls)) >= 4, calls  # token, padding and sampled-row counts vary from step to step
    assert [o.token_ids for o in outputs] == [o.token_ids for o in _run(model, prompts, compile=False)]


def test_without_padding_prefill_steps_recompile(model, prompts, monkeypatch):
    # the negative control of the test above: unpadded, a one-request or few-token step needs graphs of its own
    torch._dynamo.reset()
    graphs, calls, _ = _count_graphs(model, prompts, monkeypatch, pad=False)
    assert graphs > 1 and any(t <= runner_module.MAX_REDUCE_ROWS for t, _, _ in calls)


def test_prefill_compiles_by_default_on_cuda_only(model):
    # on CPU the compiled prefill measured no faster than eager and its compile is long (docs/inference.md)
    with Engine(model, EngineConfig(background=False, kv_budget_tokens=256)) as engine:
        assert (engine.runner.compiled_prefill is not None) == (DEVICE == "cuda")
        assert engine.runner.compiled_decode is not None
    with Engine(model, EngineConfig(compile=False, compile_prefill=True, background=False,
                                    kv_budget_tokens=256)) as engine:  # fmt: skip
        assert engine.runner.compiled_prefill is None  # compile=False runs every step eagerly


def _scaled(x, *, cfg):
    return x * cfg.rms_norm_eps


@torch._dynamo.config.patch(recompile_limit=2)  # the default 8, made quick to reach (not monkeypatch: its undo
def test_each_compiled_step_has_its_own_recompile_limit(model):  # deletes the config entry, breaking later tests)
    # one engine per model config in a process (a notebook, this test suite): dynamo counts recompiles per code
    # object, and with fullgraph=True the ninth of one code object raises; compile_step gives each its own
    configs = [attrs.evolve(model.config, rms_norm_eps=1e-6 * (i + 1)) for i in range(4)]
    x = torch.ones(3)
    torch._dynamo.reset()
    for cfg in configs:
        assert compile_step(_scaled, cfg=cfg, backend=CompileCounter())(x)[0] == cfg.rms_norm_eps
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # the shared code object: the control
        for cfg in configs:
            torch.compile(functools.partial(_scaled, cfg=cfg), fullgraph=True, backend=CompileCounter())(x)
    torch._dynamo.reset()

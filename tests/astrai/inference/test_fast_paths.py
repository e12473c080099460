"""The start check of the GPU fast paths no device run has confirmed (`astrai.inference.fast_paths`, issue 40 item 4).

No GPU here: CUDA is simulated. `fast_paths.on_gpu` is patched to say yes, and each fast path's GPU-only part is
replaced on the CPU tensors by a stand-in that runs through the same dispatch: the fused rotary + KV-store launch
(`ops.rotary._fused_launch`, behind the `FUSED_KV_STORE` switch), the paged attention op while the tuned-launch
switch is on, the fused copy `layout.served_model` makes, and the step `compile_step` returns for the prefill step
(through `thread_count.compile_served`).
A stand-in is healthy (the confirmed path's own result), raises, or returns values off by a few times the tolerance.
The reference for the tokens is an engine with every fast path off (the confirmed paths), on the same weights.
"""

from __future__ import annotations

import functools
import logging

import attrs
import pytest
import torch

import astrai.ops.rotary as rotary_op
from astrai.configs.models import tiny
from astrai.inference import engine as engine_module
from astrai.inference import fast_paths, layout, thread_count
from astrai.inference import runner as runner_module
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.io.model import Model
from astrai.models.decoder import init_params
from astrai.nn import attention as attention_module
from astrai.ops.kv_store import kv_store_
from astrai.tree import replace
from astrai.triton_kernels import _launch
from astrai.triton_kernels.rotary_kv_store import rms_norm_ref

PATHS = ("rotary_kv_store", "tuned_launch", "fuse_projections", "compiled_prefill")
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 17, 99, 4, 250], [7] * 13, [1, 2]]
OFF = 5 * fast_paths.TOLERANCE[torch.float32]  # a wrong result: this far off, relative to the confirmed one


@pytest.fixture(scope="module")
def model():
    cfg = attrs.evolve(tiny(vocab_size=256), num_hidden_layers=2)  # qwen3-shaped: qk-norm inside rotary_kv_store_
    return Model(config=cfg, params=init_params(cfg, seed=0))


def _config(**kw) -> EngineConfig:
    base = dict(compile=False, background=False, page_size=4, kv_budget_tokens=512, max_running=4, pack_weights=False)
    return EngineConfig(**{**base, **kw})


def _tokens(engine: Engine) -> list[list[int]]:
    return [list(c.outputs[0].token_ids) for c in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens through the confirmed paths (nothing fused, eager prefill, the split rotary + store)."""
    with Engine(model, _config(fuse_projections=False)) as engine:
        return _tokens(engine)


def _off(x: torch.Tensor) -> torch.Tensor:
    """`x` off by `OFF` relative to its own size (a wrong result a little past the tolerance, not garbage)."""
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x)
    return x + noise * (OFF * x.norm() / noise.norm())


def _simulate_cuda(monkeypatch, path: str, fault: str | None) -> dict:
    """Make the engine on the CPU take `path`'s fast path as on CUDA (the others stay off), broken by `fault`
    (None, "raise" or "wrong"). Returns the engine config fields that leave the path at its default."""
    monkeypatch.setattr(fast_paths, "on_gpu", lambda device: True)
    for env in (rotary_op.FUSED_KV_STORE_ENV, "ASTRAI_TRITON_TUNED_LAUNCH", fast_paths.VERIFY_ENV):
        monkeypatch.setenv(env, "1")
        monkeypatch.delenv(env)  # unset (the default); restored after the test, whatever the engine changed
    monkeypatch.setattr(rotary_op, "FUSED_KV_STORE", True)
    monkeypatch.setattr(_launch, "CACHE_CONFIGS", True)

    def fail() -> None:
        raise RuntimeError("simulated failure\nof the fast path")  # two lines: the warning must stay one

    if path == "rotary_kv_store":
        monkeypatch.setattr(rotary_op, "fused_kv_store", lambda q: rotary_op.FUSED_KV_STORE)

        def fused(q, k, v, cos, sin, kv, slot_mapping, interleaved, q_norm, k_norm, eps):
            if fault == "raise":
                fail()
            if q_norm is not None:
                q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
            q, k = rotary_op.rotary(q, k, cos, sin, interleaved=interleaved)
            kv_store_(kv[0], kv[1], k, v, slot_mapping)
            return _off(q) if fault == "wrong" else q

        monkeypatch.setattr(rotary_op, "_fused_launch", fused)
        return {"fuse_projections": False}
    if path == "tuned_launch":
        monkeypatch.setattr(fast_paths, "_triton", lambda device: True)
        paged = attention_module.paged_attention

        def attend(*args, **kw):
            out = paged(*args, **kw)
            if not _launch.CACHE_CONFIGS:
                return out
            if fault == "raise":
                fail()
            return _off(out) if fault == "wrong" else out

        monkeypatch.setattr(attention_module, "paged_attention", attend)
        return {"fuse_projections": False}
    if path == "fuse_projections":
        monkeypatch.setattr(engine_module, "should_fuse", lambda model, fuse, tensor_parallel: fuse is None or fuse)
        fuse = layout.fuse_projections

        def broken_fuse(params, *, into=None):
            fused = fuse(params, into=into)
            qkv = fused.blocks[0].attn.qkv_proj
            if fault == "raise":  # one row short: the q/k/v split raises
                qkv = replace(qkv, weight=qkv.weight[:-1])
            elif fault == "wrong":
                qkv = replace(qkv, weight=_off(qkv.weight))
            block = replace(fused.blocks[0], attn=replace(fused.blocks[0].attn, qkv_proj=qkv))
            return replace(fused, blocks=(block, *fused.blocks[1:]))

        monkeypatch.setattr(layout, "fuse_projections", broken_fuse)
        return {"fuse_projections": None}
    assert path == "compiled_prefill"
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the sampler: eager

    def compile_step(fn, *, cfg, **kw):
        step = functools.partial(fn, cfg=cfg)
        if fn is not runner_module.prefill_step or fault is None:
            return step

        def compiled_prefill(*args, **kwargs):
            if fault == "raise":
                fail()
            return _off(step(*args, **kwargs))

        return compiled_prefill

    monkeypatch.setattr(thread_count, "compile_step", compile_step)  # what `compile_served` compiles with
    return {"compile": True, "compile_prefill": None, "fuse_projections": False}


def _on(engine: Engine, path: str) -> bool:
    """Whether `engine` (started with `path` at its default) serves `path`'s fast path."""
    return {
        "rotary_kv_store": rotary_op.FUSED_KV_STORE,
        "tuned_launch": _launch.CACHE_CONFIGS,
        "fuse_projections": engine._fuse and engine.runner.model is not engine.model,
        "compiled_prefill": engine.runner.compiled_prefill is not None,
    }[path]


SWITCHES = {
    "rotary_kv_store": "ASTRAI_FUSED_ROTARY_KV_STORE",
    "tuned_launch": "ASTRAI_TRITON_TUNED_LAUNCH",
    "fuse_projections": "fuse_projections",
    "compiled_prefill": "compile_prefill",
}


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == fast_paths.__name__ and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("fault", ["raise", "wrong"])
@pytest.mark.parametrize("path", PATHS)
def test_a_broken_fast_path_falls_back_with_one_warning(model, reference, monkeypatch, caplog, path, fault):
    fields = _simulate_cuda(monkeypatch, path, fault)
    with caplog.at_level(logging.INFO, logger=fast_paths.__name__):
        engine = Engine(model, _config(**fields))
    with engine:
        warned = _warnings(caplog)
        assert len(warned) == 1, [r.getMessage() for r in warned]
        message = warned[0].getMessage()
        assert "\n" not in message and path in message and SWITCHES[path] in message, message
        assert ("raised RuntimeError" if fault == "raise" else "relative error") in message, message
        assert fast_paths.VERIFY_ENV in message
        assert not _on(engine, path)
        assert _tokens(engine) == reference  # the confirmed path serves, and serves right


@pytest.mark.parametrize("path", PATHS)
def test_a_healthy_fast_path_stays_on_without_a_warning(model, reference, monkeypatch, caplog, path):
    fields = _simulate_cuda(monkeypatch, path, None)
    checked = []
    run_check = fast_paths.run_check
    monkeypatch.setattr(fast_paths, "run_check", lambda p, *a: checked.append(p.name) or run_check(p, *a))
    with caplog.at_level(logging.INFO, logger=fast_paths.__name__):
        engine = Engine(model, _config(**fields))
    with engine:
        assert checked == [path]  # it was checked (and nothing else: the other paths are off)
        assert not _warnings(caplog)
        assert any(f"{path} passed its start check" in r.getMessage() for r in caplog.records)
        assert _on(engine, path)
        assert _tokens(engine) == reference


@pytest.mark.parametrize("path", PATHS)
def test_a_confirmed_path_is_not_checked(model, monkeypatch, caplog, path):
    fields = _simulate_cuda(monkeypatch, path, "wrong")  # a check would turn it off (the test above)
    record = fast_paths.Confirmation(date="2026-12-24", gpu="NVIDIA H200", commit="0123abc")
    name = {p.name: n for n in dir(fast_paths) if isinstance(p := getattr(fast_paths, n), fast_paths.FastPath)}[path]
    monkeypatch.setattr(fast_paths, name, attrs.evolve(getattr(fast_paths, name), confirmed=record))
    monkeypatch.setattr(fast_paths, "run_check", lambda *a: pytest.fail("a confirmed path was checked"))
    with caplog.at_level(logging.INFO, logger=fast_paths.__name__), Engine(model, _config(**fields)) as engine:
        assert not caplog.records
        assert _on(engine, path)


@pytest.mark.parametrize("path", ["rotary_kv_store", "fuse_projections"])
def test_a_path_forced_by_its_switch_is_not_checked(model, monkeypatch, path):
    fields = _simulate_cuda(monkeypatch, path, "raise")
    if path == "rotary_kv_store":
        monkeypatch.setenv(rotary_op.FUSED_KV_STORE_ENV, "1")
    else:
        fields = {"fuse_projections": True}
    monkeypatch.setattr(fast_paths, "run_check", lambda *a: pytest.fail("a forced path was checked"))
    with Engine(model, _config(**fields)) as engine:
        assert _on(engine, path)


def test_verify_0_skips_every_check(model, monkeypatch):
    _simulate_cuda(monkeypatch, "rotary_kv_store", "raise")
    monkeypatch.setenv(fast_paths.VERIFY_ENV, "0")
    monkeypatch.setattr(fast_paths, "run_check", lambda *a: pytest.fail("checked under ASTRAI_VERIFY_FAST_PATHS=0"))
    with Engine(model, _config(fuse_projections=False)):
        assert rotary_op.FUSED_KV_STORE


@pytest.mark.parametrize("verify", [None, "all"])
def test_cpu_engines_never_run_the_checks(model, reference, monkeypatch, verify):
    if verify is not None:
        monkeypatch.setenv(fast_paths.VERIFY_ENV, verify)
    for name in ("run_check", "probe_logits", "compiled_prefill_check"):
        monkeypatch.setattr(fast_paths, name, lambda *a, **kw: pytest.fail("a check ran on a CPU engine"))
    for fuse in (None, True, False):
        with Engine(model, _config(fuse_projections=fuse)) as engine:
            assert _tokens(engine) == reference
    # the Triton kernels on CPU tensors (under the interpreter): the fused rotary + store and the tuned launch are
    # in use, on a CPU engine, and still not checked (the engine is only started: the interpreter is slow)
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "triton")
    assert rotary_op.fused_kv_store(torch.empty(0)) and _launch.CACHE_CONFIGS
    Engine(model, _config()).shutdown()


def test_the_comparison_against_the_tolerance():
    ref = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    tol = fast_paths.TOLERANCE[torch.float32]
    path = fast_paths.FUSE_PROJECTIONS
    for scale, ok in ((0.5, True), (1.5, False)):
        noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
        fast = ref + noise * (scale * tol * ref.norm() / noise.norm())  # relative error scale * tol
        result = fast_paths.run_check(path, lambda f, fast=fast: fast if f else ref, torch.float32)
        assert result.error == pytest.approx(scale * tol, rel=1e-4) and result.ok is ok, result
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert fast_paths.run_check(path, lambda f: nan if f else ref, torch.float32).ok is False
    assert fast_paths.run_check(path, lambda f: ref[:2] if f else ref, torch.float32).ok is False
    assert fast_paths.run_check(path, lambda f: ref, torch.float32).error == 0.0


@pytest.mark.gpu
def test_every_check_passes_on_cuda(model):
    """On a GPU: the real fast paths against the confirmed ones (fp32), as `benchmarks/check_fast_paths.py` runs them
    for the records, and an engine with every default starts without a fallback."""
    from astrai.tree import tree_map

    cuda = Model(config=model.config, params=tree_map(lambda t: t.cuda(), model.params))
    results = fast_paths.confirm(cuda, page_size=16)
    assert {r.name for r in results} == {"rotary_kv_store", "tuned_launch", "fuse_projections"}, results
    assert all(r.ok for r in results), results
    with Engine(cuda, EngineConfig(background=False, kv_budget_tokens=512, max_running=4)) as engine:
        assert engine._fuse and engine.runner.compiled_prefill is not None
        assert rotary_op.FUSED_KV_STORE and _launch.CACHE_CONFIGS

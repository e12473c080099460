"""GPU fast paths that no device run has confirmed yet, checked once at engine start against the confirmed path.

The last GPU runs (an H200, 2026-11-29/30, commits e59eec6 and f6a49fc) confirmed the Triton attention, rotary and
KV-store kernels, CUDA-graph decode and the eager prefill step. Four CUDA defaults came later and have never run on
a GPU (issue 40 item 4):

| path | the fast path (CUDA default) | falls back to | switch |
|---|---|---|---|
| `rotary_kv_store` | qk-norm, rotary, KV store: one launch | rotary, then KV store | `ASTRAI_FUSED_ROTARY_KV_STORE` |
| `tuned_launch` | from the remembered config | the autotuner's lookup | `ASTRAI_TRITON_TUNED_LAUNCH` |
| `fuse_projections` | q/k/v and gate/up fused | the checkpoint layout | `EngineConfig.fuse_projections` |
| `compiled_prefill` | `torch.compile`d prefill step | the eager step | `EngineConfig.compile_prefill` |

Until a path's `FastPath.confirmed` record is set, an engine on CUDA runs it once at start beside its confirmed
path on a small input (`probe_logits`: two prompts of 5 and 12 tokens through a prefill step and one decode step
of the real model, into a private KV pool of its own pages; the compiled prefill through the runner's own pool): it
stays on when both run and the logits agree within `TOLERANCE` (relative L2 error, by dtype); else the engine falls back
and logs one warning naming the switch. A path the user set explicitly (its env variable or config field) is not
checked; `ASTRAI_VERIFY_FAST_PATHS=0` skips every check, `=all` checks confirmed paths too. CPU engines never
check: their paths are confirmed by the test suite. The kernel paths' checks flip their process-wide switches for
a few milliseconds: another engine's compiled step called meanwhile runs the confirmed path (same values) and may
recompile once (Dynamo guards on the switch). `Engine.__init__` calls `verify_at_start` before the runner
compiles anything or captures graphs; the runner calls `warm_prefill` once it has compiled the prefill step (the
check needs it) and before it captures the decode graphs. `benchmarks/check_fast_paths.py` runs every check on
a GPU and prints JSON from which the records below are filled (docs/inference.md, "GPU fast paths and their
confirmation").
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch import Tensor

import astrai.ops.rotary as rotary_op
from astrai.inference.cache import init_kv_cache, logits_rows, make_attn_meta
from astrai.inference.engine_config import EngineConfig
from astrai.inference.step import decode_step, prefill_step
from astrai.io.model import Model
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams
from astrai.ops.attention import pages_needed
from astrai.ops.backend import attn_backend
from astrai.ops.linear import MAX_REDUCE_ROWS
from astrai.ops.tuned_launch import set_tuned_launch, tuned_launch, tuned_launch_forced
from astrai.tree import leaves

logger = logging.getLogger(__name__)

VERIFY_ENV = "ASTRAI_VERIFY_FAST_PATHS"  # 0/false/no/off: no checks; all: confirmed paths too; else unconfirmed
# relative L2 error ||fast - confirmed|| / ||confirmed|| of the probe's float32 logits, by the model's dtype: both
# sides run the same model, so only rounding (another GEMM shape, another fusion) may differ; a broken kernel
# gives errors of order 1
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# the probe's prompts: two requests of more than MAX_REDUCE_ROWS tokens in all (the shape of a compiled prefill step)
PROBE_LENGTHS = (5, 12)


@attrs.frozen
class Confirmation:
    """The last device run that confirmed a fast path."""

    date: str  # YYYY-MM-DD
    gpu: str  # e.g. "NVIDIA H200"
    commit: str  # the commit the run checked out


@attrs.frozen
class FastPath:
    """One GPU fast path: what runs instead when it fails, the switch that forces it, its confirmation."""

    name: str
    fallback: str  # the confirmed path, as the warning names it
    switch: str  # how to force it on or off, as the warning names it
    confirmed: Confirmation | None = None  # None: never run on a GPU, checked at every CUDA engine start


ROTARY_KV_STORE = FastPath(
    "rotary_kv_store", fallback="the Triton rotary kernel, then the Triton KV store",
    switch="ASTRAI_FUSED_ROTARY_KV_STORE=1 forces it, =0 turns it off",
)  # fmt: skip
TUNED_LAUNCH = FastPath(
    "tuned_launch", fallback="the autotuner's per-call lookup",
    switch="ASTRAI_TRITON_TUNED_LAUNCH=1 forces it, =0 turns it off",
)  # fmt: skip
FUSE_PROJECTIONS = FastPath(
    "fuse_projections", fallback="the checkpoint's q/k/v and gate/up layout",
    switch="EngineConfig.fuse_projections=True (serve --fuse-projections on) forces it, False (off) turns it off",
)  # fmt: skip
COMPILED_PREFILL = FastPath(
    "compiled_prefill", fallback="the eager prefill step",
    switch="EngineConfig.compile_prefill=True forces it, False turns it off",
)  # fmt: skip
FAST_PATHS = (ROTARY_KV_STORE, TUNED_LAUNCH, FUSE_PROJECTIONS, COMPILED_PREFILL)


@attrs.frozen
class CheckResult:
    """The outcome of one check: `ok` when both paths ran and agree within `tolerance`."""

    name: str
    ok: bool
    detail: str  # one line: the error against the tolerance, or what raised
    error: float | None  # relative L2 error (None when a path raised)
    tolerance: float
    ms: float  # wall time of both paths


def on_gpu(device: torch.device) -> bool:
    """Whether an engine on `device` takes the unconfirmed GPU defaults (CUDA). Tests patch it to simulate CUDA."""
    return device.type == "cuda"


def _triton(device: torch.device) -> bool:
    """Whether tensors on `device` take the Triton kernels (`ASTRAI_ATTN_BACKEND`)."""
    return attn_backend(torch.empty(0, device=device)) == "triton"


def _mode() -> str:
    value = os.environ.get(VERIFY_ENV, "1").strip().lower()
    return "off" if value in ("0", "false", "no", "off") else "all" if value == "all" else "unconfirmed"


def _wanted(path: FastPath) -> bool:
    mode = _mode()
    return mode == "all" or (mode == "unconfirmed" and path.confirmed is None)


def relative_error(fast: Tensor, ref: Tensor) -> float:
    """||fast - ref|| / ||ref|| in float64 (inf when the shapes differ or `fast` is not finite where `ref` is)."""
    if fast.shape != ref.shape:
        return float("inf")
    fast, ref = fast.double(), ref.double()
    finite = torch.isfinite(ref)
    if not torch.isfinite(fast[finite]).all():
        return float("inf")
    return float((fast[finite] - ref[finite]).norm() / ref[finite].norm().clamp_min(1e-30))


def run_check(path: FastPath, run: Callable[[bool], Tensor], dtype: torch.dtype) -> CheckResult:
    """Run `run(False)` (the confirmed path) and `run(True)` (the fast one) and compare them."""
    tol, start = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16]), time.perf_counter()
    try:
        ref = run(False)
    except Exception as err:
        return CheckResult(path.name, False, f"the confirmed path raised {_one_line(err)}", None, tol, _ms(start))
    try:
        fast = run(True)
    except Exception as err:
        return CheckResult(path.name, False, f"raised {_one_line(err)}", None, tol, _ms(start))
    error = relative_error(fast, ref)
    ok = error <= tol
    detail = f"relative error {error:.2e} {'<=' if ok else '>'} {tol:.0e}"
    return CheckResult(path.name, ok, detail, error, tol, _ms(start))


def _one_line(err: Exception) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def _report(path: FastPath, result: CheckResult) -> bool:
    """Log the outcome (one warning line on failure) and return whether the fast path stays on."""
    if result.ok:
        logger.info("GPU fast path %s passed its start check: %s (%.1f ms)", path.name, result.detail, result.ms)
        return True
    logger.warning("GPU fast path %s failed its start check (%s): falling back to %s (%s; %s=0 skips these checks)",
                   path.name, result.detail, path.fallback, path.switch, VERIFY_ENV)  # fmt: skip
    return False


@contextlib.contextmanager
def _switched(get: Callable[[], bool], set_: Callable[[bool], None], value: bool) -> Iterator[None]:
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def _set_fused_kv_store(value: bool) -> None:
    rotary_op.FUSED_KV_STORE = value


@torch.inference_mode()
def probe_logits(params: DecoderParams, cfg: ModelConfig, *, page_size: int) -> Tensor:
    """float32 logits [4, V] of the probe: two prompts (`PROBE_LENGTHS`) through one eager prefill step, then one
    decode step of both, into a private KV pool of their pages only. Token ids are fixed, not sampled, so that two
    paths always feed the same inputs."""
    device, dtype = params.norm.weight.device, params.norm.weight.dtype
    each = pages_needed(max(PROBE_LENGTHS) + 1, page_size)
    pages = [list(range(1 + i * each, 1 + (i + 1) * each)) for i in range(len(PROBE_LENGTHS))]
    cache = init_kv_cache(cfg, 1 + len(pages) * each, page_size, dtype=dtype, device=device)
    ids = torch.randint(0, cfg.vocab_size, (sum(PROBE_LENGTHS) + len(PROBE_LENGTHS),),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    prompts, following = ids[: sum(PROBE_LENGTHS)].to(device), ids[sum(PROBE_LENGTHS) :].to(device)
    meta = make_attn_meta(pages, [0] * len(pages), PROBE_LENGTHS, page_size=page_size, device=device)
    first = prefill_step(params, prompts, meta, cache, logits_rows(meta).long(), cfg=cfg)
    meta = make_attn_meta(pages, PROBE_LENGTHS, [1] * len(pages), page_size=page_size, device=device, decode=True)
    second = decode_step(params, following, meta, cache, cfg=cfg)
    return torch.cat([first, second]).float().cpu()


def _engine_checks(model: Model, served: Model, page_size: int) -> list[tuple[FastPath, Callable[[bool], Tensor]]]:
    """The checks an engine start runs before the runner exists, each with its `run(fast)`: the process-wide
    kernel paths on the checkpoint layout first, then fused projections under whatever those left on."""
    device, cfg = model.device, model.config

    def probe(params: DecoderParams) -> Tensor:
        return probe_logits(params, cfg, page_size=page_size)

    def rotary_kv_store(fast: bool) -> Tensor:
        with _switched(lambda: rotary_op.FUSED_KV_STORE, _set_fused_kv_store, fast):
            return probe(model.params)

    def tuned(fast: bool) -> Tensor:
        with _switched(tuned_launch, set_tuned_launch, fast):
            if fast:
                probe(model.params)  # a key's first launch goes through the autotuner: the second is the fast one
            return probe(model.params)

    def fused(fast: bool) -> Tensor:
        return probe((served if fast else model).params)

    checks = []
    if rotary_op.fused_kv_store(torch.empty(0, device=device)):
        checks.append((ROTARY_KV_STORE, rotary_kv_store))
    if tuned_launch() and _triton(device):
        checks.append((TUNED_LAUNCH, tuned))
    if served is not model:
        checks.append((FUSE_PROJECTIONS, fused))
    return checks


def verify_at_start(model: Model, served: Model, config: EngineConfig) -> tuple[bool, Model]:
    """Check the unconfirmed fast paths an engine on CUDA is about to use; return (fuse, the model to serve).

    `served` is `model` or its fused copy (`layout.served_model`). Failing kernel paths are switched off for the
    process (they are module switches); failing fused projections make the engine serve `model` itself. No-op on
    CPU, under tensor parallel (the probe runs the whole model on one device), and with `ASTRAI_VERIFY_FAST_PATHS=0`.
    """
    fused = served is not model
    if config.tensor_parallel_size > 1 or not on_gpu(model.device) or _mode() == "off":
        return fused, served
    forced = {ROTARY_KV_STORE.name: rotary_op.FUSED_KV_STORE_ENV in os.environ,
              TUNED_LAUNCH.name: tuned_launch_forced(),
              FUSE_PROJECTIONS.name: config.fuse_projections is not None}  # fmt: skip
    for path, run in _engine_checks(model, served, config.page_size):
        if forced[path.name] or not _wanted(path) or _report(path, run_check(path, run, model.dtype)):
            continue
        if path is ROTARY_KV_STORE:
            _set_fused_kv_store(False)
        elif path is TUNED_LAUNCH:
            set_tuned_launch(False)
        else:
            return False, model
    return fused, served


def _runner_prefill(runner: Any, compiled: bool) -> Tensor:
    """The probe's prompts through `runner`'s prefill step (compiled or eager; `runner` is a `ModelRunner`, which
    imports this module) into its own KV pool; float32 logits [2, V]. Shaped as `ModelRunner.run` feeds a compiled
    step (two requests, more than `MAX_REDUCE_ROWS` tokens and sampled rows, symbolic sizes), so that the graph
    compiled at start serves it without a recompile."""
    page_size, device, params, cache = runner.page_size, runner.device, runner.model.params, runner.cache
    each = pages_needed(max(PROBE_LENGTHS), page_size)
    pages = [list(range(1 + i * each, 1 + (i + 1) * each)) for i in range(len(PROBE_LENGTHS))]
    width = max(2, 1 << max(0, each - 1).bit_length())  # `ModelRunner._width`
    meta = make_attn_meta(pages, [0] * len(pages), PROBE_LENGTHS, page_size=page_size, device=device, width=width)
    tokens = torch.randint(0, runner.cfg.vocab_size, (sum(PROBE_LENGTHS),), generator=torch.Generator().manual_seed(0))
    tokens, rows = tokens.to(device), logits_rows(meta).long()
    rows = torch.cat([rows, rows.new_zeros(MAX_REDUCE_ROWS + 1 - len(rows))])
    with torch.inference_mode():
        if not compiled:
            return runner.eager_prefill(params, tokens, meta, cache, rows)[: len(pages)].float().cpu()
        for t in (tokens, meta.positions, meta.slot_mapping, meta.seq_lens, meta.cu_seqlens_q, meta.block_table, rows):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(meta.block_table, 1)
        return runner.compiled_prefill(params, tokens, meta, cache, rows)[: len(pages)].float().cpu()


def compiled_prefill_check(runner: Any) -> CheckResult | None:
    """The compiled prefill step against the eager one on `runner`'s pool (None: the pool has too few pages)."""
    pool_pages = leaves(runner.cache)[0].shape[0] // runner.page_size
    if pool_pages <= len(PROBE_LENGTHS) * pages_needed(max(PROBE_LENGTHS), runner.page_size):
        return None
    return run_check(COMPILED_PREFILL, lambda fast: _runner_prefill(runner, fast), runner.model.dtype)


def warm_prefill(runner: Any, *, check: bool) -> Callable | None:
    """Warm `runner`'s compiled prefill step up (`ModelRunner.warm_prefill`) and return the prefill step to keep:
    the compiled one, or None (eager) when `check` (the default `compile_prefill` was left at None), the runner is
    on CUDA and the compiled step is unconfirmed and fails: its warm-up raises (a compile error) or its check does
    (then one warning). The pages the probe writes hold no sequence yet: the pool is empty at start, and a sequence
    writes its K/V before it reads it."""
    if not (check and on_gpu(runner.device) and _wanted(COMPILED_PREFILL)):
        runner.warm_prefill()
        return runner.compiled_prefill
    try:
        runner.warm_prefill()
    except Exception as err:
        tol = TOLERANCE.get(runner.model.dtype, TOLERANCE[torch.bfloat16])
        result = CheckResult(COMPILED_PREFILL.name, False, f"warming it up raised {_one_line(err)}", None, tol, 0.0)
    else:
        result = compiled_prefill_check(runner)
    return runner.compiled_prefill if result is None or _report(COMPILED_PREFILL, result) else None


def confirm(model: Model, *, page_size: int = 16, runner: Any = None) -> list[CheckResult]:
    """Run every check on `model`'s device, confirmed paths included, changing no switch: the GPU script's stage
    (`benchmarks/check_fast_paths.py`). The kernel paths are checked only where the Triton backend runs; the
    compiled prefill step only with `runner` (a `ModelRunner` of `model` whose prefill step is compiled)."""
    from astrai.inference.layout import served_model

    served = served_model(model, True)
    results = [run_check(path, run, model.dtype) for path, run in _engine_checks(model, served, page_size)]
    result = compiled_prefill_check(runner) if runner is not None and runner.compiled_prefill is not None else None
    return results + ([result] if result is not None else [])

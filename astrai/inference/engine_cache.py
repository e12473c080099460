"""The engines behind `astrai.generate`, `generate_ids` and `chat`: one per live `Model`, reused across calls.

The first call on a model builds an `Engine` (compiled decode step, `background=False`: the calling thread runs
the steps) and compiles it, behind a spinner on stderr; later calls reuse it and run at the compiled speed
(docs/benchmarks.md, "Notebook decode"). A call that needs more KV tokens or more running rows than the engine
has replaces it with a bigger one, both sizes rounded up to powers of two (so slightly larger calls do not rebuild).

- Keyed by the `Model` object's identity: a reload, `attrs.evolve(model, params=...)` or a dtype cast is a new
  object and gets its own engine; the engine serves a shallow copy (same tensors) so that the cache does not keep
  the user's model alive. When the model is garbage-collected (`weakref.finalize`) its engine is shut down and
  dropped; `release_engines` drops them sooner (to free the KV pool).
- Weights changed in place (a training step between two calls) are read as they are: the steps take the tensors
  as inputs. The radix prefix cache stays on, for sharing within one call (n > 1, a common system prompt), and
  is emptied at the start of every call (`Engine.invalidate_prefix_cache`), so no call reuses K/V computed with
  other weights; this is what the per-call engine did before.
- One lock per model: two threads generating on the same model take turns (a `background=False` engine is
  stepped by its caller, and two callers must not interleave steps); different models run concurrently.
- A call that fails in the middle (an error in a step, Ctrl-C in a notebook) drops the engine: the next call
  builds a fresh one rather than reusing half-updated state. A prompt rejected up front (`EngineInputError`)
  keeps it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console

from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.errors import EngineInputError, LoRAError
from astrai.inference.outputs import Completion
from astrai.inference.params import SamplingParams
from astrai.inference.speculative import SpeculativeConfig
from astrai.io.errors import CheckpointError, UnsupportedModelError
from astrai.io.lora import ADAPTER_WEIGHTS, read_adapter_config
from astrai.io.model import Model
from astrai.ops.attention import pages_needed

PAGE_SIZE = 16
MIN_KV_TOKENS = 1024  # the smallest pool a cached engine gets (a few MiB for small models)
COMPILE = True
"""Compile the decode step of cached engines (tests set False for speed; measured on CPU in docs/benchmarks.md)."""
SHARE_CPU_CORES: bool | None = None
"""`EngineConfig.share_cpu_cores` of cached engines; None: `EngineConfig`'s default (on; bench_shared_cores' and
bench_cpu_peers' workers turn it off for their fixed-thread arms)."""
COMPILING = "compiling the decode step (first call only)…"

_console = Console(stderr=True)


@attrs.define(eq=False)
class _Slot:
    """One model's engine, its lock, and the batch shapes it has run (a new one may compile)."""

    finalizer: weakref.finalize | None = None
    engine: Engine | None = None
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    batched: set[bool] = attrs.field(factory=set)  # "rows > 1" values seen since the engine was built
    adapters: dict[str, float] = attrs.field(factory=dict)  # adapter folder -> its weights' mtime when loaded


_slots: dict[int, _Slot] = {}  # id(model) -> slot; the finalizer removes it before the id can be reused
_slots_lock = threading.RLock()  # re-entrant: a finalizer may run from the garbage collector while held


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _needs(prompts: Sequence[Sequence[int]], params: SamplingParams) -> tuple[int, int]:
    """(KV tokens, running rows) one call needs."""
    kv = sum(pages_needed(len(p) + params.max_tokens, PAGE_SIZE) * PAGE_SIZE for p in prompts) * params.n
    return kv, len(prompts) * params.n


def _config(kv_tokens: int, rows: int, *, compile: bool, speculative: SpeculativeConfig | None = None,
            loras: tuple[int, int] = (0, 0)) -> EngineConfig:  # fmt: skip
    """An engine config; `loras` (slots, rank): multi-LoRA serving when slots > 0."""
    lora = dict(enable_lora=True, max_loras=loras[0], max_lora_rank=loras[1]) if loras[0] else {}
    shared = {} if SHARE_CPU_CORES is None else {"share_cpu_cores": SHARE_CPU_CORES}
    return EngineConfig(page_size=PAGE_SIZE, kv_budget_tokens=kv_tokens, max_running=rows,
                        max_step_tokens=max(2048, rows), compile=compile, background=False,
                        speculative=speculative, **shared, **lora)  # fmt: skip


def _lora_need(folders: Sequence[str | None] | None, old: EngineConfig | None) -> tuple[int, int]:
    """(slots, rank) an engine needs for these adapter folders (powers of two, at least the old engine's)."""
    distinct = {f for f in folders or () if f is not None}
    if not distinct and (old is None or not old.enable_lora):
        return 0, 0
    try:
        rank = max((read_adapter_config(f).r for f in distinct), default=1)
    except (CheckpointError, UnsupportedModelError) as err:
        raise LoRAError(str(err), param="lora") from None
    slots, rank = _pow2(max(len(distinct), 1)), max(_pow2(rank), 8)
    if old is not None and old.enable_lora:
        slots, rank = max(slots, old.max_loras), max(rank, old.max_lora_rank)
    return slots, rank


def _load_adapters(slot: _Slot, engine: Engine, folders: Sequence[str | None] | None) -> None:
    """Load each adapter folder (named by its path) the engine lacks, or whose weights changed on disk since."""
    for folder in dict.fromkeys(f for f in folders or () if f is not None):
        stamp = _mtime(folder)
        if folder in engine.loras() and slot.adapters.get(folder) != stamp:
            engine.unload_lora(folder)  # retrained in place: read it again (its cached prefixes go with it)
        if folder not in engine.loras():
            engine.load_lora(folder, folder)
            slot.adapters[folder] = stamp


def _mtime(folder: str) -> float:
    try:
        return (Path(folder) / ADAPTER_WEIGHTS).stat().st_mtime
    except OSError:
        return -1.0


def _drop(key: int) -> None:
    with _slots_lock:
        slot = _slots.pop(key, None)
    if slot is not None:
        with slot.lock:
            _shutdown(slot)


def _shutdown(slot: _Slot) -> None:
    engine, slot.engine = slot.engine, None
    slot.batched.clear()
    if engine is not None:
        engine.shutdown()


def _slot(model: Model) -> _Slot:
    with _slots_lock:
        slot = _slots.get(id(model))
        if slot is None:
            slot = _slots[id(model)] = _Slot()
            slot.finalizer = weakref.finalize(model, _drop, id(model))
            slot.finalizer.atexit = False
        return slot


def release_engines(model: Model | None = None) -> None:
    """Shut down the engines `astrai.generate` keeps for `model` (None: for every model), freeing their KV pools.

    Not needed for correctness: an engine goes when its model is garbage-collected, and every call reads the
    model's current weights. The next call builds (and compiles) a new engine.
    """
    with _slots_lock:
        slots = list(_slots.values()) if model is None else [_slots.get(id(model))]
    for slot in slots:
        if slot is not None and slot.finalizer is not None:
            slot.finalizer()  # runs _drop once and detaches


def cached_engines() -> int:
    """How many models hold a cached engine (for tests and debugging)."""
    with _slots_lock:
        return sum(slot.engine is not None for slot in _slots.values())


@contextlib.contextmanager
def _status(message: str) -> Iterator[None]:
    """A spinner on stderr while the block runs: animated in a terminal or in Jupyter with ipywidgets, one plain
    line in Jupyter without them, nothing when stderr is a file or a pipe (rich's transient status)."""
    if _console.is_jupyter:
        try:
            import ipywidgets  # noqa: F401  (rich's live display in Jupyter needs it)
        except ImportError:
            print(message, file=sys.stderr, flush=True)
            yield
            return
    with _console.status(message):
        yield


def _generate(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams,
              lora: Sequence[str | None] | None = None) -> list[Completion]:  # fmt: skip
    """`Engine.generate`, but a prompt rejected by `submit` aborts the ones submitted before it."""
    handles = []
    try:
        for i, prompt in enumerate(prompts):
            handles.append(engine.submit(list(prompt), params, lora=lora[i] if lora is not None else None))
    except BaseException:
        for handle in handles:
            handle.abort()
        raise
    return [handle.result() for handle in handles]


def run_once(model: Model, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
    """The uncached path: an eager engine sized exactly to this call, shut down after it (tests compare to it)."""
    kv, rows = _needs(prompts, params)
    with Engine(model, _config(kv, rows, compile=False)) as engine:
        return _generate(engine, prompts, params)


def run(model: Model, prompts: Sequence[Sequence[int]], params: SamplingParams, *, speculative: Any = None,
        lora: Sequence[str | None] | None = None) -> list[Completion]:  # fmt: skip
    """Generate on the model's cached engine (built, or rebuilt bigger, when this call does not fit it, or with
    the `speculative` config asked for when it differs). `lora`: an adapter folder (or None) per prompt; the
    engine then serves adapter slots, and each folder is loaded once under its own path as name."""
    if not prompts:
        raise ValueError("no prompts given")
    if not isinstance(speculative, SpeculativeConfig):
        speculative = SpeculativeConfig.parse(speculative)
    kv, rows = _needs(prompts, params)
    slot = _slot(model)
    with slot.lock:
        engine = slot.engine
        loras = _lora_need(lora, engine.config if engine is not None else None)
        if (engine is None or engine.config.kv_budget_tokens < kv or engine.config.max_running < rows
                or engine.config.speculative != speculative or engine.config.max_loras < loras[0]
                or engine.config.max_lora_rank < loras[1] or engine.config.enable_lora != bool(loras[0])):  # fmt: skip
            old = engine.config if engine is not None else None
            _shutdown(slot)  # its KV pool goes before the bigger one is allocated
            kv_tokens = max(_pow2(max(kv, MIN_KV_TOKENS)), old.kv_budget_tokens if old else 0)
            max_rows = max(_pow2(rows), old.max_running if old else 0)
            # the engine serves a copy sharing the tensors: the cache must not keep `model` itself alive
            config = _config(kv_tokens, max_rows, compile=COMPILE, speculative=speculative, loras=loras)
            engine = slot.engine = Engine(attrs.evolve(model), config)
            slot.adapters.clear()
        _load_adapters(slot, engine, lora)
        engine.invalidate_prefix_cache()  # weights may have changed in place since the last call
        compiling = engine.config.compile and (rows > 1) not in slot.batched
        try:
            with _status(COMPILING) if compiling else contextlib.nullcontext():
                out = _generate(engine, prompts, params, lora)
            engine.restore_threads()  # the caller's thread stepped it: give back its torch thread count
        except EngineInputError:
            raise  # rejected before any step ran: the engine is as it was
        except BaseException:
            _shutdown(slot)
            raise
        slot.batched.add(rows > 1)
        return out

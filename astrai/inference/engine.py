"""`Engine`: continuous-batching generation on a background thread (host Python, never compiled).

Requests are submitted from any thread (or event loop) and come back as `RequestHandle`s (`handle.py`) that
yield stream `Delta`s and a final `Completion`. The engine thread loops: take new requests and aborts,
`Scheduler.schedule`, `ModelRunner.execute`, `Scheduler.update`, then `RequestDelivery` detokenizes and
delivers (`delivery.py`). With `EngineConfig.overlap_schedule` the step is launched (`ModelRunner.launch`) and
the one before it collected, updated and delivered while it runs (docs/inference.md, "Overlap schedule"). This
module owns only the threads, submission and validation; see docs/inference.md.

A request with `SamplingParams.grammar` has it compiled and checked in `submit`, on the caller's thread
(`compile_grammar`, cached; a grammar that does not compile or admits no complete output, `grammar_check`, is an
`EngineInputError` naming the spec's `param`, never an error in the step loop), against one llguidance view of the
tokenizer built on first use; each of its n sequences gets its own matcher. A sequence whose matcher still fails
later (or whose host work raises) ends only its own request, with `RequestFailedError`; the engine goes on.

RL rollouts (`astrai.train.rollout`): the engine serves the trainer's own tensors; after an optimizer step,
`update_params()` drops every cached prefix (old weights' K/V); `update_params(tree)` swaps tensors, no copy.
With fused projections (`EngineConfig.fuse_projections`, on CUDA by default) the engine serves a fused copy of
q/k/v and gate/up instead (`layout.py`), and both calls write the new values into it in place.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import attrs

from astrai.inference import speculative
from astrai.inference.adapters import Adapters, serve_adapters
from astrai.inference.admission import check_request, encode_prompt
from astrai.inference.budget import kv_pool_pages, pool_max_model_len
from astrai.inference.cache import kv_bytes_per_token
from astrai.inference.cpu_share import shared_cores
from astrai.inference.delivery import RequestDelivery
from astrai.inference.draft import DraftProposer, draft_kv_bytes, load_draft
from astrai.inference.engine_config import EngineConfig, EngineStats
from astrai.inference.engine_grammar import GrammarMethods
from astrai.inference.engine_lora import LoRAMethods
from astrai.inference.errors import (
    EngineBusyError,
    EngineDeadError,
    LoRAError,
    LoRANotFoundError,
    RequestFailedError,
)
from astrai.inference.fast_paths import verify_at_start as verify_fast_paths
from astrai.inference.grammar import TokenizerView, new_matcher
from astrai.inference.handle import RequestHandle
from astrai.inference.layout import layout_difference, served_model, should_fuse
from astrai.inference.outputs import Completion, Delta
from astrai.inference.params import SamplingParams
from astrai.inference.plan import ScheduledSeq
from astrai.inference.pool import PagePool
from astrai.inference.radix import RadixCache
from astrai.inference.runner import Launched, ModelRunner
from astrai.inference.scheduler import Scheduler
from astrai.inference.seq import needs_outputs, split_n
from astrai.inference.tp import RankFailedError, TPRunner, tp_devices
from astrai.io.model import Model
from astrai.models.decoder import DecoderParams
from astrai.models.tp import tp_config
from astrai.openmp import release_idle_threads

__all__ = [
    "Engine",
    "EngineBusyError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "LoRAError",
    "LoRANotFoundError",
    "RequestFailedError",
]

logger = logging.getLogger(__name__)


class Engine(LoRAMethods, GrammarMethods):
    """Continuous-batching inference over a paged KV pool with a radix prefix cache."""

    def __init__(self, model: Model, config: EngineConfig | None = None) -> None:
        self.model, self.config = model, config or EngineConfig()
        cfg = self.config
        self.max_model_len = cfg.max_model_len or model.config.max_position_embeddings
        tp_size = cfg.tensor_parallel_size
        # under tensor parallel every rank holds the KV of its own heads: size the pool from one rank's share
        device = tp_devices(tp_size)[0] if tp_size > 1 else model.device
        kv_cfg = tp_config(model.config, tp_size) if tp_size > 1 else model.config
        # the served tree: the model's own or a fused copy (made before the pool), unconfirmed GPU paths checked
        self._fuse = should_fuse(model, cfg.fuse_projections and not cfg.enable_lora, tensor_parallel=tp_size > 1)
        self._fuse, self._served = verify_fast_paths(model, served_model(model, self._fuse), cfg)
        self.adapters: Adapters | None = None  # multi-LoRA: slots in the served tree, before the pool is sized
        if cfg.enable_lora:  # under tensor parallel the slots sit on each rank's shard (`TPRunner`)
            self._served, self.adapters = serve_adapters(model, self._served, cfg, slots=tp_size == 1)
        # speculation with a draft model: its K/V sits beside the target's, page for page (`astrai.inference.draft`)
        draft = load_draft(cfg.speculative.draft_model, model) if cfg.speculative_method == "draft" else None
        per_token = kv_bytes_per_token(kv_cfg, model.dtype) + draft_kv_bytes(draft)
        num_pages = kv_pool_pages(cfg, model, device, per_token, self.max_model_len)
        self.max_model_len = pool_max_model_len(self.max_model_len, num_pages, cfg.page_size,
                                                explicit=cfg.max_model_len is not None)  # fmt: skip
        self.pool = PagePool(num_pages, cfg.page_size)
        self.radix = RadixCache(self.pool) if cfg.prefix_cache else None
        self.scheduler = Scheduler(self.pool, self.radix, max_running=cfg.max_running,
                                   max_step_tokens=cfg.max_step_tokens, max_model_len=self.max_model_len,
                                   policy=cfg.scheduling_policy)  # fmt: skip
        self.scheduler.adapters = self.adapters
        self.scheduler.speculate_with(cfg.speculative)
        rows = cfg.max_running * (1 + (cfg.speculative.num_speculative_tokens if cfg.speculative else 0))  # decode rows
        runner_kw = dict(num_pages=num_pages, page_size=cfg.page_size, compile=cfg.compile, max_running=rows,
                         compile_prefill=cfg.resolved_compile_prefill(device.type), max_model_len=self.max_model_len,
                         cuda_graphs=cfg.cuda_graphs, pack_weights=cfg.pack_weights)  # fmt: skip
        self.fatal: str | None = None  # why the engine cannot run any more (a tensor-parallel rank died)
        if tp_size > 1:
            slots = (cfg.max_loras, cfg.max_lora_rank) if cfg.enable_lora else None
            self.runner = TPRunner(model, size=tp_size, on_failure=self._rank_failed, lora_slots=slots, **runner_kw)
            if self.adapters is not None:
                self.adapters.write = self.runner.write_slot
        else:
            self.runner = ModelRunner(self._served, **runner_kw)
        self.draft = DraftProposer.start(draft, runner_kw, model.config.vocab_size, cfg.speculative, cfg.max_running)
        self.cores = shared_cores(device, tp_size, cfg.share_cpu_cores)  # CPU: step threads follow free cores
        self._rng, self._arrival = random.Random(cfg.seed), itertools.count()
        self._tracked: dict[str, RequestDelivery] = {}
        self._inbox, self._aborts = [], []  # RequestDelivery to admit, request ids to abort (engine thread)
        self._cv, self._grammar_lock = threading.Condition(), threading.Lock()
        self._stop, self._error = False, None
        self._generated, self._rate = 0, 0.0
        # overlap schedule: the step launched but not yet collected (its plan, its launch, when it was launched)
        self._pending: tuple[list[ScheduledSeq], Launched, float] | None = None
        self._grammar_view: TokenizerView | None = None
        self._thread = None
        if cfg.background:
            self._thread = threading.Thread(target=self._loop, name="astrai-engine", daemon=True)
            self._thread.start()
            release_idle_threads()  # this thread's OpenMP pool would cut the engine thread's spin (astrai.openmp)

    def _rank_failed(self, message: str) -> None:
        self.fatal = message
        self._fail(RuntimeError(message))

    # ---- submission -------------------------------------------------------------------------------------
    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        lora: str | None = None,
    ) -> RequestHandle:
        """Queue a request (text is encoded with the tokenizer, special tokens added); `lora` names a loaded
        adapter (`load_lora`) to generate with.

        Raises:
            EngineInputError: (a ValueError; `param` names the field) bad prompt or params, prompt + max_tokens
                beyond the context (both numbers given), or n larger than the whole waiting queue;
                `LoRANotFoundError` for an adapter name that is not loaded.
            EngineBusyError: the waiting queue has no room for the request's n sequences.
            EngineDeadError: the engine stopped after an error.
        """
        params = params or SamplingParams()
        ids = encode_prompt(self.model, prompt)
        check_request(ids, params, self.config, max_model_len=self.max_model_len, num_pages=self.pool.num_pages,
                      vocab_size=self.model.config.vocab_size)  # fmt: skip
        grammar = self.compile_grammar(params.grammar) if params.grammar is not None else None
        request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                       else frozenset(self.model.eos_token_ids))  # fmt: skip
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        seqs = split_n(ids, params, request_id, seed, next(self._arrival), stop_ids)
        if self.config.speculative is not None:
            speculative.attach(seqs, self.config.speculative)
        if grammar is not None:
            for seq in seqs:
                seq.matcher = new_matcher(grammar)
        adapter = None if lora is None else self._lora_on("model").pin(lora, len(seqs))
        for seq in seqs:
            seq.adapter = adapter
        handle = RequestHandle(request_id, abort=self.abort, loop=loop,
                               step=None if self.config.background else self.step)  # fmt: skip
        tracked = RequestDelivery(handle, seqs, self.model.tokenizer, time.perf_counter())
        try:
            with self._cv:
                if self._error is not None:
                    raise EngineDeadError(f"the engine stopped after an error: {self._error}")
                if request_id in self._tracked:
                    raise ValueError(f"request id {request_id!r} is already in use")
                waiting = self._waiting_seqs()
                if waiting + params.n > self.config.max_waiting:
                    raise EngineBusyError(f"{waiting} sequences are already waiting (at most "
                                          f"{self.config.max_waiting}), no room for n={params.n}")  # fmt: skip
                self._tracked[request_id] = tracked
                self._inbox.append(tracked)
                self._cv.notify()
        except Exception:
            for _ in seqs if adapter is not None else ():
                self.adapters.unpin(adapter)
            raise
        return tracked.handle

    def _waiting_seqs(self) -> int:
        """Sequences queued: the scheduler's waiting ones and the inbox's requests' (exact under _cv)."""
        return len(self.scheduler.waiting) + sum(len(tracked.seqs) for tracked in self._inbox)

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op if it already finished)."""
        if not self.config.background:
            self._abort_now(request_id)
            return
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    # ---- convenience ---------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[Completion]:  # fmt: skip
        """Submit a batch and wait for all of it; completions in prompt order. `lora`: one adapter name for every
        prompt, or one per prompt (None: the base model)."""
        plist = params if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        names = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        handles = [self.submit(p, q, lora=a) for p, q, a in zip(prompts, plist, names, strict=True)]
        if self.config.background:  # this thread waits: its idle OpenMP threads would slow the engine's (openmp.py)
            release_idle_threads()
        return [h.result() for h in handles]

    def run_batch(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Generate for token-id prompts (RL rollouts): completions carry token ids and, if asked, logprobs."""
        return self.generate(list(prompt_ids), params)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[Delta]:
        """Submit one request and iterate its deltas (blocking)."""
        handle = self.submit(prompt, params)
        try:
            yield from handle
        finally:
            if handle.completion is None:
                handle.abort()

    async def astream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        """Submit one request from an event loop and iterate its deltas; cancelling aborts the request."""
        if not self.config.background:
            raise RuntimeError("astream needs EngineConfig(background=True)")
        handle = self.submit(prompt, params, loop=asyncio.get_running_loop())
        try:
            async for delta in handle:
                yield delta
        finally:
            if handle.completion is None:
                handle.abort()

    # ---- weights (RL: the trainer's tensors, read in place) ------------------------------------------------
    def update_params(self, params: DecoderParams | None = None) -> None:
        """Generate with `params` from now on (the tensors themselves: no copy, no reload), then drop the prefix
        cache (`invalidate_prefix_cache`). Without `params`, the tensors already served were changed in place (an
        optimizer step): only the cache goes. Call it when no request is in flight (e.g. between rollouts).

        Raises:
            ValueError: `params` differs from the served tree in structure, shape, stride, dtype or device.
            RuntimeError: requests are in flight, or the engine is tensor parallel (its ranks hold copies).
        """
        if isinstance(self.runner, TPRunner) or self.adapters is not None:
            raise RuntimeError("a tensor-parallel or multi-LoRA engine does not take new weights: its ranks hold "
                               "their own shards, its adapter slots sit on the served tree")  # fmt: skip
        if params is not None and (why := layout_difference(self.model.params, params)) is not None:
            raise ValueError(f"update_params needs a tree of the served structure, shapes, strides, dtypes and "
                             f"device: {why}")  # fmt: skip
        self.invalidate_prefix_cache()  # refuses while requests are in flight
        if params is not None:
            self.model = attrs.evolve(self.model, params=params)
            self._served = served_model(self.model, self._fuse, into=self._served)
            self.runner.set_model(self._served)
        else:
            served_model(self.model, self._fuse, into=self._served)  # fused copies: the new values, in place
            self.runner.refresh_weights()

    def invalidate_prefix_cache(self) -> None:
        """Forget every cached prefix (its K/V was computed with the old weights); the next prompt recomputes."""
        self._settle()
        with self._cv:
            if self._inbox or self.scheduler.has_work():
                raise RuntimeError("the weights changed while requests are in flight: wait for them first")
            if self.radix is not None:
                self.radix.reset()

    def _settle(self) -> None:
        """Let a step the overlap schedule queued ahead finish (once requests are done it holds only finished
        sequences), so that weights, graphs and cache change only while the device is idle."""
        if self.config.background:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is None or self._error is not None, timeout=60)
        elif self._pending is not None:
            pending, self._pending = self._pending, None
            self._collect(*pending)

    @property
    def unavailable(self) -> str | None:
        """Why the engine can serve no request any more (None while it can): its thread stopped after an error, a
        tensor-parallel rank died, or it was shut down. The server's /health answers 503 with it."""
        if self._error is not None:
            return f"the engine stopped after an error: {self._error}"
        if self.fatal is not None:
            return self.fatal
        if self._stop:
            return "the engine was shut down"
        if self._thread is not None and not self._thread.is_alive():
            return "the engine thread is not running"
        return None

    def stats(self) -> EngineStats:
        """Counters and KV usage (read without stopping the engine; may be one step stale)."""
        cached = self.radix.num_cached_pages if self.radix is not None else 0
        s, spec = self.scheduler.stats, self.scheduler.spec_stats
        lora = self.adapters.stats(self.scheduler.waiting) if self.adapters is not None else {}
        return EngineStats(
            spec_drafts=spec.drafts, spec_draft_tokens=spec.draft_tokens, spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_hist=tuple(spec.accepted_hist), **lora,
            running=len(self.scheduler.running), waiting=self._waiting_seqs(),
            kv_pages_total=self.pool.num_pages - 1, kv_pages_used=self.pool.num_used - cached,
            kv_pages_cached=cached, kv_pages_free=self.pool.num_free,
            prefix_hit_rate=self.radix.hit_rate if self.radix is not None else 0.0,
            prompt_tokens=s.prefill_tokens, generated_tokens=s.decode_tokens, generation_tokens_per_s=self._rate,
            preemptions=s.preemptions, steps=s.steps, page_size=self.config.page_size,
            prefix_cache=self.radix is not None,
        )  # fmt: skip

    def shutdown(self) -> None:
        """Stop the engine thread; unfinished requests end with finish_reason "abort"."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        else:
            for request_id in list(self._tracked):
                self._abort_now(request_id)
        if isinstance(self.runner, TPRunner):
            self.runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- the engine thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._wait_for_work():
                self._run_step()
                if self.cores is not None:
                    self.cores.after_step()
                if self._pending is None and self.config.overlap_schedule:
                    with self._cv:
                        self._cv.notify_all()  # _settle may be waiting for the device to go idle
        except RankFailedError:  # reported through _rank_failed (requests failed, `fatal` set): not a bug
            return
        except Exception as err:  # a bug or a device error: fail every request loudly instead of hanging them
            self._fail(err)
            raise
        for request_id in list(self._tracked):  # shutdown: end what is left
            self._abort_now(request_id)

    def step(self) -> bool:
        """Run one step on the calling thread (engines with background=False); False when there is no work."""
        if self.config.background:
            raise RuntimeError("this engine steps on its own thread (EngineConfig.background=True)")
        with self._cv:
            if not (self._inbox or self._aborts or self._pending or self.scheduler.has_work()):
                return False
        try:
            self._run_step()
        except Exception as err:
            self._fail(err)
            raise
        if self.cores is not None:
            self.cores.after_step()
        return True

    def restore_threads(self) -> None:
        """Give the stepping thread back the torch thread count it had (`EngineConfig.share_cpu_cores` may have
        lowered it while another program held a core): `astrai.generate` calls it when a call ends."""
        if self.cores is not None:
            self.cores.restore()

    def _fail(self, err: Exception) -> None:
        with self._cv:
            self._error = f"{type(err).__name__}: {err}"
            failed = list(self._tracked.values())
            self._tracked.clear()
        for tracked in failed:
            tracked.handle.put(EngineDeadError(f"the engine stopped after an error: {self._error}"))

    def _wait_for_work(self) -> bool:
        with self._cv:
            while not (self._inbox or self._aborts or self._stop or self._pending or self.scheduler.has_work()):
                self._cv.wait()
            return not self._stop

    def _run_step(self) -> None:
        with self._cv:
            inbox, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
        for tracked in inbox:
            self.scheduler.add(tracked.seqs)
        for request_id in aborts:
            self._abort_now(request_id)
        pending, self._pending = self._pending, None
        if pending is not None and any(item.sample and needs_outputs(item.seq) for item in pending[0]):
            self._collect(*pending)  # its sequences' next draw reads their tokens on the host
            pending = None
        plan = self.scheduler.schedule()
        if not plan:
            if pending is not None:
                self._collect(*pending)  # the tokens it brings may let the next step run
            elif self.scheduler.waiting and not self.scheduler.running:
                # nothing runs and the queue's head cannot be admitted: no later step can change that, so fail
                # every request loudly (EngineDeadError) instead of spinning on empty steps forever
                head = self.scheduler.waiting[0]
                raise RuntimeError(f"the scheduler cannot admit request {head.id} (sequence {head.index}) with "
                                   f"nothing running: {self.pool.num_free} free KV pages")  # fmt: skip
            return
        if self.cores is not None:
            self.cores.before_step()
        vocab, start = self.model.config.vocab_size, time.perf_counter()
        if self.config.overlap_schedule:  # queue this step, then read the one before while the device runs it
            self._pending = (plan, self.runner.launch(plan, vocab_size=vocab, previous=pending and pending[1]), start)
            if pending is not None:
                self._collect(*pending)
            return
        if self.draft is not None:  # the draft model's guesses, the target's verify step, the draft's K/V
            plan, sampled = self.draft.execute(plan, self.runner, vocab)
            return self._finish(plan, sampled, start)
        self._finish(plan, self.runner.execute(plan, vocab_size=vocab), start)

    def _collect(self, plan: list[ScheduledSeq], launched: Launched, start: float) -> None:
        self._finish(plan, self.runner.collect(launched), start)

    def _finish(self, plan: list[ScheduledSeq], sampled: dict, start: float) -> None:
        self.scheduler.update(plan, sampled)
        self._rate = 0.9 * self._rate + 0.1 * len(sampled) / max(time.perf_counter() - start, 1e-9)
        self._deliver({item.seq.id for item in plan})

    def _deliver(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            failed = next((seq for seq in tracked.seqs if seq.error is not None), None)
            if failed is not None:  # its grammar has no way forward: that request alone ends, with the reason
                param = failed.params.grammar.param if failed.params.grammar is not None else None
                self._fail_request(request_id, f"{param}: {failed.error}" if param else failed.error, param)
                if failed.matcher is not None:
                    failed.matcher.grammar.forget()  # the next request compiles it afresh
                continue
            try:
                done = tracked.deliver(self.scheduler.finish)
            except Exception:  # a bug in one request's detokenization or stop strings: not the others' problem
                logger.exception("request %s: delivery failed; ending that request", request_id)
                self._fail_request(request_id, "internal error while delivering this request's output", None)
                continue
            if done:
                self._tracked.pop(request_id).complete(request_id)

    def _fail_request(self, request_id: str, message: str, param: str | None) -> None:
        """End one request with `RequestFailedError` after what it streamed: its unfinished sequences are aborted
        (their KV freed); the engine goes on with the others."""
        with self._cv:
            tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self.scheduler.abort(tracked.seqs)
            tracked.handle.put(RequestFailedError(message, param=param))

    def _abort_now(self, request_id: str) -> None:
        with self._cv:
            tracked = self._tracked.pop(request_id, None)
            if tracked is None:
                return
            if tracked in self._inbox:  # submitted but not yet handed to the scheduler (background=False)
                self._inbox.remove(tracked)
        self.scheduler.abort(tracked.seqs)
        tracked.end_unfinished_streams()
        tracked.complete(request_id)

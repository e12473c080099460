"""Continuous-batching scheduler with a per-step token budget (vLLM V1 style). Host Python, no tensors.

Each `schedule()` call builds one step:
1. every running sequence gets its next tokens (1 for decode, a chunk for an unfinished prefill), oldest first,
   as long as the step's token budget lasts; a sequence whose next tokens need a page the pool can't give
   preempts the newest running sequence (recompute: its pages are released, its generated tokens kept, it goes
   back to the front of the queue) — never a crash;
2. waiting sequences are admitted strictly in order while budget, free KV and the running cap allow: the prefix
   cache supplies the longest cached full-page prefix, the rest is prefilled in chunks.
"Oldest", "newest" and "in order" are `Scheduler.order`: arrival under the "fcfs" policy (FIFO), and
(`SamplingParams.priority`, arrival) under "priority" (vLLM's `--scheduling-policy priority`: a lower value is
admitted first, planned first and preempted last; an urgent request waits for KV pages to free up rather than
preempting a running one, as vLLM's V1 admission does).
`update()` then advances every scheduled sequence, appends sampled tokens and finishes sequences.

The scheduler is the only writer of a sequence's `status` and `finish_reason`: token-id stops, a finished grammar
(the accepted token advances a constrained sequence's matcher; when nothing but EOS can follow, the sequence ends
with "stop" at once, without sampling the EOS; a failed matcher ends it with "error"), and length end sequences in
`update`, a stop string found by the engine's text stage ends one through `finish`, and a cancellation through
`abort`.

Pages are cached in the radix as soon as their K/V are fully computed (at prefill completion, on preemption
and at finish), so concurrent requests with a shared prefix and the n > 1 siblings of a request reuse them.

Speculative decoding (`propose` set by the engine): a decoding sequence that gets guesses from the proposer is
planned with them (`ScheduledSeq.draft`: its last token and k guesses, k + 1 sampled positions, all counted
against the step's token budget). `update` keeps the guesses the target's draws confirm plus the first draw that
differs (`speculative.coupled_accept`'s rule), checks stops token by token, and rolls the rest back: `num_computed`
returns to the last kept token and the pages past it go back to the pool, so a rejected guess leaves no trace
(the radix only ever caches `all_tokens[:num_computed]`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from astrai.inference.adapters import Adapters
from astrai.inference.grammar import accept, error_summary, is_finished, matcher_error, valid_prefix
from astrai.inference.plan import SampledToken, ScheduledSeq
from astrai.inference.pool import PagePool
from astrai.inference.radix import RadixCache
from astrai.inference.seq import Seq, Status
from astrai.inference.speculative import PENDING, SpecStats, SpeculativeConfig, proposer
from astrai.ops.attention import pages_needed

logger = logging.getLogger(__name__)


@attrs.define
class SchedulerStats:
    """Counters since start."""

    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0


class Scheduler:
    """Decides, step by step, which tokens of which sequences run; owns the page bookkeeping."""

    def __init__(self, pool: PagePool, radix: RadixCache | None, *, max_running: int, max_step_tokens: int,
                 max_model_len: int, policy: str = "fcfs") -> None:  # fmt: skip
        if max_step_tokens < max_running:
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must be >= max_running ({max_running})")
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        self.policy = policy
        self.pool, self.radix = pool, radix
        self.page_size = pool.page_size
        self.max_running, self.max_step_tokens, self.max_model_len = max_running, max_step_tokens, max_model_len
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.stats = SchedulerStats()
        # speculative decoding: guesses for a decoding sequence, at most the given count (None: no speculation)
        self.propose: Callable[[Seq, int], Sequence[int]] | None = None
        self.spec_pause_at: int | None = None  # no guesses while this many sequences run (disable_by_batch_size)
        self.spec_stats = SpecStats()
        self.adapters: Adapters | None = None  # multi-LoRA serving: the adapter slots (`astrai.inference.adapters`)

    # ---- queue management ----------------------------------------------------------------------------
    def order(self, seq: Seq) -> tuple[int, int, int]:
        """The sequence's place in every ordering: (priority under the "priority" policy, else 0; arrival; index
        within its request). Lower goes first: admitted first, scheduled first, preempted last."""
        return (seq.params.priority if self.policy == "priority" else 0, seq.arrival, seq.index)

    def _enqueue(self, seq: Seq) -> None:
        """Insert into `waiting` by `order` (ahead of everything that orders after it)."""
        key = self.order(seq)
        at = next((i for i, s in enumerate(self.waiting) if self.order(s) > key), len(self.waiting))
        self.waiting.insert(at, seq)

    def add(self, seqs: list[Seq]) -> None:
        """Queue the sequences of one request (already validated by the engine)."""
        if self.policy == "fcfs":  # arrivals only grow: the end of the queue is their place
            self.waiting.extend(seqs)
        else:
            for seq in seqs:
                self._enqueue(seq)

    def abort(self, seqs: list[Seq]) -> None:
        """End every unfinished sequence of `seqs` with "abort" (queued here or not yet added); frees their pages."""
        for seq in seqs:
            if seq.finished:
                continue
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self._release(seq, cache=False)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
            self._unpin(seq)

    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    # ---- pages -----------------------------------------------------------------------------------------
    def _grow(self, seq: Seq, num_tokens: int) -> bool:
        """Give `seq` pages for its first `num_tokens` tokens; False (nothing changed) if the pool is short."""
        missing = pages_needed(num_tokens, self.page_size) - len(seq.pages)
        if missing <= 0:
            return True
        pages = self.pool.alloc(missing)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _cache(self, seq: Seq) -> None:
        """Record the fully computed pages of `seq` in the prefix cache and adopt the cache's copies.

        Where a prefix was already cached (two requests prefilled the same prompt in one step), `seq` swaps its
        duplicate pages for the cached ones, which hold the same K/V, and frees its own (as SGLang's
        `cache_unfinished_req`): otherwise the duplicates and the pinned cached pages would both stay
        allocated, and a request that fits the pool alone could find it short.
        """
        # tokens planned in a step still running count (a later step that reads the pages runs after it), but not
        # an in-flight token whose value the host does not know yet
        done = min(seq.num_computed, seq.num_tokens)
        if self.radix is None or done < self.page_size:
            return
        tokens = seq.all_tokens[:done]
        self.radix.insert(tokens, seq.pages, seq.cache_key)
        cached = self.radix.cached_pages(tokens, seq.cache_key)
        duplicates = [i for i, page in enumerate(cached) if seq.pages[i] != page]
        if duplicates:
            self.pool.incref([cached[i] for i in duplicates])
            self.pool.decref([seq.pages[i] for i in duplicates])
            for i in duplicates:
                seq.pages[i] = cached[i]

    def _release(self, seq: Seq, *, cache: bool) -> None:
        if cache:
            self._cache(seq)
        self.pool.decref(seq.pages)
        seq.pages = []
        if seq.lora_slot >= 0:  # leaving the running set: its adapter slot may serve another adapter now
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = -1

    def _unpin(self, seq: Seq) -> None:
        """A sequence ended: its adapter's host copy may go (`Adapters.unpin`)."""
        if seq.adapter is not None and self.adapters is not None:
            self.adapters.unpin(seq.adapter)

    def _preempt(self, victim: Seq) -> None:
        """Recompute preemption: keep the generated tokens, drop the K/V (cached pages may survive in the radix)."""
        self.running.remove(victim)
        self._release(victim, cache=True)
        victim.num_computed = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.stats.preemptions += 1
        # back to the queue in its order, ahead of everything that arrived later; within a request by index, so
        # an n > 1 leader goes back ahead of its followers (behind them, a follower at the head waits for the
        # leader's prefill, the leader waits behind it: strict FIFO would never admit either)
        self._enqueue(victim)

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        """Plan the next step (may preempt); an empty list when nothing can run.

        Planning commits the step: each planned sequence's `num_computed` moves past its new tokens and, if it
        samples, `in_flight` counts the token to come (`update` appends it). A sequence whose in-flight token is
        its last (`max_tokens`) is not planned: `update` will end it with "length".
        """
        budget, plan = self.max_step_tokens, []
        pause = self.spec_pause_at is not None and len(self.running) >= self.spec_pause_at
        speculate = self.propose is not None and not pause
        for seq in sorted(self.running, key=self.order):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            if seq.in_flight and len(seq.outputs) + seq.in_flight >= seq.params.max_tokens:
                continue
            n = min(seq.num_tokens + seq.in_flight - seq.num_computed, budget)
            draft = self._draft(seq, budget) if n == 1 and speculate else ()
            if draft and not self._grow(seq, seq.num_computed + 1 + len(draft)):
                draft = ()  # no pages for the guesses: decode plainly rather than preempt for them
            n += len(draft)
            while not self._grow(seq, seq.num_computed + n):
                victim = max((s for s in self.running if s is not seq), key=self.order, default=None)
                if victim is None:  # alone and still short: impossible after admission checks, but never hang
                    raise RuntimeError(f"request {seq.id} needs more KV pages than the pool holds")
                for p in plan:
                    if p.seq is victim:  # planned earlier in this step: give its budget back, uncount its token
                        budget += p.num_new
                        victim.in_flight -= p.sample
                plan = [p for p in plan if p.seq is not victim]
                self._preempt(victim)
            plan.append(self._commit(seq, n, draft))
            budget -= n
        plan += self._admit(budget)
        self.stats.steps += bool(plan)
        return plan

    @staticmethod
    def _commit(seq: Seq, n: int, draft: tuple[int, ...] = ()) -> ScheduledSeq:
        """Plan `n` new tokens of `seq` (the step samples when they reach its end) and advance it past them; with
        a `draft`, the last `len(draft)` of them are the guesses."""
        end = seq.num_tokens + seq.in_flight + len(draft)
        item = ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == end, draft)
        seq.num_computed += n
        seq.in_flight += item.sample
        return item

    def speculate_with(self, config: SpeculativeConfig | None) -> None:
        """Speculative decoding per `config` (None: off): its proposer and its pause (`disable_by_batch_size`)."""
        self.propose = proposer(config) if config is not None else None
        self.spec_pause_at = config.disable_by_batch_size if config is not None else None

    def _draft(self, seq: Seq, budget: int) -> tuple[int, ...]:
        """The proposer's guesses for a decoding sequence: as many as its adaptive k allows, within the step's
        budget, its `max_tokens` (the last token is always a draw) and the model's length; none for a sequence
        with a token in flight. A constrained sequence keeps the guesses its grammar allows (`valid_prefix`; a
        draft model's guesses are cut once made, `DraftProposer.fill`), and guesses only while its budget is far
        from the window where budget-aware closing may force tokens (`closing.Steering`)."""
        if seq.spec is None or seq.in_flight:
            return ()
        room = min(seq.params.max_tokens - len(seq.outputs) - 1, budget - 1, self.max_model_len - seq.num_tokens - 1)
        if seq.matcher is not None:
            steering = seq.steering  # set by the first constrained draw; its window is fixed from then on
            if steering is None or steering.window is None or steering.path:
                return ()
            room = min(room, seq.params.max_tokens - len(seq.outputs) - steering.window - 1)
        k = min(seq.spec.next_k(), room)
        if k <= 0:
            return ()
        guesses = tuple(self.propose(seq, k))[:k]
        if seq.matcher is not None and guesses and guesses[0] != PENDING:
            guesses = guesses[: valid_prefix(seq.matcher, guesses)]
        return guesses

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        """Admit waiting sequences in order. One whose adapter finds no free slot (every slot held by running
        sequences of other adapters) waits in its place and lets the sequences behind it pass; anything else that
        cannot be admitted (pages, an n > 1 leader's prefill) stops admission for this step."""
        plan, at = [], 0
        while at < len(self.waiting) and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[at]
            if seq.adapter is not None and seq.lora_slot < 0:
                seq.lora_slot = self.adapters.acquire(seq.adapter)
                if seq.lora_slot < 0:
                    at += 1
                    continue
            if seq.leader is not None and not self._leader_ready(seq.leader):
                self._release(seq, cache=False)  # gives the slot back; it holds no pages yet
                break  # strict FIFO: its prompt KV will be shareable once the leader's prefill is done
            hit_pages = self._match(seq)
            n = min(seq.num_tokens + seq.in_flight - seq.num_computed, budget)
            if not self._grow(seq, seq.num_computed + n):
                self._release(seq, cache=False)
                seq.num_computed = 0
                break
            del self.waiting[at]
            seq.status = Status.RUNNING
            if seq.num_cached < 0:
                seq.num_cached = hit_pages * self.page_size
                seq.scheduled_at = time.perf_counter()
            self.running.append(seq)
            plan.append(self._commit(seq, n))
            budget -= n
        return plan

    @staticmethod
    def _leader_ready(leader: Seq) -> bool:
        # the leader's prompt K/V is cached (not merely scheduled) and not dropped by a preemption since
        return leader.finished or (leader.prompt_cached and leader.num_computed >= len(leader.prompt))

    def _match(self, seq: Seq) -> int:
        """Take the cached prefix pages of `seq` (at least one token is always left to compute, for its logits)."""
        if self.radix is None:
            return 0
        pages = self.radix.match(seq.all_tokens[: seq.num_tokens - 1], seq.cache_key)
        self.pool.incref(pages)
        seq.pages, seq.num_computed = list(pages), len(pages) * self.page_size
        return len(pages)

    def update(self, plan: list[ScheduledSeq], sampled: dict[int, SampledToken]) -> list[Seq]:
        """Record a step that ran; `sampled[i]` is the token drawn for plan entry i (entries that sample).

        A sequence preempted after this step was planned (the overlap schedule plans the next step first) still
        takes its token: it was drawn from the right context, and recompute keeps generated tokens. One that
        ended meanwhile (abort, a stop string, a stop token of the step before) drops it.

        Returns the sequences that finished in this step (their pages are released and cached).
        """
        finished = []
        for i, item in enumerate(plan):
            seq = item.seq
            if seq.finished:
                continue
            if item.draft:
                if self._update_speculative(item, sampled[i]):
                    finished.append(seq)
                continue
            end = item.start + item.num_new
            self.stats.prefill_tokens += max(0, min(end, len(seq.prompt)) - item.start)
            if item.sample:
                seq.in_flight -= 1
                token = self._append(seq, sampled[i])
            if item.start < len(seq.prompt) <= end and seq.status is Status.RUNNING:
                self._cache(seq)  # prompt fully computed: shareable now (n > 1 siblings, shared system prompts)
                seq.prompt_cached = True
            if not item.sample:
                continue
            reason = seq.check_stop() if seq.matcher is None else self._grammar_stop(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _append(self, seq: Seq, drawn: SampledToken) -> int:
        """Add a drawn token (and its logprobs, when asked) to `seq`'s outputs; returns the token."""
        token, logprob, top = drawn  # a NamedTuple, unpacked: the per-row hot path
        self.stats.decode_tokens += 1
        seq.outputs.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if top is not None:
            seq.top_logprobs.append(top)
        return token

    def _update_speculative(self, item: ScheduledSeq, draws: Sequence[SampledToken]) -> bool:
        """Keep the confirmed guesses and the first differing draw, token by token with their stops; roll the
        rest back. True when the sequence finished."""
        seq, draft = item.seq, item.draft
        seq.in_flight -= 1
        accepted = 0
        while accepted < len(draft) and draws[accepted].token == draft[accepted]:
            accepted += 1
        seq.spec.update(len(draft), accepted)
        self.spec_stats.record(len(draft), accepted)
        for drawn in draws[: accepted + 1]:
            token = self._append(seq, drawn)
            reason = seq.check_stop() if seq.matcher is None else self._grammar_stop(seq, token)
            if reason is not None:
                seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)  # no K/V past the kept tokens
                self.finish(seq, reason)
                return True
        seq.num_computed = item.start + 1 + accepted  # the last token and the confirmed guesses have K/V
        keep = pages_needed(seq.num_computed + 1, self.page_size)
        if len(seq.pages) > keep:  # the rejected guesses' pages go back to the pool
            self.pool.decref(seq.pages[keep:])
            del seq.pages[keep:]
        return False

    @staticmethod
    def _grammar_stop(seq: Seq, token: int) -> str | None:
        """Advance a constrained sequence's matcher by `token`: "stop" once the grammar is finished, else the usual
        check. The sampler only draws allowed tokens, so a refused one means a broken matcher (a parser limit, or
        a state no token continues): the sequence ends with "error" (`Seq.error` says why; its request fails
        alone), never "stop", since its output does not satisfy the grammar. So does one whose runner found its
        matcher failed before sampling (`Seq.error` already set)."""
        if seq.error is not None:
            return "error"
        if not accept(seq.matcher, token) or matcher_error(seq.matcher) is not None:
            why = matcher_error(seq.matcher)
            seq.error = (f"the grammar refused token {token} after {len(seq.outputs) - 1} token(s): "
                         f"{error_summary(why) if why else 'not allowed'}")  # fmt: skip
            logger.warning("request %s: %s; ending the request", seq.id, seq.error)
            return "error"
        return "stop" if is_finished(seq.matcher) else seq.check_stop()

    def finish(self, seq: Seq, reason: str) -> None:
        """End a sequence with `reason` (the engine calls it when a stop string completes).

        A sequence that already finished in this step (eos or length on the same token) keeps its released
        pages and only takes the new reason: a stop string wins over whatever else ended the sequence.
        """
        if seq.finished:
            seq.finish_reason = reason
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._release(seq, cache=True)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self._unpin(seq)

"""`Seq`: the engine's host state of one generated sequence (a request with n > 1 is n of them).

A sequence's progress is one number, `num_computed`: how many of its tokens (prompt, then generated) have K/V in
the pool or in a step already scheduled (vLLM V1's model: the scheduler advances it when it plans the step). Each
step feeds `all_tokens[num_computed : num_computed + n]`; when that reaches the end, the step's logits sample the
next token. Chunked prefill, prefix-cache hits (num_computed starts at the hit length) and recompute after
preemption (num_computed back to 0 with the generated tokens kept) are all the same rule.

`in_flight` counts tokens scheduled to be sampled but not yet appended to `outputs`. Without the overlap
schedule it is 1 between `schedule` and `update`, else 0; with it (`astrai.inference.overlap`) the next step is
planned while one is still running, so a decoding sequence's last token may be one the device has not handed back
yet: the step feeds it from the device (a placeholder the runner resolves there).

A constrained sequence (`params.grammar`) holds its own grammar `matcher` (astrai.inference.grammar), advanced by
`Scheduler.update` with every accepted token. It only ever moves forward with `outputs`, so recompute after
preemption (which keeps the outputs) leaves it valid.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from astrai.inference.params import SamplingParams

if TYPE_CHECKING:
    from astrai.inference.closing import Steering
    from astrai.inference.grammar import Matcher


class Status(enum.Enum):
    """Lifecycle of a sequence inside the scheduler (only the scheduler changes it)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Seq:
    """One sequence being generated (a request with n > 1 is n of these, one per completion index).

    Attributes:
        id: the request id (shared by the n completions of one request).
        index: completion index within the request (0..n-1).
        prompt: prompt token ids.
        params: sampling settings.
        seed: seed of this sequence's sampling noise.
        arrival: global admission order (FIFO and preemption order).
        stop_ids: token ids that end this sequence (eos unless ignore_eos, plus params.stop_token_ids).
        outputs: generated token ids (stop tokens included).
        logprobs: chosen-token logprobs, when requested.
        top_logprobs: per position, (token id, logprob) alternatives, when requested.
        pages: KV pool pages in logical order.
        num_computed: tokens whose K/V are in the pool.
        num_cached: prompt tokens served by the prefix cache at the first admission.
        scheduled_at: `time.perf_counter()` seconds of the first admission (None before it): where the request's
            queueing ends (read after the fact by the server's request tracing).
        in_flight: tokens scheduled to be sampled whose value has not reached `outputs` yet (see the module).
        prompt_cached: the prompt's K/V was computed and offered to the prefix cache (n > 1 followers wait for it).
        status: waiting / running / finished (written by the scheduler only).
        finish_reason: "stop", "length", "abort" or "error" once finished (written by the scheduler only).
        leader: for n > 1, the sequence whose prefill the others wait for (so they hit its cached prompt).
        matcher: the grammar matcher of a constrained sequence (its own copy; None when unconstrained).
        error: why the sequence cannot go on (its matcher failed, or its host work raised), set by the runner or
            the scheduler; the scheduler then ends it with "error" and the engine fails its request alone
            (`RequestFailedError`).
    """

    id: str
    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    stop_ids: frozenset[int] = frozenset()
    outputs: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    top_logprobs: list[list[tuple[int, float]]] = attrs.Factory(list)
    pages: list[int] = attrs.Factory(list)
    num_computed: int = 0
    num_cached: int = -1
    scheduled_at: float | None = None
    in_flight: int = 0
    prompt_cached: bool = False
    status: Status = Status.WAITING
    finish_reason: str | None = None
    leader: Seq | None = None
    num_preemptions: int = 0
    matcher: Matcher | None = None
    steering: Steering | None = None  # budget-aware closing of a constrained sequence (created on first use)
    error: str | None = None
    spec: Any = None  # speculative decoding's `AdaptiveK` for this sequence (None: it does not speculate)
    adapter: Any = None  # multi-LoRA serving: its `adapters.Adapter` (None: the base model)
    lora_slot: int = -1  # the adapter slot it holds while running (-1: none)
    _prompt_array: np.ndarray | None = attrs.field(default=None, init=False, repr=False)
    _output_array: np.ndarray = attrs.field(factory=lambda: np.empty(16, np.int64), init=False, repr=False)
    _output_synced: int = attrs.field(default=0, init=False, repr=False)

    @property
    def all_tokens(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.prompt + self.outputs

    def tokens(self, start: int, end: int) -> list[int]:
        """`all_tokens[start:end]` without building `all_tokens` (the engine's per-step hot path)."""
        prompt_len = len(self.prompt)
        if start >= prompt_len:
            return self.outputs[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt[start:end]
        return self.prompt[start:] + self.outputs[: end - prompt_len]

    def prompt_array(self) -> np.ndarray:
        """The prompt as an int64 array, converted once (the sampler's penalties read it every step)."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt, dtype=np.int64)
        return self._prompt_array

    def output_array(self) -> np.ndarray:
        """The generated ids as an int64 array view; only tokens added since the last call are converted, so a
        long generation costs O(1) Python work per step (outputs only ever grow)."""
        n = len(self.outputs)
        if n > self._output_array.shape[0]:
            grown = np.empty(max(n, 2 * self._output_array.shape[0]), np.int64)
            grown[: self._output_synced] = self._output_array[: self._output_synced]
            self._output_array = grown
        if n > self._output_synced:
            self._output_array[self._output_synced : n] = self.outputs[self._output_synced :]
            self._output_synced = n
        return self._output_array[:n]

    @property
    def cache_key(self) -> Any:
        """Its prefix-cache key: the request's `cache_salt`, joined to its adapter's load id when it has one (K/V
        computed under one adapter never serves another, nor the base model)."""
        return self.params.cache_salt if self.adapter is None else ("lora", self.adapter.uid, self.params.cache_salt)

    @property
    def num_tokens(self) -> int:
        """len(prompt) + len(outputs)."""
        return len(self.prompt) + len(self.outputs)

    @property
    def finished(self) -> bool:
        """Whether the request has left the scheduler."""
        return self.status is Status.FINISHED

    def check_stop(self) -> str | None:
        """The finish reason after the newest token, from token ids and length ("stop" / "length"), or None."""
        if self.outputs and len(self.outputs) > self.params.min_tokens and self.outputs[-1] in self.stop_ids:
            return "stop"
        if len(self.outputs) >= self.params.max_tokens:
            return "length"
        return None


def split_n(prompt: Sequence[int], params: SamplingParams, request_id: str, seed: int, arrival: int,
            stop_ids: frozenset[int]) -> list[Seq]:  # fmt: skip
    """The n sequences of one request; sequences 1..n-1 follow sequence 0's prefill to share its prompt KV."""
    seqs = [
        Seq(
            id=request_id,
            index=i,
            prompt=list(prompt),
            params=params,
            seed=seed + i,
            arrival=arrival,
            stop_ids=stop_ids,
        )  # fmt: skip
        for i in range(params.n)
    ]
    for follower in seqs[1:]:
        follower.leader = seqs[0]
    return seqs


def needs_outputs(seq: Seq) -> bool:
    """Whether drawing the sequence's next token reads its generated tokens on the host: penalties (their counts)
    and grammars (the matcher, advanced by each accepted token). The overlap schedule collects the step before
    planning the next one for these."""
    p = seq.params
    return seq.matcher is not None or p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0

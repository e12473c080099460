"""Delivery: turning a request's sampled tokens into stream `Delta`s and its final `Completion` (host Python).

Per sequence, `SeqText` runs incremental detokenization and the stop strings: stop-token ids end a sequence
without adding text (the token stays in `token_ids`); stop strings end it with the text cut before the stop
(or after it with `include_stop_str_in_output`); text that may be the start of a stop string is held back while
streaming. Per request, `RequestDelivery` sends each step's deltas to the `RequestHandle` and, once every
sequence finished, the `Completion`.

Delivery never decides how a sequence ends: a completed stop string is reported to the scheduler (the `finish`
callable), which is the only writer of `finish_reason`; deltas carry the reason the scheduler recorded.
"""

from __future__ import annotations

from collections.abc import Callable

from astrai.inference.handle import RequestHandle
from astrai.inference.outputs import Completion, CompletionOutput, Delta
from astrai.inference.seq import Seq, Status
from astrai.inference.stop import StopStringMatcher
from astrai.io.tokenizer import Tokenizer

PROMPT_CONTEXT = 8  # prompt tokens given to the detokenizer so the first output token decodes in context


class SeqText:
    """Text state of one sequence: what has been emitted, and whether a stop string fired.

    Attributes:
        text: the text emitted so far.
        stopped: a stop string completed (the sequence must end with "stop").
        done: the final delta was delivered.
    """

    def __init__(self, seq: Seq, tokenizer: Tokenizer | None) -> None:
        self.seq, self.text, self.stopped, self.done = seq, "", False, False
        self._emitted_tokens = 0
        self._detok = None
        if tokenizer is not None:
            context = seq.prompt[-PROMPT_CONTEXT:]
            self._detok = tokenizer.detokenizer(skip_special_tokens=seq.params.skip_special_tokens, prompt_ids=context)
        self._stops = StopStringMatcher(seq.params.stop, include_stop=seq.params.include_stop_str_in_output)

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stops.matched if self.stopped else None

    def advance(self) -> tuple[str, list[int], int]:
        """Consume the sequence's tokens not yet emitted.

        Returns:
            (new text, new token ids, index of the first new token in `seq.outputs`). Sets `stopped` when a stop
            string completed. A finished sequence's held-back text is flushed.
        """
        seq = self.seq
        first = self._emitted_tokens
        new = seq.outputs[first:]
        self._emitted_tokens = len(seq.outputs)
        text = ""
        if self._detok is not None and not self.stopped:
            for j, token in enumerate(new):
                if seq.finish_reason == "stop" and token == seq.outputs[-1] and token in seq.stop_ids:
                    break  # the stop token itself adds no text
                piece, self.stopped = self._stops.feed(self._detok.add(token))
                text += piece
                if self.stopped:  # a step that kept several tokens (speculation) drops those after the stop
                    new = _truncate(seq, first + j + 1, new[: j + 1])
                    self._emitted_tokens = len(seq.outputs)
                    break
            if seq.finished and not self.stopped:
                piece, self.stopped = self._stops.feed(self._detok.flush())
                text += piece + ("" if self.stopped else self._stops.flush())
        self.text += text
        return text, new, first


def _truncate(seq: Seq, length: int, new: list[int]) -> list[int]:
    """Cut `seq`'s outputs (and their logprobs) to `length` tokens; returns `new` (its kept new tokens)."""
    del seq.outputs[length:]
    del seq.logprobs[length:]
    del seq.top_logprobs[length:]
    return new


class RequestDelivery:
    """A request in flight on the engine side: its handle, its sequences and their text states."""

    def __init__(self, handle: RequestHandle, seqs: list[Seq], tokenizer: Tokenizer | None, submitted: float) -> None:
        self.handle, self.seqs, self.submitted = handle, seqs, submitted
        handle.submitted, handle.seqs = submitted, tuple(seqs)  # its times, for the caller to read after the fact
        self.texts = [SeqText(seq, tokenizer) for seq in seqs]

    def deliver(self, finish: Callable[[Seq, str], None]) -> bool:
        """Send the deltas of the tokens sampled since the last call; `finish(seq, "stop")` ends a sequence whose
        stop string completed (the scheduler's `finish`). Returns whether every sequence has now ended (the
        completion is due)."""
        all_done = True
        for seq, out in zip(self.seqs, self.texts, strict=True):
            if out.done:
                continue
            text, new, first = out.advance()
            if out.stopped and seq.finish_reason != "stop":
                finish(seq, "stop")
            out.done = seq.status is Status.FINISHED
            all_done = all_done and out.done
            if not (new or text or out.done):
                continue
            params = seq.params
            self.handle.put(Delta(
                index=seq.index,
                text=text,
                token_ids=tuple(new),
                logprobs=tuple(seq.logprobs[first:]) if params.logprobs or params.top_logprobs else None,
                top_logprobs=tuple(tuple(t) for t in seq.top_logprobs[first:]) if params.top_logprobs else None,
                finish_reason=seq.finish_reason if out.done else None,
                stop_reason=_stop_reason(seq, out) if out.done else None,
            ))  # fmt: skip
        return all_done

    def end_unfinished_streams(self) -> None:
        """After an abort: the final (empty) delta of every sequence whose stream is still open."""
        for seq, out in zip(self.seqs, self.texts, strict=True):
            if not out.done:
                out.done = True
                self.handle.put(Delta(index=seq.index, text="", token_ids=(), finish_reason=seq.finish_reason))

    def complete(self, request_id: str) -> None:
        """Send the `Completion` (every sequence has ended)."""
        outputs = tuple(
            CompletionOutput(
                index=seq.index,
                text=out.text,
                token_ids=tuple(seq.outputs),
                finish_reason=seq.finish_reason,
                stop_reason=_stop_reason(seq, out),
                logprobs=tuple(seq.logprobs) if (seq.params.logprobs or seq.params.top_logprobs) else None,
                top_logprobs=tuple(tuple(t) for t in seq.top_logprobs) if seq.params.top_logprobs else None,
            )  # fmt: skip
            for seq, out in zip(self.seqs, self.texts, strict=True)
        )
        lead = self.seqs[0]
        self.handle.put(Completion(request_id=request_id, prompt_tokens=len(lead.prompt),
                                   cached_tokens=max(lead.num_cached, 0), outputs=outputs))  # fmt: skip


def _stop_reason(seq: Seq, out: SeqText) -> str | int | None:
    """vLLM's `stop_reason` of a sequence that finished "stop": the stop string that ended it, or the id from
    `stop_token_ids` it ended on; None for EOS (and for every other finish). astrai adds "budget": budget-aware
    closing shaped the end of a constrained output."""
    if seq.finish_reason != "stop":
        return None
    if out.matched is not None:
        return out.matched
    if seq.steering is not None and seq.steering.steered:
        return "budget"
    last = seq.outputs[-1] if seq.outputs else None
    return last if last in seq.params.stop_token_ids and len(seq.outputs) > seq.params.min_tokens else None

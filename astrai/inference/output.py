"""Turning sampled tokens into text deltas: incremental detokenization and stop strings, per sequence.

Stop-token ids end a sequence without adding text (the token stays in `token_ids`); stop strings end it with
the text cut before the stop (or after it with `include_stop_str_in_output`); text that may be the start of a
stop string is held back while streaming.
"""

from __future__ import annotations

from astrai.inference.request import Delta, Request
from astrai.inference.stop import StopStringMatcher
from astrai.io.tokenizer import Tokenizer

PROMPT_CONTEXT = 8  # prompt tokens given to the detokenizer so the first output token decodes in context


class SequenceOutput:
    """Text state of one sequence: what has been emitted, and whether a stop string fired."""

    def __init__(self, seq: Request, tokenizer: Tokenizer | None) -> None:
        self.seq, self.text, self.stopped, self.done = seq, "", False, False
        self._emitted_tokens = 0
        self._detok = None
        if tokenizer is not None:
            context = seq.prompt[-PROMPT_CONTEXT:]
            self._detok = tokenizer.detokenizer(skip_special_tokens=seq.params.skip_special_tokens, prompt_ids=context)
        self._stops = StopStringMatcher(seq.params.stop, include_stop=seq.params.include_stop_str_in_output)

    def advance(self, finish_reason: str | None) -> Delta:
        """Consume the sequence's tokens not yet emitted; returns the delta (with finish_reason when final).

        Sets `stopped` when a stop string completed; the caller then finishes the sequence with reason "stop".
        """
        seq = self.seq
        new = seq.outputs[self._emitted_tokens :]
        first = self._emitted_tokens
        self._emitted_tokens = len(seq.outputs)
        text = ""
        if self._detok is not None and not self.stopped:
            for token in new:
                if finish_reason == "stop" and token == seq.outputs[-1] and token in seq.stop_ids:
                    break  # the stop token itself adds no text
                piece, self.stopped = self._stops.feed(self._detok.add(token))
                text += piece
                if self.stopped:
                    break
            if finish_reason is not None and not self.stopped:
                piece, self.stopped = self._stops.feed(self._detok.flush())
                text += piece + ("" if self.stopped else self._stops.flush())
        self.text += text
        reason = "stop" if self.stopped else finish_reason
        self.done = reason is not None
        return Delta(
            index=seq.index,
            text=text,
            token_ids=tuple(new),
            logprobs=tuple(seq.logprobs[first:]) if seq.params.logprobs or seq.params.top_logprobs else None,
            top_logprobs=tuple(tuple(t) for t in seq.top_logprobs[first:]) if seq.params.top_logprobs else None,
            finish_reason=reason,
        )

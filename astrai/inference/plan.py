"""The contract between the host scheduler and the device runner: what one step runs and what it sampled.

`Scheduler.schedule` returns a list of `ScheduledSeq`; `ModelRunner.execute` runs it and returns one
`SampledToken` per entry that samples; `Scheduler.update` consumes them. Neither side imports the other.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

from astrai.inference.seq import Seq


@attrs.frozen
class ScheduledSeq:
    """One sequence's share of a step: feed `all_tokens[start : start + num_new]`; sample if `sample`.

    With a `draft` (speculative decoding, `astrai.inference.speculative`) the step feeds the sequence's last token
    followed by the k guessed tokens (`num_new` = 1 + k) and samples at each of those k + 1 positions; the runner
    then returns k + 1 `SampledToken`s for the entry, and `Scheduler.update` keeps the guesses the draws confirm.
    """

    seq: Seq
    start: int
    num_new: int
    sample: bool
    draft: tuple[int, ...] = ()


class SampledToken(NamedTuple):
    """The token a step drew for one sequence (a NamedTuple: one is built per sampled row per step, and a
    frozen attrs class costs several times more to construct on that hot path).

    Attributes:
        token: the chosen id.
        logprob: its raw-logit logprob, when the sequence asked for logprobs; else None.
        top_logprobs: the most likely (id, logprob) pairs, most likely first, when asked; else None.
    """

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None

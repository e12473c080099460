"""Budget-aware closing for one constrained sequence of a step: the token it must take now (`steered_token`), and
the runner's guarded call of it (`guarded_steering`), which fails only that sequence when its grammar has no way
forward. The closing path itself is `astrai.inference.closing`."""

from __future__ import annotations

import logging

from astrai.inference.closing import Steering
from astrai.inference.grammar import error_summary, matcher_error
from astrai.inference.seq import Seq

logger = logging.getLogger(__name__)


def steered_token(seq: Seq) -> int | None:
    """The token a constrained sequence must take now to finish its grammar within `max_tokens` (None: free).

    Not while `min_tokens` still holds EOS back (the closing path may end with it)."""
    if seq.matcher is None or len(seq.outputs) < seq.params.min_tokens:
        return None
    if seq.steering is None:
        seq.steering = Steering()
    produced = len(seq.outputs)
    remaining = seq.params.max_tokens - produced
    view_bytes = seq.matcher.grammar.view.token_bytes
    window = seq.steering.window
    near = window is not None and remaining <= window  # only then does steering read the text so far
    prefix = b"".join(view_bytes[t] for t in seq.outputs if t < len(view_bytes)) if near else b""
    return seq.steering.next_token(seq.matcher, produced, remaining, prefix, seq.params.grammar.closers)


def guarded_steering(seq: Seq) -> int | None:
    """`steered_token` for a row whose mask was just filled, failing only that sequence (`Seq.error`, which ends
    it with "error" and its request with `RequestFailedError`) when its grammar has no way forward: the matcher
    failed (llguidance's mask then allows only EOS, which would end the output as if it were complete), or the
    steering raised. The step and every other sequence go on."""
    why = matcher_error(seq.matcher)
    if why is not None:
        why = error_summary(why)
        seq.error = f"the grammar reached a state with no way forward after {len(seq.outputs)} token(s): {why}"
        return None
    try:
        return steered_token(seq)
    except Exception as err:  # a bug in the host work of one sequence must not end the engine thread
        logger.exception("request %s: budget-aware closing failed; ending that request", seq.id)
        seq.error = f"the grammar's host work failed after {len(seq.outputs)} token(s): {type(err).__name__}: {err}"
        return None

"""The records the engine hands back: stream `Delta`s and the final `Completion` of a request."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class CompletionOutput:
    """One finished completion of a request."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    stop_reason: str | int | None = None  # the stop string or `stop_token_ids` id that ended it (vLLM's field; None
    # for EOS), or "budget": the end of a constrained output was steered to fit max_tokens


@attrs.frozen(kw_only=True)
class Completion:
    """A finished request: its n completions and token usage."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    outputs: tuple[CompletionOutput, ...]

    @property
    def completion_tokens(self) -> int:
        """Generated tokens over all completions."""
        return sum(len(o.token_ids) for o in self.outputs)


@attrs.frozen(kw_only=True)
class Delta:
    """An increment of a streamed completion: new text and tokens; `finish_reason` set on the last one."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # on the last one, as `CompletionOutput.stop_reason`

"""`EngineInputError`: a request the engine refuses, naming the request field at fault.

It is a `ValueError` (callers that catch ValueError keep working) with a `param` attribute: the field's name as
the OpenAI API spells it (`temperature`, `max_tokens`, `n`, `logit_bias`, `prompt`, ...), so the server's 400
can fill the error body's `param`. The message itself is unchanged and still names the field and the value.

Not here: `EngineBusyError` and `EngineDeadError` (engine state, not bad input) live in `engine.py`.
"""

from __future__ import annotations


class EngineInputError(ValueError):
    """A bad request field (sampling value, prompt, max_tokens, n); `param` names it (None when no single field)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

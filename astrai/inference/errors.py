"""`EngineInputError`: a request the engine refuses, naming the request field at fault; `RequestFailedError`: a
request the engine ended with an error of its own while it kept serving the others.

It is a `ValueError` (callers that catch ValueError keep working) with a `param` attribute: the field's name as
the OpenAI API spells it (`temperature`, `max_tokens`, `n`, `logit_bias`, `prompt`, ...), so the server's 400
can fill the error body's `param`. The message itself is unchanged and still names the field and the value.

`EngineBusyError` and `EngineDeadError` (engine state, not bad input) are here too; `astrai.inference.engine`
exports them all.
"""

from __future__ import annotations


class EngineInputError(ValueError):
    """A bad request field (sampling value, prompt, max_tokens, n); `param` names it (None when no single field)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class LoRAError(EngineInputError):
    """An adapter the engine refuses (bad folder, rank above the slots, another base model, a name in use), or
    LoRA serving is off; `param` names the field ("lora_path", "lora_name", "model")."""


class LoRANotFoundError(LoRAError):
    """No adapter is loaded under that name (the server answers 404 `model_not_found`)."""


class RequestFailedError(RuntimeError):
    """One request that the engine ended with an error while it went on serving the others.

    Raised by the request's handle (after the deltas already delivered) when a sequence could not go on: its
    grammar's matcher failed (no token can continue it, a parser resource limit) or the host work for that
    sequence raised. The request's other sequences are aborted and its KV freed. `param` names the request field
    whose constraint failed (the grammar's, e.g. `response_format`), or None when the failure was the server's own
    (then logged with its traceback): servers answer 400 naming `param`, or 500.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineBusyError(RuntimeError):
    """The waiting queue is full; retry later (servers answer 429 / 529)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error; the message carries it."""

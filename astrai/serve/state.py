"""`ServerState`: what the route handlers share (the engine, the served name, metrics, auth and limits).

Handlers (`openai_api`, `anthropic_api`, `embeddings_api`) and `app` import it; the protocol modules never do:
they take the tokenizer and the limits they check as arguments.
"""

from __future__ import annotations

import time

import attrs

from astrai.inference.engine import Engine
from astrai.models.encoder import EncoderConfig
from astrai.serve.metrics import Metrics


@attrs.define(eq=False)
class ServerState:
    """What the route handlers share."""

    engine: Engine
    model_name: str
    metrics: Metrics = attrs.Factory(Metrics)
    created: int = attrs.Factory(lambda: int(time.time()))
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    embeddings: EncoderConfig | None = None  # None: /v1/embeddings answers 404

    @property
    def tokenizer(self):
        """The served model's tokenizer (None when the folder has none)."""
        return self.engine.model.tokenizer

    @property
    def vocab_size(self) -> int:
        """The served model's vocabulary size (token ids and logit_bias keys must be below it)."""
        return self.engine.model.config.vocab_size

    @property
    def context(self) -> int:
        """Tokens one sequence may hold, prompt and completion together (the model's length, capped by the KV pool)."""
        engine = self.engine
        return min(engine.max_model_len, (engine.pool.num_pages - 1) * engine.config.page_size)

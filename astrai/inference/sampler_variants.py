"""The engine's compiled sampler as a fixed set of variants, all compiled at start (DESIGN fact F9).

`sampler.sample` branches in Python on which optional `SamplingBatch` fields are present, on its static flags
and on the logprob arguments, and Dynamo specialises batch sizes 0 and 1: compiled as it stood, every new
combination (a first request with `repetition_penalty`, with `top_p`, with logprobs, a first batch of 2) was a
new graph, compiled on the engine thread while every request waited (tens of seconds on a 2-core CPU), and the
ninth hit Dynamo's recompile limit. Here every sampler call is mapped onto one of `VARIANTS`, which
`SamplerVariants.warm` compiles before the server says `serving`:

- "greedy", "sample", "sample+sort": batches with no optional [B, V] field (no grammar, bias, penalty or
  min_tokens mask), by their `all_greedy`/`needs_sort` flags. The common requests, at full speed.
- "general": every other batch, with its absent fields filled with neutral values (`general_batch`: an all-ones
  grammar mask, zero bias and counts, an empty prompt mask, no forbidden ids) and both flags at their general
  setting. The neutral values change no token: x + 0, a repetition penalty of 1 on unseen tokens, top-k 0 and
  top-p 1 keep every logit, and a greedy row takes its argmax whatever `all_greedy` says.
- Batch size: a batch of one row is padded to two (a copy of row 0, dropped after): Dynamo specialises size 1,
  while every size from 2 shares the symbolic graph. Rows are independent (each row's noise is keyed by its own
  seed and step), so the padding changes nothing.
- Logprobs (`want_logprobs`, `top_logprobs`) are computed eagerly after the compiled draw (`sampler.raw_logprobs`,
  a log_softmax, a gather and a top-k of the raw logits): no compiled variant depends on them.

One compiled function serves every engine in the process (the variants are few: Dynamo's cache per code object
holds them, for each device), so a second engine's warm-up is a cache hit.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from astrai.inference.params import SamplingParams
from astrai.inference.sampler import SampleOutput, raw_logprobs, sample
from astrai.inference.sampling_batch import SamplingBatch, general_batch, make_sampling_batch, pad_rows
from astrai.inference.thread_count import AnyThreadCount, without_global_state
from astrai.tree import replace

VARIANTS = ("greedy", "sample", "sample+sort", "general")

_OUTPUT = SampleOutput(tokens=None)  # type: ignore[arg-type]
_lock = threading.Lock()
_compiled = None


def _draw(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The compiled target: the tokens only (logprobs are eager, see the module docstring)."""
    return sample(logits, batch).tokens


def compiled_draw():
    """The process's one compiled `_draw` (dynamic sizes), made on first use."""
    global _compiled
    with _lock:
        if _compiled is None:
            # without Dynamo's global-state guard: `SamplerVariants` calls it through `thread_count.AnyThreadCount`
            _compiled = torch.compile(_draw, dynamic=True, options={"guard_filter_fn": without_global_state})
        return _compiled


def variant(batch: SamplingBatch) -> str:
    """Which of `VARIANTS` runs `batch`."""
    optional = (batch.logit_bias, batch.output_counts, batch.prompt_mask, batch.min_tokens_mask,
                batch.grammar_bitmask)  # fmt: skip
    if any(t is not None for t in optional):
        return "general"
    if batch.all_greedy:
        return "greedy"
    return "sample+sort" if batch.needs_sort else "sample"


class SamplerVariants:
    """`sample` for the engine: through the compiled variants when `compiled`, else eagerly (same tokens)."""

    def __init__(self, *, compiled: bool) -> None:
        self.compiled = compiled
        # one compile serves every thread count `EngineConfig.share_cpu_cores` picks (`thread_count`)
        self.draw = AnyThreadCount(compiled_draw(), _draw, torch.get_num_threads()) if compiled else _draw

    def __call__(self, logits: Tensor, batch: SamplingBatch, *, top_logprobs: int = 0,
                 want_logprobs: bool = False) -> SampleOutput:  # fmt: skip
        """`sampler.sample(logits, batch, top_logprobs=..., want_logprobs=...)`, never compiling a new graph once
        `warm` ran for this vocabulary size and device."""
        rows = logits.shape[0]
        x, b = logits, batch
        if variant(b) == "general":
            b = general_batch(b, logits.shape[-1])
        if rows == 1:
            x, b = torch.cat([x, x]), pad_rows(b, 2)
        tokens = self.draw(x, b)[:rows]
        if not (want_logprobs or top_logprobs > 0):
            return replace(_OUTPUT, tokens=tokens)
        return raw_logprobs(logits, tokens, top_logprobs)

    def warm(self, vocab_size: int, device: torch.device | str) -> list[str]:
        """Compile every variant now for [B, `vocab_size`] logits on `device`; returns the variants run."""
        batches = {
            "greedy": [SamplingParams(temperature=0.0)],
            "sample": [SamplingParams(temperature=1.0)],
            "sample+sort": [SamplingParams(temperature=1.0, top_p=0.9)],
            "general": [SamplingParams(temperature=1.0, repetition_penalty=1.1)],
        }
        logits = torch.zeros(2, vocab_size, dtype=torch.float32, device=device)
        for name, params in batches.items():
            batch = make_sampling_batch(params * 2, seeds=[0, 1], steps=[0, 0], vocab_size=vocab_size,
                                        device=device)  # fmt: skip
            assert variant(batch) == name, (name, variant(batch))
            self(logits, batch)
        return list(batches)

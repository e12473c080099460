"""Generating for a whole evaluation dataset on one short-lived engine (`generate_all`).

All requests are submitted at once (continuous batching keeps `batch_size` sequences running; a request with
n > 1 shares its prompt KV between its samples) and the calling thread steps the engine itself
(`EngineConfig.background=False`, faster on CPU), advancing a progress bar as requests finish. On CPU the KV pool
is sized to `batch_size` sequences of the longest request; on CUDA the engine sizes it from free memory.

Not here: scoring forwards (the log-likelihood tasks run their own batched causal forward).
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.outputs import Completion
from astrai.inference.params import SamplingParams
from astrai.io.model import Model
from astrai.ops.attention import pages_needed

PAGE_SIZE = 16


def generate_all(
    model: Model,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    batch_size: int = 32,
    console: Console | None = None,
    description: str = "generating",
) -> list[Completion]:
    """Generate for every prompt (token ids) with its own `SamplingParams`; completions in prompt order.

    Args:
        model: the loaded model.
        prompts: token-id prompts.
        params: one SamplingParams per prompt (n samples each).
        batch_size: most sequences decoding at once (the engine's max_running).
        console: where the progress bar goes (default stderr); it disappears when done.
        description: the progress bar's label.

    Raises:
        EngineInputError: a prompt plus its max_tokens is longer than the model's context (both numbers given).
    """
    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
    if not prompts:
        return []
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    longest = max(
        pages_needed(len(p) + q.max_tokens, PAGE_SIZE) * PAGE_SIZE for p, q in zip(prompts, params, strict=True)
    )
    sequences = sum(q.n for q in params)
    kv_tokens = None if model.device.type == "cuda" else longest * min(batch_size, sequences) + PAGE_SIZE
    config = EngineConfig(page_size=PAGE_SIZE, kv_budget_tokens=kv_tokens, max_running=batch_size,
                          max_waiting=sequences + 1, max_step_tokens=max(2048, batch_size), compile=False,
                          background=False)  # fmt: skip
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console or Console(stderr=True), transient=True)  # fmt: skip
    with Engine(model, config) as engine, progress:
        handles = [engine.submit(list(p), q) for p, q in zip(prompts, params, strict=True)]
        bar = progress.add_task(description, total=len(handles))
        pending = list(range(len(handles)))
        while pending:
            if not engine.step():
                raise RuntimeError(f"the engine stopped with {len(pending)} requests unfinished")
            still = []
            for i in pending:
                handles[i].poll()  # drains the request's deltas; sets .completion at the end
                if handles[i].completion is None:
                    still.append(i)
            progress.advance(bar, len(pending) - len(still))
            pending = still
        return [h.completion for h in handles]  # type: ignore[misc]

"""`astrai.generate`: one-shot batch generation on a short-lived `Engine` sized to the batch.

For serving, keep one `Engine` alive instead (it compiles its decode step once and shares KV across requests).
Prompts are never truncated: a prompt plus `max_tokens` beyond the model's context is rejected with both numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.outputs import Completion
from astrai.inference.params import SamplingParams
from astrai.io.model import Model
from astrai.ops.attention import pages_needed

PAGE_SIZE = 16


def _run(model: Model, prompts: Sequence[str | Sequence[int]], params: SamplingParams) -> list[Completion]:
    if not prompts:
        raise ValueError("no prompts given")
    if isinstance(prompts, str):
        prompts = [prompts]
    lengths = [len(model.tokenizer.encode(p)) if isinstance(p, str) and model.tokenizer else len(p) for p in prompts]
    budget = sum(pages_needed(n + params.max_tokens, PAGE_SIZE) * PAGE_SIZE for n in lengths) * params.n
    config = EngineConfig(page_size=PAGE_SIZE, kv_budget_tokens=budget, max_running=len(prompts) * params.n,
                          max_step_tokens=max(2048, len(prompts) * params.n), compile=False,
                          background=False)  # fmt: skip
    with Engine(model, config) as engine:
        return engine.generate(list(prompts), params)


def generate(
    model: Model,
    prompts: str | Sequence[str] | Sequence[Sequence[int]],
    *,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
) -> list[str]:
    """Complete each prompt (text or token ids); returns the generated text per prompt.

    Args:
        model: a loaded model with a tokenizer.
        prompts: a string, a list of strings, or a list of token-id lists.
        max_tokens: most new tokens per prompt.
        temperature: 0 for greedy decoding; otherwise the softmax temperature.
        top_k: keep the k most likely tokens (0: off).
        top_p: nucleus mass (1: off).
        seed: seed of the sampling noise (reproducible output).
        stop: stop strings (the text ends before them).
        stop_token_ids: ids that end a completion; None means the model's eos ids.
    """
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer: use generate_ids with token-id prompts")
    params = _params(max_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids)
    return [c.outputs[0].text for c in _run(model, prompts, params)]


def generate_ids(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """Generated token ids per prompt, the final stop token excluded; arguments as `generate`."""
    params = _params(max_tokens, temperature, top_k, top_p, seed, (), stop_token_ids)
    out = []
    for completion in _run(model, prompts, params):
        result = completion.outputs[0]
        ids = list(result.token_ids)
        if result.finish_reason == "stop" and ids:
            ids = ids[:-1]
        out.append(ids)
    return out


def _params(max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None, stop: Sequence[str],
            stop_token_ids: Sequence[int] | None) -> SamplingParams:  # fmt: skip
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=stop_token_ids is not None,
    )  # fmt: skip

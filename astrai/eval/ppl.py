"""`astrai eval ppl`: token-level perplexity of texts, with sliding windows over texts longer than a window.

perplexity = exp(total NLL / total predicted tokens), summed over every text of the dataset (token-weighted, not
a mean of per-text perplexities). Each text is encoded with the tokenizer (its post-processor adds a BOS where
the model has one, as `tokenizer(text)` does in transformers) and cut into windows exactly as transformers'
perplexity guide (https://huggingface.co/docs/transformers/perplexity) does: a window of `max_length` tokens
starts every `stride` tokens, and only its tokens not already scored by the previous window are predicted (the
earlier ones are context), so every token but the first is scored exactly once, with at least
`max_length - stride` tokens of context once the first window is past. The guide weights each window's mean
loss by its target count minus one, which undercounts windows after the first by one token; here every
predicted token counts once, so the result is exactly exp(mean NLL) over the predicted tokens.

Input: a `.txt` file is one text (see `astrai.eval.data.read_texts`); `.jsonl` / `.json` hold one text per
record in `--field`. Per-sample output: each text's predicted-token count, summed NLL and perplexity.
Not here: bits per byte and word perplexity (lm-eval's wikitext metrics), per-token dumps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import attrs

from astrai.eval.common import EvalConfig, check, first, load_model, progress, require_tokenizer
from astrai.eval.data import DataError, read_texts
from astrai.eval.report import Report
from astrai.eval.scoring import Request, score
from astrai.io.model import Model

DEFAULT_MAX_LENGTH = 4096


@attrs.frozen(kw_only=True)
class Config(EvalConfig):
    """Perplexity of the texts of a file."""

    data: Path
    """A .txt file (one text) or .jsonl / .json file (one text per record, in --field)."""
    field: str = "text"
    """The record field holding the text (.jsonl / .json)."""
    max_length: int | None = None
    """Tokens per window (context + predicted); default the model's context, at most 4096."""
    stride: int | None = None
    """Tokens between window starts, <= max-length; default max-length // 2 (half of each window is context)."""
    add_special_tokens: bool = True
    """Encode with the tokenizer's post-processor (adds a BOS token where the model has one)."""


def windows(num_tokens: int, max_length: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """The windows of transformers' perplexity guide over `num_tokens` tokens.

    Yields:
        (begin, end, first_target): the window is tokens[begin:end], and tokens[first_target:end] are predicted
        (first_target > begin: the window's first token has no context inside it). Together the windows predict
        every token from index 1 on exactly once when stride < max_length (stride == max_length: disjoint
        windows, whose first tokens are not predicted, as in the guide).
    """
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        target = max(prev_end, begin + 1)
        if target < end:
            yield begin, end, target
        prev_end = end
        if end == num_tokens:
            break


def _lengths(cfg: Config, model: Model) -> tuple[int, int]:
    context = model.config.max_position_embeddings
    length = cfg.max_length if cfg.max_length is not None else min(context, DEFAULT_MAX_LENGTH)
    if not 2 <= length <= context + 1:
        raise ValueError(f"--max-length must be in [2, {context + 1}] (the model's context + 1), got {length}")
    stride = cfg.stride if cfg.stride is not None else max(1, length // 2)
    if not 1 <= stride <= length:
        raise ValueError(f"--stride must be in [1, --max-length={length}], got {stride}")
    return length, stride


def evaluate(cfg: Config, model: Model | None = None) -> Report:
    """Perplexity of `cfg.data` under `model` (loaded from `cfg.model` when None).

    Raises:
        FileNotFoundError, DataError: a missing or malformed dataset, or one with nothing to score.
        ValueError: bad lengths, or a model without a tokenizer.
    """
    check(cfg)
    texts = first(read_texts(cfg.data, cfg.field), cfg.limit)
    model = require_tokenizer(model, cfg.model, "ppl") if model is not None else load_model(cfg, "ppl")
    length, stride = _lengths(cfg, model)
    requests, owner = [], []
    for i, (_, text) in enumerate(texts):
        ids = model.tokenizer.encode(text, add_special_tokens=cfg.add_special_tokens)
        for begin, end, target in windows(len(ids), length, stride):
            requests.append(Request(ids[begin:end], target - begin))
            owner.append(i)
    if not requests:
        raise DataError(f"{cfg.data}: nothing to score (every text has fewer than 2 tokens)")
    with progress(len(requests), "ppl: windows") as advance:
        scores = score(model, requests, batch_size=cfg.batch_size, advance=advance)
    nll, count, nwin = [0.0] * len(texts), [0] * len(texts), [0] * len(texts)
    for i, s in zip(owner, scores, strict=True):
        nll[i] -= s.total
        count[i] += s.count
        nwin[i] += 1
    samples = [{"where": where, "tokens": n, "windows": w, "nll": loss, "ppl": math.exp(loss / n) if n else None}
               for (where, _), n, w, loss in zip(texts, count, nwin, nll, strict=True)]  # fmt: skip
    total, tokens = sum(nll), sum(count)
    metrics = {"ppl": math.exp(total / tokens), "nll": total / tokens, "tokens": tokens, "texts": len(texts),
               "windows": len(requests), "max_length": length, "stride": stride}  # fmt: skip
    return Report(task="ppl", model=cfg.model, metrics=metrics, samples=samples)

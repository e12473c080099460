"""`astrai eval rouge`: ROUGE-1/2/L (and Lsum) F1 of predictions against references, as Google's `rouge-score`.

Scores equal `rouge_score.rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"])` (tested on a
corpus with unicode and empty strings), reimplemented so that scoring needs no extra package:
- tokens: lowercase (Python's `str.lower`), every run of characters outside [a-z0-9] becomes a space, split on
  whitespace. Letters outside ASCII are separators, so "héllo" is the two tokens "h", "llo" and CJK text has no
  tokens at all: rouge-score's English-only behaviour, kept for comparable numbers.
- `stem=True`: NLTK's Porter stemmer on tokens longer than 3 characters (rouge-score's `use_stemmer`; NLTK is
  then needed); off by default, as in rouge-score.
- ROUGE-N: clipped n-gram overlap; P = overlap / candidate n-grams, R = overlap / reference n-grams (each
  denominator at least 1); F1 = 2PR / (P + R), 0 when P + R = 0.
- ROUGE-L: longest common subsequence of the two token lists. ROUGE-Lsum: summary-level LCS over newline-
  separated sentences (union LCS per reference sentence, tokens not double counted), as rouge-score does without
  `split_summaries`.

The dataset's summary is the mean over samples of each F1 (what rouge-score users average and report),
scaled to [0, 1]. Records hold `prediction` + `reference` (scored as they are) or `prompt` + `reference`
(the prompt is completed through the inference engine first, greedy by default).
Not here: bootstrap confidence intervals (rouge-score's `BootstrapAggregator`), multiple references.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from astrai.eval.common import EvalConfig, check, first, load_model, progress, require_tokenizer
from astrai.eval.data import DataError, read_records, text_field
from astrai.eval.report import Report
from astrai.inference.params import SamplingParams
from astrai.io.model import Model

TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_NON_ALNUM = re.compile(r"[^a-z0-9]+")
_SPACES = re.compile(r"\s+")
_VALID = re.compile(r"^[a-z0-9]+$")


@attrs.frozen(kw_only=True)
class Config(EvalConfig):
    """ROUGE F1 of generated (or given) predictions against references."""

    model: str = ""
    """Model folder or Hugging Face model id; needed only for records without a prediction."""
    data: Path
    """JSON lines with `reference` and either `prediction` (scored as is) or `prompt` (completed first)."""
    prompt_field: str = "prompt"
    """Field of the prompt to complete."""
    prediction_field: str = "prediction"
    """Field of a ready prediction (used when present; the model is then not loaded)."""
    reference_field: str = "reference"
    """Field of the reference text."""
    chat: bool = False
    """Send the prompt as a user message through the model's chat template."""
    max_tokens: int = 128
    """Most new tokens per completion."""
    temperature: float = 0.0
    """0: greedy decoding."""
    top_p: float = 1.0
    """Nucleus mass (1: off)."""
    seed: int = 0
    """Sampling seed (reproducible runs when temperature > 0)."""
    stem: bool = False
    """Porter-stem tokens longer than 3 characters (rouge-score's use_stemmer; needs nltk)."""


def tokenize(text: str, stemmer: Callable[[str], str] | None = None) -> list[str]:
    """rouge-score's tokenizer: lowercase, non-[a-z0-9] runs to spaces, split, optional stemming of long tokens."""
    tokens = _SPACES.split(_NON_ALNUM.sub(" ", text.lower()))
    if stemmer is not None:
        tokens = [stemmer(t) if len(t) > 3 else t for t in tokens]
    return [t for t in tokens if _VALID.match(t)]


def porter_stemmer() -> Callable[[str], str]:
    """NLTK's Porter stemmer in its default mode, the one rouge-score uses.

    Raises:
        ValueError: nltk is not installed.
    """
    try:
        from nltk.stem import porter
    except ImportError:
        raise ValueError("--stem needs nltk (pip install nltk)") from None
    return porter.PorterStemmer().stem


def _f1(p: float, r: float) -> float:
    return 2 * p * r / (p + r) if p + r > 0 else 0.0


def _prf(hits: int, candidate: int, reference: int) -> tuple[float, float, float]:
    p, r = hits / max(candidate, 1), hits / max(reference, 1)
    return p, r, _f1(p, r)


def rouge_n(reference: Sequence[str], candidate: Sequence[str], n: int) -> tuple[float, float, float]:
    """(precision, recall, F1) of clipped n-gram overlap."""
    ref = Counter(tuple(reference[i : i + n]) for i in range(len(reference) - n + 1))
    can = Counter(tuple(candidate[i : i + n]) for i in range(len(candidate) - n + 1))
    hits = sum(min(count, can[gram]) for gram, count in ref.items())
    return _prf(hits, sum(can.values()), sum(ref.values()))


def _lcs_table(a: Sequence[str], b: Sequence[str]) -> list[list[int]]:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = table[i - 1][j - 1] + 1 if a[i - 1] == b[j - 1] else max(table[i - 1][j], table[i][j - 1])
    return table


def rouge_l(reference: Sequence[str], candidate: Sequence[str]) -> tuple[float, float, float]:
    """(precision, recall, F1) of the longest common subsequence; zeros when either side has no tokens."""
    if not reference or not candidate:
        return 0.0, 0.0, 0.0
    lcs = _lcs_table(reference, candidate)[-1][-1]
    p, r = lcs / len(candidate), lcs / len(reference)
    return p, r, _f1(p, r)


def _lcs_indices(ref: Sequence[str], can: Sequence[str]) -> list[int]:
    """Indices into `ref` of one LCS, chosen by rouge-score's backtracking (ties move up, i.e. drop ref)."""
    table, i, j, out = _lcs_table(ref, can), len(ref), len(can), []
    while i > 0 and j > 0:
        if ref[i - 1] == can[j - 1]:
            out.append(i - 1)
            i, j = i - 1, j - 1
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return out[::-1]


def rouge_lsum(reference: str, candidate: str, stemmer: Callable[[str], str] | None = None) -> tuple[float, ...]:
    """(precision, recall, F1) of summary-level LCS over newline-separated sentences."""
    refs = [tokenize(s, stemmer) for s in reference.split("\n") if s]
    cans = [tokenize(s, stemmer) for s in candidate.split("\n") if s]
    m, n = sum(map(len, refs)), sum(map(len, cans))
    if not refs or not cans or not m or not n:
        return 0.0, 0.0, 0.0
    left_r, left_c = Counter(t for s in refs for t in s), Counter(t for s in cans for t in s)
    hits = 0
    for ref in refs:
        union = sorted(set().union(*(_lcs_indices(ref, can) for can in cans)))
        for token in (ref[i] for i in union):
            if left_c[token] > 0 and left_r[token] > 0:
                hits, left_c[token], left_r[token] = hits + 1, left_c[token] - 1, left_r[token] - 1
    p, r = hits / n, hits / m
    return p, r, _f1(p, r)


def scores(reference: str, prediction: str, stemmer: Callable[[str], str] | None = None) -> dict[str, dict]:
    """rouge-score's `RougeScorer(TYPES).score(reference, prediction)` as {type: {precision, recall, fmeasure}}."""
    ref, can = tokenize(reference, stemmer), tokenize(prediction, stemmer)
    values = {"rouge1": rouge_n(ref, can, 1), "rouge2": rouge_n(ref, can, 2), "rougeL": rouge_l(ref, can),
              "rougeLsum": rouge_lsum(reference, prediction, stemmer)}  # fmt: skip
    return {k: dict(zip(("precision", "recall", "fmeasure"), v, strict=True)) for k, v in values.items()}


def _generate(cfg: Config, model: Model, prompts: list[str]) -> list[str]:
    from astrai.eval.engine_batch import generate_all

    tok = model.tokenizer
    if cfg.chat:
        ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    else:
        ids = [tok.encode_prompt(p) for p in prompts]
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
    completions = generate_all(model, ids, [params] * len(ids), batch_size=cfg.batch_size,
                               description="rouge: generating")  # fmt: skip
    return [c.outputs[0].text for c in completions]


def evaluate(cfg: Config, model: Model | None = None) -> Report:
    """ROUGE of `cfg.data`; records without a prediction are completed by `model` (loaded when None and needed).

    Raises:
        FileNotFoundError, DataError: a missing, malformed or empty dataset.
        ValueError: generation needed and the model has no tokenizer, or a prompt too long for its context.
    """
    check(cfg)
    records = first(read_records(cfg.data), cfg.limit)
    refs = [text_field(r, cfg.reference_field) for r in records]
    preds: list[str | None] = [text_field(r, cfg.prediction_field) if cfg.prediction_field in r.data else None
                               for r in records]  # fmt: skip
    todo = [i for i, p in enumerate(preds) if p is None]
    prompts = [text_field(records[i], cfg.prompt_field, allow_empty=False) for i in todo]
    if todo:
        if model is None and not cfg.model:
            where = records[todo[0]].where
            raise DataError(f"{where}: no {cfg.prediction_field!r} field, and no --model to generate one")
        if model is None:
            model = load_model(cfg, "rouge")
        for i, text in zip(todo, _generate(cfg, require_tokenizer(model, cfg.model, "rouge"), prompts), strict=True):
            preds[i] = text
    stemmer = porter_stemmer() if cfg.stem else None
    generated, samples = set(todo), []
    with progress(len(records), "rouge: scoring") as advance:
        for i, (r, ref, pred) in enumerate(zip(records, refs, preds, strict=True)):
            s = scores(ref, pred, stemmer)
            samples.append({"where": r.where, "prediction": pred, "reference": ref, "generated": i in generated,
                            **{k: v["fmeasure"] for k, v in s.items()}, "scores": s})  # fmt: skip
            advance(1)
    metrics = {k: sum(s[k] for s in samples) / len(samples) for k in TYPES}
    metrics |= {"samples": len(samples), "generated": len(todo)}
    return Report(task="rouge", model=cfg.model or "-", metrics=metrics, samples=samples)

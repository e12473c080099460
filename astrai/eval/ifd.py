"""`astrai eval ifd`: instruction-following difficulty of (instruction, answer) pairs.

IFD (Li et al. 2024, "From Quantity to Quality", the Cherry LLM data-selection score) compares how well the model
predicts an answer with and without its instruction:

    ifd    = ppl(answer | instruction) / ppl(answer) = exp(CE_cond - CE_alone)   (Cherry LLM's code, the issue)
    ifd_ce = CE_cond / CE_alone                                                 (the paper's formula, reference §8)

where CE is the mean cross-entropy (nats per token) of the answer's tokens. Both are reported per sample; the
summary gives the mean and median of `ifd`, the mean of `ifd_ce`, and the share of samples with ifd > 1 (the
instruction does not help; Cherry LLM drops those). Lower means the instruction makes the answer easier.

Both passes predict exactly the same answer tokens: the answer is encoded on its own (no special tokens; plus
the EOS token with `append_eos`, the default, as the reference does), and follows either the instruction's tokens
(conditional) or an unconditional context: the encoded `--prefix`, or when it is empty lm-eval's rule for an
empty context, the BOS token (EOS for models without one). The instruction is `instruction` (+ "\\n" + `input`
when the record has a non-empty one, Alpaca's layout) followed by `--separator`, encoded with the tokenizer's
post-processor; or, with `--chat`, the user turn of the model's chat template with its generation prompt.
Too long: the instruction is cut from the left, then the answer from the right (the sample says `truncated`).
Not here: multi-turn conversations, packing of several pairs per row.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import attrs

from astrai.eval.common import EvalConfig, check, first, load_model, progress, require_tokenizer
from astrai.eval.data import DataError, Record, pick_field, read_records, text_field
from astrai.eval.report import Report
from astrai.eval.scoring import Request, score
from astrai.io.model import Model

INSTRUCTION_FIELDS = ("instruction", "prompt", "question")
ANSWER_FIELDS = ("output", "response", "answer")


@attrs.frozen(kw_only=True)
class Config(EvalConfig):
    """Instruction-following difficulty of (instruction, answer) pairs."""

    data: Path
    """JSON lines with an instruction (instruction|prompt|question) and an answer (output|response|answer)."""
    instruction_field: str | None = None
    """Field of the instruction; default the first of instruction, prompt, question present."""
    input_field: str = "input"
    """Optional field appended to the instruction after a newline when non-empty (Alpaca's `input`)."""
    answer_field: str | None = None
    """Field of the answer; default the first of output, response, answer present."""
    chat: bool = False
    """Render the instruction as a user turn of the model's chat template (with the generation prompt)."""
    separator: str = "\n"
    """Text between the instruction and the answer (without --chat)."""
    prefix: str = ""
    """Context of the unconditional pass; empty: the BOS token (EOS for models without BOS)."""
    append_eos: bool = True
    """Score the EOS token after the answer too."""


@attrs.frozen
class Pair:
    """The token ids of one sample's two passes."""

    context: list[int]
    alone: list[int]
    answer: list[int]
    truncated: bool


def _texts(cfg: Config, r: Record) -> tuple[str, str]:
    instruction = text_field(r, cfg.instruction_field or pick_field(r, INSTRUCTION_FIELDS))
    extra = r.data.get(cfg.input_field)
    if isinstance(extra, str) and extra:
        instruction = f"{instruction}\n{extra}"
    return instruction, text_field(r, cfg.answer_field or pick_field(r, ANSWER_FIELDS))


def _alone(cfg: Config, model: Model) -> list[int]:
    tok = model.tokenizer
    if cfg.prefix:
        return tok.encode_prompt(cfg.prefix)
    token = tok.bos_token_id if tok.bos_token_id is not None else (model.eos_token_ids or (None,))[0]
    if token is None:
        raise ValueError("the model has neither a BOS nor an EOS token: give the unconditional context with --prefix")
    return [token]


def encode(cfg: Config, model: Model, instruction: str, answer: str, alone: list[int]) -> Pair:
    """The two passes' ids of one sample (see the module docstring), fitted to the model's context + 1."""
    tok = model.tokenizer
    if cfg.chat:
        context = tok.encode_chat([{"role": "user", "content": instruction}])
    else:
        context = tok.encode_prompt(instruction + cfg.separator)
    ids = tok.encode(answer, add_special_tokens=False)
    if cfg.append_eos and model.eos_token_ids:
        ids.append(model.eos_token_ids[0])
    limit = model.config.max_position_embeddings + 1
    keep = limit - max(1, len(alone))
    truncated = len(ids) > keep or len(context) + min(len(ids), keep) > limit
    ids = ids[:keep]
    context = context[-(limit - len(ids)) :] if context else context
    return Pair(context or alone, alone, ids, truncated)


def evaluate(cfg: Config, model: Model | None = None) -> Report:
    """IFD of the pairs in `cfg.data` under `model` (loaded from `cfg.model` when None).

    Raises:
        FileNotFoundError, DataError: a missing, malformed or empty dataset, or no answer with tokens.
        ValueError: a model without a tokenizer (or without BOS/EOS and no --prefix).
    """
    check(cfg)
    records = first(read_records(cfg.data), cfg.limit)
    texts = [_texts(cfg, r) for r in records]
    model = require_tokenizer(model, cfg.model, "ifd") if model is not None else load_model(cfg, "ifd")
    alone = _alone(cfg, model)
    pairs = [encode(cfg, model, instruction, answer, alone) for instruction, answer in texts]
    kept = [i for i, p in enumerate(pairs) if p.answer]
    if not kept:
        raise DataError(f"{cfg.data}: nothing to score (every answer is empty)")
    requests = [Request(p.context + p.answer, len(p.context)) for p in (pairs[i] for i in kept)]
    requests += [Request(p.alone + p.answer, len(p.alone)) for p in (pairs[i] for i in kept)]
    with progress(len(requests), "ifd: scoring") as advance:
        scores = score(model, requests, batch_size=cfg.batch_size, advance=advance)
    samples = [{"where": r.where, "skipped": "empty answer"} for r in records]
    for k, i in enumerate(kept):
        cond, solo = scores[k], scores[len(kept) + k]
        ce_cond, ce_alone = -cond.total / cond.count, -solo.total / solo.count
        samples[i] = {"where": records[i].where, "tokens": cond.count, "ce_conditional": ce_cond,
                      "ce_alone": ce_alone, "ppl_conditional": math.exp(ce_cond), "ppl_alone": math.exp(ce_alone),
                      "ifd": math.exp(ce_cond - ce_alone), "ifd_ce": ce_cond / ce_alone if ce_alone else None,
                      "truncated": pairs[i].truncated}  # fmt: skip
    ifd = [samples[i]["ifd"] for i in kept]
    ifd_ce = [samples[i]["ifd_ce"] for i in kept if samples[i]["ifd_ce"] is not None]
    metrics = {"ifd": statistics.fmean(ifd), "ifd_median": statistics.median(ifd),
               "ifd_ce": statistics.fmean(ifd_ce) if ifd_ce else float("nan"),
               "frac_ifd_above_1": sum(v > 1 for v in ifd) / len(ifd), "samples": len(kept),
               "skipped": len(records) - len(kept)}  # fmt: skip
    return Report(task="ifd", model=cfg.model, metrics=metrics, samples=samples)

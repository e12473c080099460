"""`astrai eval mc`: multiple-choice accuracy (MMLU and its format), scored exactly as lm-eval's `mmlu` task.

Prompt (lm-eval `tasks/mmlu/default/_default_template_yaml` + `_generate_configs.py`, `first_n` few-shot
sampler): the description "The following are multiple choice questions (with answers) about {subject with _ as
spaces}.\\n\\n", then K solved examples from the dev split of the same subject in file order, each
"{question.strip()}\\nA. {choice}\\nB. ...\\nAnswer: {letter}\\n\\n", then the question the same way ending at
"Answer:". Each choice is the continuation " A", " B", ...; the prediction is the choice of highest total
log-likelihood (the first on ties), accuracy the share of predictions equal to the answer.

Tokens as lm-eval's `hf` backend (`_encode_pair`): the context is encoded with the tokenizer's post-processor
(a leading BOS where the model has one, never a second one), context + continuation likewise, and the
continuation is what the whole has beyond the context's tokens; the sequence is cut from the left to the
model's context + 1 tokens. When every continuation is one token (" A" usually is), one forward scores all
choices (`scoring.Request.candidates`); otherwise each choice is its own row.

Data: MMLU's CSV files (no header: question, choices..., answer letter; the subject is the file name less
`_test`/`_dev`/`_val`), a folder of them (MMLU's `data/test`; its sibling `data/dev` is the default few-shot
split), or JSON lines with `question`, `choices` (list), `answer` (index or letter) and optional `subject`
(cais/mmlu's fields). Reported: `acc` over all questions (lm-eval's `mmlu` group number: subjects weighted by
size), `acc_macro` (mean of the per-subject accuracies), and the per-subject table.
Not here: chat templates, option permutation, generative (exact-match) variants.
"""

from __future__ import annotations

import csv
import string
from collections import defaultdict
from pathlib import Path

import attrs

from astrai.eval.common import EvalConfig, check, first, load_model, progress, require_tokenizer
from astrai.eval.data import DataError, existing, read_records
from astrai.eval.report import Report
from astrai.eval.scoring import Request, score
from astrai.io.model import Model
from astrai.io.tokenizer import Tokenizer

LETTERS = string.ascii_uppercase
SPLIT_SUFFIXES = ("_test", "_dev", "_val", "_validation")


@attrs.frozen(kw_only=True)
class Config(EvalConfig):
    """Multiple-choice accuracy (MMLU format), lm-eval's `mmlu` prompt and scoring."""

    data: Path
    """MMLU CSV file or folder of them (data/test), or a .jsonl file (question, choices, answer[, subject])."""
    dev: Path | None = None
    """Few-shot examples (same formats); default: the `dev` folder beside a `test`/`val` data folder."""
    num_fewshot: int = 0
    """Solved examples before each question, the first K of its subject's dev split (lm-eval's default: 0)."""


@attrs.frozen
class Question:
    """One multiple-choice question."""

    question: str
    choices: tuple[str, ...]
    answer: int
    subject: str
    where: str


def _answer(value: object, n: int, where: str) -> int:
    if isinstance(value, bool):
        raise DataError(f"{where}: answer must be a letter or an index, got {value!r}")
    if isinstance(value, int):
        index = value
    elif isinstance(value, str) and len(value.strip()) == 1 and value.strip().upper() in LETTERS:
        index = LETTERS.index(value.strip().upper())
    else:
        raise DataError(f"{where}: answer must be a letter A-{LETTERS[n - 1]} or an index, got {value!r}")
    if not 0 <= index < n:
        raise DataError(f"{where}: answer {value!r} is not one of the {n} choices")
    return index


def _subject(path: Path) -> str:
    stem = path.stem
    for suffix in SPLIT_SUFFIXES:
        if stem.endswith(suffix):
            return stem[: -len(suffix)]
    return stem


def _read_csv(path: Path) -> list[Question]:
    out = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        try:
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if not any(cell.strip() for cell in row):
                    continue
                if len(row) < 4 or len(row) - 2 > len(LETTERS):
                    raise DataError(f"{where}: expected question,A,B,...,answer (at least 4 columns), got {len(row)}")
                choices = tuple(row[1:-1])
                out.append(Question(row[0], choices, _answer(row[-1], len(choices), where), _subject(path), where))
        except csv.Error as err:
            raise DataError(f"{path}:{reader.line_num}: {err}") from None
    return out


def _read_jsonl(path: Path) -> list[Question]:
    out = []
    for r in read_records(path):
        d, where = r.data, r.where
        missing = [k for k in ("question", "choices", "answer") if k not in d]
        if missing:
            raise DataError(f"{where}: missing field {', '.join(map(repr, missing))}")
        if not isinstance(d["question"], str):
            raise DataError(f"{where}: question must be a string")
        choices = d["choices"]
        if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
            raise DataError(f"{where}: choices must be a list of 2 to {len(LETTERS)} items")
        subject = d.get("subject") or ""
        if not isinstance(subject, str):
            raise DataError(f"{where}: subject must be a string")
        out.append(Question(d["question"], tuple(str(c) for c in choices), _answer(d["answer"], len(choices), where),
                            subject, where))  # fmt: skip
    return out


def read_questions(path: str | Path) -> list[Question]:
    """The questions of an MMLU CSV file, a folder of them (sorted by name), or a JSON-lines file.

    Raises:
        FileNotFoundError: no such file or folder.
        DataError: a malformed row or record (file and line named), or no questions at all.
    """
    path = existing(path, "file or folder")
    if path.is_dir():
        files = sorted(path.glob("*.csv"))
        if not files:
            raise DataError(f"{path}: no .csv files in this folder")
        questions = [q for f in files for q in _read_csv(f)]
    elif path.suffix == ".csv":
        questions = _read_csv(path)
    else:
        questions = _read_jsonl(path)
    if not questions:
        raise DataError(f"{path}: no questions (the dataset is empty)")
    return questions


def description(subject: str) -> str:
    """lm-eval's `mmlu` description for `subject` (underscores as spaces)."""
    about = f" about {' '.join(subject.split('_'))}" if subject else ""
    return f"The following are multiple choice questions (with answers){about}.\n\n"


def question_text(q: Question) -> str:
    """lm-eval's `mmlu` `doc_to_text` (generalised from 4 to any number of choices)."""
    options = "".join(f"{LETTERS[i]}. {c}\n" for i, c in enumerate(q.choices))
    return f"{q.question.strip()}\n{options}Answer:"


def context(q: Question, shots: list[Question]) -> str:
    """The prompt before the answer: description, the solved shots, then the question."""
    solved = "".join(f"{question_text(s)} {LETTERS[s.answer]}\n\n" for s in shots)
    return description(q.subject) + solved + question_text(q)


def encode_pair(tok: Tokenizer, ctx: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair` for causal models: trailing context spaces move to the continuation; the
    continuation's tokens are those of context + continuation beyond the context's own token count."""
    n_spaces = len(ctx) - len(ctx.rstrip())
    if n_spaces:
        ctx, continuation = ctx[:-n_spaces], ctx[-n_spaces:] + continuation
    whole = tok.encode_prompt(ctx + continuation)
    ctx_ids = tok.encode_prompt(ctx)
    return ctx_ids, whole[len(ctx_ids) :]


def _requests(q: Question, ctx: str, tok: Tokenizer, max_length: int) -> list[Request]:
    """Rows scoring each choice of `q` (one row when every continuation is a single token)."""
    pairs = [encode_pair(tok, ctx, f" {LETTERS[i]}") for i in range(len(q.choices))]
    if any(not cont for _, cont in pairs):
        raise DataError(f"{q.where}: a choice letter encodes to no tokens after the prompt")
    if all(len(cont) == 1 for _, cont in pairs):
        ids = (pairs[0][0] + pairs[0][1])[-(max_length + 1) :]
        return [Request(ids, len(ids) - 1, [cont[0] for _, cont in pairs])]
    out = []
    for ctx_ids, cont in pairs:
        ids = (ctx_ids + cont)[-(max_length + 1) :]
        out.append(Request(ids, len(ids) - len(cont)))
    return out


def _dev_path(cfg: Config) -> Path:
    if cfg.dev is not None:
        return cfg.dev
    data = Path(cfg.data).expanduser()
    sibling = data.parent / "dev"
    if data.is_dir() and data.name in ("test", "val") and sibling.is_dir():
        return sibling
    raise ValueError(f"--num-fewshot {cfg.num_fewshot} needs --dev (a dev split: MMLU's data/dev, or a .jsonl file)")


def _shots(cfg: Config, questions: list[Question]) -> dict[str, list[Question]]:
    if cfg.num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {cfg.num_fewshot}")
    if cfg.num_fewshot == 0:
        return defaultdict(list)
    dev = _dev_path(cfg)
    by_subject: dict[str, list[Question]] = defaultdict(list)
    for d in read_questions(dev):
        by_subject[d.subject].append(d)
    for subject in dict.fromkeys(q.subject for q in questions):
        have = len(by_subject.get(subject, ()))
        if have < cfg.num_fewshot:
            raise DataError(f"{dev}: subject {subject or '(none)'!r} has {have} dev examples, fewer than "
                            f"--num-fewshot {cfg.num_fewshot}")  # fmt: skip
    return {s: qs[: cfg.num_fewshot] for s, qs in by_subject.items()}


def evaluate(cfg: Config, model: Model | None = None) -> Report:
    """Accuracy on `cfg.data` under `model` (loaded from `cfg.model` when None).

    Raises:
        FileNotFoundError, DataError: a missing, malformed or empty dataset or dev split.
        ValueError: few-shot without a dev split, or a model without a tokenizer.
    """
    check(cfg)
    questions = first(read_questions(cfg.data), cfg.limit)
    shots = _shots(cfg, questions)
    model = require_tokenizer(model, cfg.model, "mc") if model is not None else load_model(cfg, "mc")
    max_length = model.config.max_position_embeddings
    requests, owner = [], []
    for i, q in enumerate(questions):
        for r in _requests(q, context(q, shots.get(q.subject, [])), model.tokenizer, max_length):
            requests.append(r)
            owner.append(i)
    with progress(len(requests), "mc: questions") as advance:
        scores = score(model, requests, batch_size=cfg.batch_size, advance=advance)
    loglik: list[list[float]] = [[] for _ in questions]
    for i, s in zip(owner, scores, strict=True):
        loglik[i].extend(s.candidates.tolist() if s.candidates.numel() else [s.total])
    return _report(cfg, questions, loglik)


def _report(cfg: Config, questions: list[Question], loglik: list[list[float]]) -> Report:
    samples, per_subject = [], defaultdict(list)
    for q, ll in zip(questions, loglik, strict=True):
        pred = max(range(len(ll)), key=lambda i: (ll[i], -i))  # the first of equal maxima, as np.argmax
        per_subject[q.subject or "(none)"].append(pred == q.answer)
        samples.append({"where": q.where, "subject": q.subject, "answer": LETTERS[q.answer], "pred": LETTERS[pred],
                        "correct": pred == q.answer, "loglikelihoods": ll})  # fmt: skip
    groups = {s: {"acc": sum(v) / len(v), "n": len(v)} for s, v in sorted(per_subject.items())}
    correct = sum(s["correct"] for s in samples)
    metrics = {"acc": correct / len(samples), "acc_macro": sum(g["acc"] for g in groups.values()) / len(groups),
               "questions": len(samples), "subjects": len(groups), "num_fewshot": cfg.num_fewshot}  # fmt: skip
    return Report(task="mc", model=cfg.model, metrics=metrics, samples=samples, groups=groups)

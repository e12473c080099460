"""The offline preprocessing run: JSONL records -> rendered, tokenized, packed, memory-mapped shards.

`preprocess(cfg)` reads the inputs line by line (blank lines skipped), renders and tokenizes `batch_size`
records per tokenizer call, buffers them in the kind's builder and writes a shard each time
`max_tokens_per_shard` tokens are buffered. The whole output folder is written into a temporary sibling and
renamed into place at the end, so a failed or interrupted run leaves no partial output (and keeps any
previous one). Because that rename replaces the whole folder, an output folder that is or holds an input file
or the tokenizer folder is refused, and `overwrite` replaces only a previous run's output (meta.json + shards):
a folder holding anything else is refused, naming what it holds, before any work is done.

Bad input never stops the run: a malformed line or record is skipped and counted by reason (bad_json,
bad_encoding, not_an_object, missing_field, wrong_type, too_short, too_long, empty, no_trained_tokens,
template_error, template_not_prefix), with the first few `file:line` samples of each reason kept for the
report. Only a run that keeps nothing fails.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import cattrs
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from astrai.data.builders import Builder
from astrai.data.config import DataConfig
from astrai.data.render import RecordError, render_batch
from astrai.data.shards import META_FILE, token_dtype, write_meta, write_shard
from astrai.io.checkpoint import atomic_dir
from astrai.io.tokenizer import Tokenizer

SAMPLES_PER_REASON = 3
OUTPUT_ENTRIES = (META_FILE, "shard_*")
"""What an output folder holds: `overwrite` replaces a folder of only these (a previous run's output)."""


@attrs.define
class Report:
    """What a run read, kept, skipped (by reason, with `file:line` samples) and wrote."""

    records: int = 0
    kept: int = 0
    truncated: int = 0
    skipped: Counter = attrs.Factory(Counter)
    samples: dict[str, list[str]] = attrs.Factory(dict)
    rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    shards: int = 0

    def skip(self, where: str, err: RecordError) -> None:
        """Count a skipped record and keep the first few samples of its reason."""
        self.skipped[err.reason] += 1
        samples = self.samples.setdefault(err.reason, [])
        if len(samples) < SAMPLES_PER_REASON:
            samples.append(f"{where}: {err.detail}")

    def as_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "skipped": dict(self.skipped)}


def input_files(inputs: tuple[str, ...]) -> list[Path]:
    """The JSONL files named by `inputs` (folders give their *.jsonl files, sorted).

    Raises:
        FileNotFoundError: an input does not exist, or a folder has no *.jsonl file.
    """
    files: list[Path] = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise FileNotFoundError(f"input folder {path} has no *.jsonl file")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path} does not exist")
    return files


def check_output(out: Path, files: list[Path], tokenizer_dir: str | None) -> None:
    """Refuse an output folder that is, or lies above, an input file or the tokenizer folder: the run replaces
    the whole output folder, which would delete them.

    Raises:
        ValueError: naming the output and the input or tokenizer it would delete.
    """
    target = out.resolve()
    named = [(f, "input") for f in files] + ([(Path(tokenizer_dir), "tokenizer folder")] if tokenizer_dir else [])
    for path, what in named:
        resolved = path.resolve()
        if resolved == target or target in resolved.parents:
            raise ValueError(f"output folder {out} is or holds the {what} {path}, and writing the output replaces "
                             "the whole folder; choose another output folder")  # fmt: skip


def read_jsonl(path: Path, report: Report) -> Iterator[tuple[str, dict[str, Any], int]]:
    """Yield (`file:line`, record, bytes read so far) for each JSON object line; bad lines are counted."""
    with open(path, "rb") as f:
        done = 0
        for number, raw in enumerate(f, start=1):
            done += len(raw)
            if not raw.strip():
                continue
            report.records += 1
            where = f"{path}:{number}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                report.skip(where, RecordError("bad_encoding", f"not UTF-8 ({err.reason} at byte {err.start})"))
                continue
            except json.JSONDecodeError as err:
                report.skip(where, RecordError("bad_json", err.msg + f" at column {err.colno}"))
                continue
            except RecursionError:
                report.skip(where, RecordError("bad_json", "nested too deeply"))
                continue
            if not isinstance(record, dict):
                report.skip(where, RecordError("not_an_object", f"a JSON {type(record).__name__}, not an object"))
                continue
            yield where, record, done


def _sides(cfg: DataConfig) -> list[tuple]:
    if cfg.kind == "dpo":
        return [cfg.prompt + cfg.chosen, cfg.prompt + cfg.rejected]
    return [cfg.prompt if cfg.kind == "grpo" else cfg.sections]


@attrs.define
class _Run:
    cfg: DataConfig
    tokenizer: Tokenizer
    folder: Path
    report: Report
    builder: Builder
    shard_meta: list[dict] = attrs.Factory(list)

    def process(self, batch: list[tuple[str, dict[str, Any]]]) -> None:
        results = render_batch(self.tokenizer, [r for _, r in batch], self.cfg, _sides(self.cfg))
        for (where, record), result in zip(batch, results, strict=True):
            if self.full:
                return
            try:
                if isinstance(result, RecordError):
                    raise result
                self.report.truncated += self.builder.add(record, result)
                self.report.kept += 1
            except RecordError as err:
                self.report.skip(where, err)
            if self.builder.buffered_tokens >= self.cfg.preprocessing.max_tokens_per_shard:
                self.flush()

    @property
    def full(self) -> bool:
        limit = self.cfg.preprocessing.max_items
        return limit is not None and self.report.kept >= limit

    def flush(self) -> None:
        if not self.builder.docs:
            return
        shard = self.builder.take()
        name = f"shard_{len(self.shard_meta):04d}"
        entry = write_shard(self.folder, name, shard.arrays, shard.answers)
        self.shard_meta.append({**entry, "rows": shard.rows, "tokens": shard.tokens})
        self.report.rows += shard.rows
        self.report.tokens += shard.tokens
        self.report.trained_tokens += shard.trained_tokens
        self.report.shards += 1


def _progress(enabled: bool) -> Progress:
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    return Progress(*columns, TextColumn("{task.fields[kept]} kept"), disable=not enabled)


def _write(folder: Path, run: _Run, files: list[Path], progress: bool) -> None:
    batch_size = run.cfg.preprocessing.batch_size
    with _progress(progress) as bar:
        task = bar.add_task("preprocess", total=sum(f.stat().st_size for f in files), kept=0)
        base = 0
        for path in files:
            batch: list[tuple[str, dict[str, Any]]] = []
            for where, record, done in read_jsonl(path, run.report):
                batch.append((where, record))
                if len(batch) == batch_size:
                    run.process(batch)
                    batch = []
                    bar.update(task, completed=base + done, kept=run.report.kept)
                if run.full:
                    break
            run.process(batch)
            base += path.stat().st_size
            bar.update(task, completed=base, kept=run.report.kept)
            if run.full:
                break
    run.flush()
    if run.report.kept == 0:
        reasons = ", ".join(f"{k}: {n}" for k, n in run.report.skipped.most_common()) or "no records"
        raise ValueError(f"no record was usable ({run.report.records} read; {reasons}); nothing written")


def _meta(run: _Run) -> dict[str, Any]:
    tok = run.tokenizer
    converter = cattrs.Converter()
    return {
        "kind": run.cfg.kind,
        "vocab_size": tok.vocab_size,
        "token_dtype": token_dtype(tok.vocab_size).str,
        "eos_id": tok.eos_token_id,
        "pad_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        "bos_id": tok.bos_token_id,
        "max_packed_len": run.cfg.preprocessing.max_packed_len if run.cfg.kind == "sft" else None,
        "shards": run.shard_meta,
        "counts": run.report.as_dict(),
        "config": converter.unstructure(run.cfg),
    }


def preprocess(
    cfg: DataConfig, *, tokenizer: Tokenizer | None = None, overwrite: bool = False, progress: bool = False
) -> Report:
    """Run the preprocessing `cfg` describes and write `cfg.output` atomically.

    Args:
        cfg: a validated config (see `astrai.data.config.load_config`).
        tokenizer: use this tokenizer instead of loading `cfg.tokenizer`.
        overwrite: replace an existing output folder of a previous run (meta.json + shards only), once the new
            one is complete.
        progress: show a rich progress bar.

    Returns:
        The run's counts (also stored under "counts" in meta.json).

    Raises:
        ValueError: no tokenizer or output given, the output exists without `overwrite`, the output is or holds
            an input or the tokenizer, a pretrain tokenizer without EOS, a missing chat template, or no usable
            record at all.
        FileExistsError: with `overwrite`, the output is a file or holds entries other than meta.json + shards.
        FileNotFoundError: a missing input or tokenizer folder.
    """
    if cfg.output is None:
        raise ValueError("no output folder: set 'output' in the config or pass --output")
    if tokenizer is None:
        if cfg.tokenizer is None:
            raise ValueError("no tokenizer: set 'tokenizer' in the config or pass --tokenizer")
        tokenizer = Tokenizer.from_dir(cfg.tokenizer)
    if cfg.kind == "pretrain" and tokenizer.eos_token_id is None:
        raise ValueError("pretraining separates documents with EOS, but the tokenizer has no eos_token")
    sections = cfg.sections + cfg.prompt + cfg.chosen + cfg.rejected
    if any(s.template for s in sections) and tokenizer.chat_template is None:
        raise ValueError("template sections need a chat template, and the tokenizer has none")
    out = Path(cfg.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"output folder {out} exists and is not empty (pass --overwrite to replace it)")
    files = input_files(cfg.inputs)
    check_output(out, files, cfg.tokenizer)
    report = Report()

    def write(folder: Path) -> None:
        builder = Builder(cfg, tokenizer.vocab_size, tokenizer.eos_token_id)
        run = _Run(cfg, tokenizer, folder, report, builder)
        _write(folder, run, files, progress)
        write_meta(folder, _meta(run))

    atomic_dir(out, write, replaces=OUTPUT_ENTRIES, kind="preprocess output folder")
    return report

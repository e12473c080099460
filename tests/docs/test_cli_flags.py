"""Every `astrai ...` command line in the README and docs names only flags that its subcommand takes.

A user copies these lines; a renamed or removed flag (e.g. `--no-fuse-projections` after the flag became
`--fuse-projections {auto,on,off}`) fails as "Unrecognized options" only when run. The test collects the command
lines of fenced shell blocks and of inline code spans that start with `astrai <subcommand>`, reads each
subcommand's `--help` through the real entry point, and checks every `--flag` of the line is in it. Negative
controls: a made-up flag and the old `--no-fuse-projections` are not found.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
from pathlib import Path

import pytest

from astrai.cli.main import COMMANDS
from astrai.cli.main import main as astrai_main

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--(\[no-\])?([a-z][a-z0-9_.-]*[a-z0-9])")


def _command_lines(text: str) -> list[str]:
    """`astrai ...` lines of shell blocks (continuations joined) and inline code spans, comments dropped."""
    lines = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```$", text, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"^\s*\$\s*", "", line).split(" #")[0]
            lines += [m.group(0) for m in re.finditer(r"(?<![\w/.-])astrai [a-z].*", line)]
    lines += [s for s in re.findall(r"`([^`\n]+)`", text) if re.match(r"astrai [a-z]", s)]
    return lines


@functools.cache
def _help(*command: str) -> str:
    """The `--help` text of `astrai <command...>`, through the real entry point."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        astrai_main([*command, "--help"])
    return re.sub(r"\s+", " ", out.getvalue())


def _subcommands(group: str) -> list[str]:
    if group == "train":
        from astrai.configs.recipes import RECIPES

        return sorted(RECIPES)
    from astrai.cli.eval import tasks

    return sorted(tasks())


def _help_for(words: list[str]) -> str:
    """The help of the line's subcommand; for `train`/`eval` that of the named recipe/task, or all of theirs."""
    command = words[1]
    if command not in ("train", "eval"):
        return _help(command)
    named = words[2] if len(words) > 2 else ""
    subs = _subcommands(command)
    return _help(command, named) if named in subs else " ".join(_help(command, s) for s in subs)


def _flags(line: str) -> list[str]:
    found = []
    for m in FLAG.finditer(line):
        found.append(f"--{m.group(2)}")
        if m.group(1):
            found.append(f"--no-{m.group(2)}")
    return [f for f in found if f != "--help"]


def _cases() -> list[tuple[str, str]]:
    cases = []
    for doc in DOCS:
        for line in _command_lines(doc.read_text(encoding="utf-8")):
            words = line.split()
            if words[1] in COMMANDS and _flags(line):
                cases.append((str(doc.relative_to(ROOT)), line))
    return cases


def _serve_table_flags() -> list[str]:
    """The flags named in the first column of docs/serving.md's tables (all of them `astrai serve` flags)."""
    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    return [flag for row in re.findall(r"^\| (`--[^|]*(?:\\\|[^|]*)*)\|", text, flags=re.M) for flag in _flags(row)]


CASES = _cases()


def test_the_docs_have_command_lines_with_flags():
    assert len(CASES) >= 50, len(CASES)
    assert {line.split()[1] for _, line in CASES} >= {"serve", "generate", "train", "eval", "preprocess"}


@pytest.mark.parametrize("doc, line", CASES, ids=[f"{d}:{i}" for i, (d, _) in enumerate(CASES)])
def test_every_flag_of_a_documented_command_exists(doc, line):
    text = _help_for(line.split())
    missing = [f for f in _flags(line) if not re.search(rf"{re.escape(f)}(?![\w-])", text)]
    assert not missing, f"{doc}: `{line}` uses {missing}, which `astrai {line.split()[1]} --help` does not list"


def test_every_flag_of_the_serving_table_exists():
    flags = _serve_table_flags()
    assert len(flags) >= 40 and "--max-num-seqs" in flags and "--no-embed-normalize" in flags, flags
    missing = [f for f in flags if not re.search(rf"{re.escape(f)}(?![\w-])", _help("serve"))]
    assert not missing, f"docs/serving.md's flag table names {missing}, which `astrai serve --help` does not list"


@pytest.mark.parametrize("line", ["astrai serve DIR --no-fuse-projections", "astrai eval ppl M --made-up-flag"])
def test_negative_control_unknown_flags_are_caught(line):
    text = _help_for(line.split())
    assert any(not re.search(rf"{re.escape(f)}(?![\w-])", text) for f in _flags(line))

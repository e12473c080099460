"""Build the docs that are generated from other files, check that they are current, or run a notebook.

    python docs/render.py                 # write docs/notebooks/*.ipynb and docs/api.md
    python docs/render.py --check         # exit 1 naming each stale file (tests/docs checks the same)
    python docs/render.py --execute docs/notebooks/tour.py   # run a notebook's code cells in order

Notebooks are written in percent format (`docs/notebooks/*.py`: `# %%` opens a code cell, `# %% [markdown]` a
markdown cell whose lines are `# `-prefixed); each renders to an nbformat 4.5 `.ipynb` beside it, with no
outputs, written by hand here (no nbformat/jupytext dependency). `docs/api.md` is generated from the docstrings
and signatures of the names `astrai/__init__.py` exports; Google-style sections (`Args:`, `Returns:`, ...) become
lists, and attrs config classes get a field table from their attribute docstrings.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # a source checkout works without installing astrai
NOTEBOOKS = ROOT / "docs" / "notebooks"
API_PAGE = ROOT / "docs" / "api.md"
# reading order of the API page; exports not listed here follow in astrai/__init__.py's order
ORDER = ("load", "save", "forward", "generate", "generate_ids", "chat", "embed", "embed_ids", "init_params", "Model",
         "ModelConfig", "Tokenizer")  # fmt: skip
SECTIONS = ("Args", "Arguments", "Returns", "Raises", "Attributes", "Yields", "Example", "Examples", "Note", "Notes")


# ---- notebooks ----------------------------------------------------------------------------------------------
def parse_cells(text: str, name: str = "notebook") -> list[tuple[str, str, int]]:
    """The cells of a percent-format notebook as (kind, source, first line number); empty cells are dropped."""
    cells: list[tuple[str, str, int]] = []
    kind, lines, start = None, [], 0

    def flush() -> None:
        while lines and not lines[-1].strip():
            lines.pop()
        first = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
        if kind is not None and lines[first:]:
            cells.append((kind, "\n".join(lines[first:]), start + first))

    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("# %%"):
            flush()
            kind, lines, start = ("markdown" if "[markdown]" in line else "code"), [], number + 1
        elif kind is None:
            if line.strip():
                raise ValueError(f"{name}:{number}: text before the first `# %%` cell")
        elif kind == "markdown":
            if line.strip() and line != "#" and not line.startswith("# "):
                raise ValueError(f"{name}:{number}: a markdown cell line must start with '# '")
            lines.append(line[2:])
        else:
            lines.append(line)
    flush()
    return cells


def to_ipynb(cells: list[tuple[str, str, int]]) -> str:
    """nbformat 4.5 JSON of the cells (no outputs, stable cell ids), as Jupyter writes it (indent 1)."""

    def cell(i: int, kind: str, source: str) -> dict[str, Any]:
        lines = source.split("\n")
        out: dict[str, Any] = {"cell_type": kind, "id": f"cell-{i}", "metadata": {}}
        if kind == "code":
            out.update(execution_count=None, outputs=[])
        out["source"] = [line + "\n" for line in lines[:-1]] + [lines[-1]]
        return out

    notebook = {
        "cells": [cell(i, kind, source) for i, (kind, source, _) in enumerate(cells)],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def execute(path: Path) -> int:
    """Run the code cells of `path` in order in one namespace; 0, or 1 after printing the failing cell's error."""
    cells = [c for c in parse_cells(path.read_text(encoding="utf-8"), str(path)) if c[0] == "code"]
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for i, (_, source, line) in enumerate(cells, 1):
        print(f"--- {path.name}: cell {i}/{len(cells)} (line {line})", flush=True)
        t0 = time.perf_counter()
        try:
            exec(compile("\n" * (line - 1) + source, str(path), "exec"), namespace)
        except BaseException:  # noqa: B036 (report whatever stopped the cell, SystemExit included)
            traceback.print_exc()
            print(f"FAILED: {path.name} cell {i}/{len(cells)} (line {line})", flush=True)
            return 1
        print(f"--- cell {i} took {time.perf_counter() - t0:.2f} s", flush=True)
    return 0


# ---- API page -----------------------------------------------------------------------------------------------
def exports() -> list[str]:
    """Names `astrai/__init__.py` re-exports (`from x import y as y`), in the page's reading order."""
    tree = ast.parse((ROOT / "astrai" / "__init__.py").read_text(encoding="utf-8"))
    names = [a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names if a.asname == a.name]
    return [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]


def _annotation(value: Any) -> str:
    return value if isinstance(value, str) else inspect.formatannotation(value)


def stub(name: str, obj: Any) -> str:
    """`def name(params) -> ret: ...` for a function or method: valid Python, annotations as in the source."""
    sig = inspect.signature(obj)
    parts, star_done = [], False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
        star_done = star_done or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    ret = "" if sig.return_annotation is sig.empty else f" -> {_annotation(sig.return_annotation)}"
    return f"def {name}({', '.join(parts)}){ret}: ..."


def docstring_md(doc: str) -> str:
    """A Google-style docstring as Markdown: sections become bold titles with `name`: text bullets."""
    out, lines, i = [], doc.splitlines(), 0
    while i < len(lines):
        match = re.fullmatch(r"(\w+):\s*", lines[i])
        if not (match and match.group(1) in SECTIONS):
            out.append(lines[i])
            i += 1
            continue
        section = match.group(1)
        out += [f"**{section}:**", ""]
        i += 1
        items: list[str] = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
            line = lines[i]
            if line.strip() and (len(line) - len(line.lstrip())) <= 4:
                entry = re.match(r"\s*([\w*, .\[\]]+?)( \([^)]*\))?:\s(.*)", line)
                if entry and section in ("Args", "Arguments", "Raises", "Attributes"):
                    items.append(f"- `{entry.group(1)}`{entry.group(2) or ''}: {entry.group(3)}")
                else:
                    items.append(line.strip())
            elif line.strip():
                items[-1] += " " + line.strip()
            i += 1
        out += [*items, ""]
    return "\n".join(out).strip() + "\n"


def _class_source(cls: type) -> tuple[str, ast.ClassDef]:
    source = inspect.cleandoc("\n" + inspect.getsource(cls))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    return source, node


def _fields(cls: type) -> list[tuple[str, str, str, str]]:
    """attrs fields as (name, annotation, default as written in the source or "", attribute docstring)."""
    source, node = _class_source(cls)
    body, found = node.body, {}
    for item, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            default = ast.get_source_segment(source, item.value) if item.value is not None else ""
            is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            doc = " ".join(str(after.value.value).split()) if is_doc else ""
            found[item.target.id] = (ast.get_source_segment(source, item.annotation), default or "", doc)
    return [(f.name, *found.get(f.name, (_annotation(f.type), "", ""))) for f in attrs.fields(cls)]


def _members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined on `cls` itself, in source order."""
    fields = {f.name for f in attrs.fields(cls)} if attrs.has(cls) else set()
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name in fields:
            continue
        if isinstance(value, (staticmethod, classmethod, property)) or inspect.isfunction(value):
            out.append((name, value))
    return out


def _code(text: str) -> list[str]:
    return ["```python", text, "```", ""]


def _class_md(name: str, cls: type) -> list[str]:
    doc = docstring_md(inspect.getdoc(cls) or "")
    bases = ", ".join(b.__name__ for b in cls.__bases__ if b is not object)
    head = f"class {name}({bases}):" if bases else f"class {name}:"
    if issubclass(cls, BaseException):
        return [*_code(f"{head} ..."), doc]
    if not attrs.has(cls):
        return [*_code(f"{head}\n    {stub('__init__', cls.__init__)}"), doc, *_members_md(name, cls)]
    fields = _fields(cls)
    if not any(text for *_, text in fields):  # documented in the class docstring: show the fields as written
        body = "\n".join(f"    {n}: {a}" + (f" = {d}" if d else "") for n, a, d, _ in fields)
        return [*_code(f"{head}\n{body}"), doc, *_members_md(name, cls)]
    out = [*_code(f"{head}  # attrs, keyword-only fields: {name}(field=value, ...)"), doc]
    out += ["| field | type | default | meaning |", "|---|---|---|---|"]
    for n, a, d, text in fields:
        cell = lambda t: t.replace("|", "\\|")  # noqa: E731
        out.append(f"| `{n}` | `{cell(a)}` | {f'`{cell(d)}`' if d else 'required'} | {cell(text)} |")
    return [*out, "", *_members_md(name, cls)]


def _members_md(name: str, cls: type) -> list[str]:
    out = []
    for member, value in _members(cls):
        if isinstance(value, property):
            fget = value.fget
            ret = fget.__annotations__.get("return") if fget is not None else None
            code = f"@property\ndef {member}(self)" + (f" -> {_annotation(ret)}" if ret else "") + ": ..."
            text = value.__doc__ or ""
        else:
            decorator = f"@{type(value).__name__}\n" if isinstance(value, (staticmethod, classmethod)) else ""
            function = getattr(value, "__func__", value)
            code, text = decorator + stub(member, function), inspect.getdoc(function) or ""
        out += [f"### {name}.{member}", "", *_code(code)]
        if text:
            out.append(docstring_md(inspect.cleandoc(text)))
    return out


def _ruff_format(markdown: str) -> str:
    """`markdown` with its python code blocks formatted as `ruff format` (the repo's settings) formats them."""
    command = [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(API_PAGE.relative_to(ROOT)), "-"]
    done = subprocess.run(command, input=markdown, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ruff format failed (is ruff installed? pip install -e '.[dev]'): {done.stderr}")
    return done.stdout


def api_page() -> str:
    """The text of docs/api.md."""
    astrai = importlib.import_module("astrai")
    names = exports()
    out = [
        "# API reference",
        "",
        "<!-- Generated by `python docs/render.py` from the docstrings and signatures; edit those, not this page. -->",
        "",
        "The public API is what `astrai/__init__.py` exports (SPEC §1): `import astrai`, then `astrai.load(...)`.",
        "Other modules are reachable by their paths and documented in their module docstrings. The",
        "[tour notebook](notebooks/tour.py) uses most of these.",
        "",
        *(f"- [`astrai.{n}`](#astrai{n.lower()})" for n in names),
        "",
    ]
    for name in names:
        obj = getattr(astrai, name)
        out += [f"## astrai.{name}", "", f"Defined in `{obj.__module__}`.", ""]
        if inspect.isclass(obj):
            out += _class_md(name, obj)
        else:
            out += [*_code(stub(name, obj)), docstring_md(inspect.getdoc(obj) or "")]
    return _ruff_format("\n".join(out).rstrip() + "\n")


# ---- driver -------------------------------------------------------------------------------------------------
def outputs() -> dict[Path, str]:
    """Every generated file and the text it should hold."""
    files = {}
    for source in sorted(NOTEBOOKS.glob("*.py")):
        if source.name != "__init__.py":
            cells = parse_cells(source.read_text(encoding="utf-8"), str(source))
            files[source.with_suffix(".ipynb")] = to_ipynb(cells)
    files[API_PAGE] = api_page()
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the generated files are current")
    parser.add_argument("--execute", type=Path, metavar="NOTEBOOK", help="run a percent-format notebook's cells")
    args = parser.parse_args(argv)
    if args.execute is not None:
        return execute(args.execute)
    files, stale = outputs(), []
    for path, text in files.items():
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != text:
            stale.append(path)
            if not args.check:
                path.write_text(text, encoding="utf-8")
    if args.check and stale:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(f"stale (regenerate with `python docs/render.py`): {names}", file=sys.stderr)
        return 1
    print(("wrote " if stale else "up to date: ") + ", ".join(str(p.relative_to(ROOT)) for p in (stale or files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

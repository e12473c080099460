"""The percent-format notebooks in docs/notebooks/ run cell by cell in a fresh process without error, and each
committed `.ipynb` equals a fresh render of its `.py` source (so the two cannot drift)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.py"))
TIMEOUT_S = 240  # the tour takes ~10-25 s on a CPU; the bound only stops a hung server or training run


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["tour.py"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_cell_by_cell(notebook, tmp_path, render):
    command = [sys.executable, str(ROOT / "docs" / "render.py"), "--execute", str(notebook)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{notebook.name} failed:\n{output[-6000:]}"
    cells = sum(1 for kind, *_ in render.parse_cells(notebook.read_text()) if kind == "code")
    assert f"--- cell {cells} took" in output  # every code cell ran
    assert list(tmp_path.iterdir()) == []  # the notebook writes only to its own temporary folder


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_ipynb_is_a_fresh_render(notebook, render):
    ipynb = notebook.with_suffix(".ipynb")
    assert ipynb.is_file(), f"{ipynb.name} is missing: run `python docs/render.py`"
    fresh = render.to_ipynb(render.parse_cells(notebook.read_text(encoding="utf-8")))
    assert ipynb.read_text(encoding="utf-8") == fresh, f"{ipynb.name} is stale: run `python docs/render.py`"


def test_ipynb_is_valid_nbformat_4(render):
    text = render.to_ipynb(render.parse_cells("# %% [markdown]\n# # Title\n#\n# text\n\n# %%\nx = 1\n\nprint(x)\n"))
    nb = json.loads(text)
    assert (nb["nbformat"], nb["nbformat_minor"]) == (4, 5)
    md, code = nb["cells"]
    assert md == {"cell_type": "markdown", "id": "cell-0", "metadata": {}, "source": ["# Title\n", "\n", "text"]}
    assert code["cell_type"] == "code" and code["outputs"] == [] and code["execution_count"] is None
    assert code["source"] == ["x = 1\n", "\n", "print(x)"]


def test_parse_cells_rejects_malformed_sources(render):
    with pytest.raises(ValueError, match="before the first"):
        render.parse_cells("x = 1\n# %%\ny = 2\n")
    with pytest.raises(ValueError, match="must start with '# '"):
        render.parse_cells("# %% [markdown]\nnot a comment\n")


def test_execute_names_the_failing_cell(render, tmp_path, capsys):
    notebook = tmp_path / "broken.py"
    notebook.write_text("# %%\nx = 1\n\n# %% [markdown]\n# prose\n\n# %%\nassert x == 2, 'boom'\n")
    assert render.execute(notebook) == 1
    out = capsys.readouterr()
    assert "FAILED: broken.py cell 2/2 (line 8)" in out.out and "AssertionError: boom" in out.err

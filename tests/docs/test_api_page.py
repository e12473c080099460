"""docs/api.md is generated from the public API's docstrings (docs/render.py) and is current."""

import inspect
from pathlib import Path

import astrai

ROOT = Path(__file__).resolve().parents[2]


def test_committed_api_page_is_a_fresh_generation(render):
    committed = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert committed == render.api_page(), "docs/api.md is stale: run `python docs/render.py` and commit the result"


def test_every_public_name_has_a_section(render):
    public = {n for n, v in vars(astrai).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert set(render.exports()) == public
    page = render.api_page()
    for name in public:
        assert f"\n## astrai.{name}\n" in page and f"](#astrai{name.lower()})" in page, name
    assert "\n## astrai.chat\n" in page and "def chat(\n    model: Model," in page


def test_google_sections_become_lists(render):
    doc = "Summary.\n\nArgs:\n    x: the input,\n        continued.\n    y (int): other.\n\nReturns:\n    [B, T] ids."
    assert render.docstring_md(doc) == (
        "Summary.\n\n**Args:**\n\n- `x`: the input, continued.\n- `y` (int): other.\n\n**Returns:**\n\n[B, T] ids.\n"
    )

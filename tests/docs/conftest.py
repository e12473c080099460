"""Shared by the docs tests: `render`, the docs build script (docs/render.py) imported by path."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_render():
    spec = importlib.util.spec_from_file_location("astrai_docs_render", ROOT / "docs" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def render():
    return load_render()

"""The serve modules' imports point one way: app -> handlers -> state / protocols -> common (TYPE_CHECKING too)."""

import ast
from pathlib import Path

import astrai.serve

SERVE = Path(astrai.serve.__file__).parent


def serve_imports(name: str) -> set[str]:
    """The astrai.serve modules `name` imports anywhere in its file (function bodies and TYPE_CHECKING included)."""
    found = set()
    for node in ast.walk(ast.parse((SERVE / f"{name}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "astrai.serve":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("astrai.serve."):
            found.add(node.module.removeprefix("astrai.serve."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("astrai.serve.") for a in node.names if a.name.startswith("astrai.serve.")}
    return found - {name}


def test_protocols_do_not_know_the_server():
    for protocol in ("openai_protocol", "anthropic_protocol"):
        assert not serve_imports(protocol) & {"app", "state", "openai_api", "anthropic_api", "embeddings_api"}


def test_no_import_cycle_in_serve():
    graph = {p.stem: serve_imports(p.stem) for p in SERVE.glob("*.py") if p.stem != "__init__"}

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            if (mod := todo.pop()) not in seen and mod in graph:
                seen.add(mod)
                todo += graph[mod]
        return seen

    assert [m for m in graph if m in reach(m)] == []

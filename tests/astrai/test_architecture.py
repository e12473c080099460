"""The package's import graph: every import points down the layers, and no modules import each other in a cycle.

Layers, top to bottom (docs/architecture.md): the `astrai` package facade, cli, configs / quickstart / api,
serve, train, inference, data, io, models, nn, ops, the kernels (triton_kernels, cuda_ref, cpu_kernels), tree. A
module may import modules of its own package and of lower layers only, and only ops may import the kernels. Every import
statement counts: module-level, inside functions (lazy) and under `if TYPE_CHECKING:` (a lazy import is still a
dependency).

Also checked: the installed import names (pyproject's package list) all live under `astrai.`, so installing
astrai never shadows another distribution's top-level package (triton-lang's `triton_kernels`, which vLLM probes
for by name), and every package folder of the repo is in that list.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# import name -> source folder (pyproject's package-dir); everything else under astrai/ maps to itself
FOLDERS = {"astrai": "astrai", "astrai.triton_kernels": "triton_kernels", "astrai.cuda_ref": "cuda_ref",
           "astrai.cpu_kernels": "cpu_kernels", "astrai.configs": "configs",
           "astrai.quickstart": "quickstart"}  # fmt: skip

RANK = {
    "astrai": 11,  # the package facade (astrai/__init__.py re-exports)
    "cli": 10,
    "configs": 9,
    "quickstart": 9,
    "api": 9,
    "serve": 8,
    "train": 7,
    "eval": 6.5,  # below train: GRPO's rewards may reuse the evaluation sandbox and verifiers
    "inference": 6,
    "data": 5,
    "io": 4,
    "models": 3,
    "nn": 2,
    "ops": 1,
    "triton_kernels": 0,
    "cuda_ref": 0,
    "cpu_kernels": 0,
    "tree": -1,
    "openmp": -1,  # imported by the facade before torch: it imports nothing of astrai's
}


def _modules() -> dict[str, Path]:
    """Import name -> file, for every module the package installs."""
    mods = {}
    for prefix, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = [*prefix.split("."), *rel]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


ALIASES = {"triton_kernels": "astrai.triton_kernels", "cuda_ref": "astrai.cuda_ref",
           "cpu_kernels": "astrai.cpu_kernels", "configs": "astrai.configs"}  # fmt: skip


def _known(name: str) -> str | None:
    """The longest installed module that `name` (a dotted import name) is or lies in; None if not ours."""
    head, _, rest = name.partition(".")
    name = ALIASES.get(head, head) + (f".{rest}" if rest else "")
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The astrai modules an import statement uses: `from pkg import sub` counts as `pkg.sub` when `sub` is a
    module, and as `pkg` (its __init__) when it is a name defined there. `from astrai import anything` always counts
    as the package facade: it reads names off `astrai/__init__.py` (a submodule only by the import system's
    fallback), so a lower layer must write `import astrai.cuda_ref as cuda_ref` instead."""
    if isinstance(node, ast.ImportFrom) and not node.level and node.module == "astrai":
        return ["astrai"]
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        origin = node.module or ""
        if node.level:
            base = module.split(".")
            if MODULES[module].name != "__init__.py":
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        names = [f"{origin}.{a.name}" if _known(f"{origin}.{a.name}") == _known_full(origin, a.name) else origin
                 for a in node.names]  # fmt: skip
    return [t for t in map(_known, names) if t is not None]


def _known_full(origin: str, name: str) -> str | None:
    """`origin.name` if that is itself one of our modules (not just inside one), else None."""
    full = _known(f"{origin}.{name}")
    head, _, rest = origin.partition(".")
    canonical = ALIASES.get(head, head) + (f".{rest}" if rest else "") + f".{name}"
    return full if full == canonical else None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(t for t in _targets(module, node) if t != module)
        graph[module] = edges
    return graph


# layers that only one layer above may call (DESIGN §3.4: `astrai/ops/` is the only caller of the kernels)
ONLY_FROM = {"triton_kernels": {"ops"}, "cuda_ref": {"ops"}, "cpu_kernels": {"ops"}}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, edges in graph.items():
        for target in edges:
            a, b = _layer(module), _layer(target)
            if a != b and (RANK[b] >= RANK[a] or a not in ONLY_FROM.get(b, {a})):
                bad.append(f"{module} ({a}) imports {target} ({b})")
    return sorted(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_every_import_points_down():
    graph = _graph()
    assert set(map(_layer, MODULES)) <= set(RANK), "a new package needs a place in RANK (and docs/architecture.md)"
    assert _upward(graph) == []


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_checks_can_fail():
    # negative controls: an upward import and a two-module cycle are found
    graph = {"astrai.nn.mlp": {"astrai.io.model"}, "astrai.io.model": {"astrai.nn.mlp"}}
    assert _upward(graph) == ["astrai.nn.mlp (nn) imports astrai.io.model (io)"]
    assert _cycles(graph) == [["astrai.io.model", "astrai.nn.mlp"]]
    assert _upward({"astrai.nn.mla": {"astrai.triton_kernels.mla_decode"}}) != []  # kernels only from ops
    lazy = ast.parse("def f():\n    from triton_kernels.rotary import rotary_ref\n").body[0].body[0]
    assert _targets("astrai.nn.rope", lazy) == ["astrai.triton_kernels.rotary"]
    facade = ast.parse("def f():\n    from astrai import cuda_ref\n").body[0].body[0]
    assert _targets("astrai.ops.rotary", facade) == ["astrai"]  # through the facade, not the submodule
    assert _upward({"astrai.ops.rotary": {"astrai"}}) == ["astrai.ops.rotary (ops) imports astrai (astrai)"]
    submodule = ast.parse("import astrai.cuda_ref as cuda_ref\n").body[0]
    assert _targets("astrai.ops.rotary", submodule) == ["astrai.cuda_ref"]


def test_nothing_imports_the_folder_names():
    # from the repo root the folders are importable by their bare names too; a module imported under both names
    # would register its torch custom ops twice, and an installed astrai has only the astrai.* names
    bare = {"triton_kernels", "cuda_ref", "cpu_kernels", "configs", "quickstart"}
    found = []
    for folder in (*bare, "astrai", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in bare]
    assert found == []


_NO_INSTALL = """
import sys
# forget the editable install's import hook: import astrai the way `PYTHONPATH=.` in a fresh checkout does
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (type(f).__name__ + str(f)).lower()]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in str(h).lower()]
sys.path_importer_cache.clear()
sys.path.insert(0, sys.argv[1])
import astrai.triton_kernels.rotary, astrai.configs.models, astrai.quickstart.task
from astrai import cuda_ref
print(astrai.triton_kernels.rotary.__file__)
"""


def test_a_source_checkout_imports_without_installing():
    # the GPU check scripts run from the working tree with PYTHONPATH=. and no install
    proc = subprocess.run([sys.executable, "-c", _NO_INSTALL, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(ROOT / "triton_kernels" / "rotary.py")


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_installed_names_live_under_astrai(pyproject):
    setup = pyproject["tool"]["setuptools"]
    packages = set(setup["packages"])
    assert all(p == "astrai" or p.startswith("astrai.") for p in packages), "no top-level name besides astrai"
    assert {k: v for k, v in setup["package-dir"].items()} == {k: v for k, v in FOLDERS.items() if k != "astrai"}
    folders = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    assert packages == folders, "pyproject's package list and the package folders differ"

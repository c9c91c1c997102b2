"""The package's import graph, read from its source with ``ast`` (every ``import`` of a
``tandem`` module, those inside functions and under ``TYPE_CHECKING`` included): for
tests/test_structure.py (no circle, no upward arrow) and scripts/changed_tests.py (which tests a
change can reach)."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
# Lower numbers sit lower; a module may import its own layer and the ones below.
LAYERS = {
    "tandem.version": 0,  # imports nothing of the package
    "tandem.kernels": 1,
    "tandem.models": 2,
    "tandem.engine": 3,
    "tandem.server": 4,
    "tandem.bench": 5,
    "tandem.training": 5,
    "tandem.cli": 5,
    "tandem": 5,  # the package root (the offline API's names, loaded lazily)
}


def package_modules() -> dict[str, Path]:
    """Every module of the distribution by import name (pyproject's packages and package-dir)."""
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        p: REPO / setup["package-dir"].get(p, p.removeprefix("tandem.").replace(".", "/"))
        for p in setup["packages"]
    }
    folders["tandem"] = REPO
    out = {}
    for package, folder in folders.items():
        for f in folder.glob("*.py"):
            out[package if f.stem == "__init__" else f"{package}.{f.stem}"] = f
    return out


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports (``from a import b``: the module a.b when it is
    one, else a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            found.add(node.module)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
    return found


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def package_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (itself left out)."""
    modules = package_modules()
    return {m: imports(f, modules) - {m} for m, f in modules.items()}


def closure(graph: dict[str, set[str]], roots: set[str]) -> set[str]:
    """``roots`` and every module they reach."""
    seen, todo = set(), list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out

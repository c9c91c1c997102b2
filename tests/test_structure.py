"""The package's import graph (every ``import`` of a ``tandem`` module in its source, those in
functions and under ``TYPE_CHECKING`` included): no module reaches itself round a circle, and
imports only run down the layers: server -> engine -> models -> kernels, with the applications
(the ``tandem`` command, the bench, the head trainer) above the engine and beside the server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
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


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {m: imports(f, modules) - {m} for m, f in modules.items()}


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


def test_every_module_has_a_layer(graph: dict[str, set[str]]) -> None:
    assert len(graph) > 80
    assert all(any(m == p or m.startswith(p + ".") for p in LAYERS) for m in graph)


def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_imports_run_down_the_layers(graph: dict[str, set[str]]) -> None:
    upward = sorted(
        f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a)
    )
    assert upward == []


def test_the_checks_catch_a_circle_and_an_upward_import() -> None:
    """They can fail: a module of the engine importing the server, and a circle of three."""
    g = {"tandem.engine.a": {"tandem.server.app"}, "tandem.server.app": set()}
    assert [b for a, t in g.items() for b in t if layer(b) > layer(a)] == ["tandem.server.app"]
    ring = {"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}
    assert cycles(ring) == [["x", "y", "z"]]

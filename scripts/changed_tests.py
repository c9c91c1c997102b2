"""The test files a change can reach, for ``make test-fast`` (CI runs every test).

A change is what differs from ``--base`` (default: the upstream branch if there is one, else
HEAD): committed since, staged, unstaged, and files git does not track yet. A test file is
picked when it changed itself, when a helper module of tests/ it imports changed, or when a
package module it imports (transitively, through the package's own imports) changed. A test
that starts ``tandem serve`` (through tests/server_utils.py) depends on the whole command.
Non-Python files map to the module that reads them; a change to pyproject.toml,
requirements.lock, the Makefile or tests/conftest.py picks everything.

    python scripts/changed_tests.py [--base REV]   # prints test files, one a line
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
sys.path.insert(0, str(TESTS))

from import_graph import closure, package_graph, package_modules  # noqa: E402

EVERYTHING = {"pyproject.toml", "requirements.lock", "Makefile", "tests/conftest.py"}
# Files a module reads, by folder or name: a change to one is a change to that module.
DATA = {
    "configs/": "tandem.engine.presets",
    "kernels/cpu_decode.cpp": "tandem.kernels.cpu_decode",
    "models/heads/": "tandem.models.heads",
    "training/data/": "tandem.training.data",
    "Dockerfile": "test_docker.py test_install.py",
    "docker/": "test_docker.py test_install.py",
    "README.md": "test_docker.py test_install.py",
}
# Helpers of tests/ that start the command in a subprocess: they depend on all of it.
COMMAND_HELPERS = {"server_utils"}


def git(*args: str) -> list[str]:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line]


def changed_files(base: str | None) -> set[str]:
    if base is None:
        upstream = git("rev-parse", "--abbrev-ref", "--symbolic-full-name", "@{upstream}")
        base = upstream[0] if upstream else "HEAD"
    merge_base = git("merge-base", base, "HEAD") or [base]
    return {
        *git("diff", "--name-only", merge_base[0]),
        *git("ls-files", "--others", "--exclude-standard"),
    }


def test_dependencies(graph: dict[str, set[str]]) -> dict[str, tuple[set[str], set[str]]]:
    """Test file -> (the package modules it reaches, the tests/ helpers it imports)."""
    helpers = {p.stem for p in TESTS.glob("*.py") if not p.stem.startswith("test_")}
    out = {}
    for path in sorted(TESTS.glob("test_*.py")):
        roots: set[str] = set()
        used: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            roots |= {n for n in names if n in graph}
            used |= {n for n in names if n in helpers}
        todo = sorted(used)
        while todo:  # what the helpers import counts too, other helpers included
            text = (TESTS / f"{todo.pop()}.py").read_text()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and node.module in graph:
                    roots.add(node.module)
                if isinstance(node, ast.ImportFrom) and node.module in helpers - used:
                    used.add(node.module)
                    todo.append(node.module)
        if used & COMMAND_HELPERS:
            roots.add("tandem.cli")
        out[path.name] = (closure(graph, roots), used)
    return out


def pick(changed: set[str]) -> list[str]:
    graph = package_graph()
    files = {str(f.relative_to(REPO)): m for m, f in package_modules().items()}
    deps = test_dependencies(graph)
    if changed & EVERYTHING:
        return sorted(deps)
    modules, tests, helpers = set(), set(), set()
    for name in changed:
        if name in files:
            modules.add(files[name])
        elif name.startswith("tests/") and name.endswith(".py"):
            stem = Path(name).stem
            (tests if stem.startswith("test_") else helpers).add(
                Path(name).name if stem.startswith("test_") else stem
            )
        for prefix, target in DATA.items():
            if name.startswith(prefix):
                for t in target.split():
                    (tests if t.startswith("test_") else modules).add(t)
    return sorted(
        t for t, (reach, used) in deps.items() if t in tests or reach & modules or used & helpers
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=None, help="the revision to compare with")
    ns = p.parse_args()
    for name in pick(changed_files(ns.base)):
        print(f"tests/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

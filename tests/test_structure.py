"""The package's import graph (every ``import`` of a ``tandem`` module in its source, those in
functions and under ``TYPE_CHECKING`` included): no module reaches itself round a circle, and
imports only run down the layers: server -> engine -> models -> kernels, with the applications
(the ``tandem`` command, the bench, the head trainer) above the engine and beside the server."""

from __future__ import annotations

import pytest

from import_graph import LAYERS, cycles, layer, package_graph


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return package_graph()


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

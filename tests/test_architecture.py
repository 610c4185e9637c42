"""The package's shape, held against its code: layers that only point down, and no import circles.

Every import is read from the source (ast), wherever it stands: module level, inside a
function (lazy imports are still dependencies), under TYPE_CHECKING. A package may import
its own modules and the packages of the layers below its own, never one beside or above it;
and no chain of imports between files may lead back to where it started. docs/architecture.md
draws the same layers.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "driftlab"

# Top to bottom. `__init__` is the package's face (driftlab/__init__.py), `__main__` runs the CLI.
LAYERS: list[set[str]] = [
    {"__main__", "__init__"},
    {"cli"},
    {"api"},
    {"report", "serve"},
    {"pasta"},
    {"protocol"},
    {"integrations"},
    {"chat"},
    {"steering"},
    {"activation", "attention", "theory"},
    {"bench"},
    {"assets", "cuda_support", "messages", "records", "stats"},
    {"plugins"},
    {"console", "environment", "errors"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _unit(module: str) -> str:
    """The package (or top-level module) a driftlab module belongs to: driftlab.chat.hf -> chat."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _imports(module: str) -> set[str]:
    """The driftlab modules `module` imports, resolved to files (a name from a package's face is
    the face, unless the name is itself a submodule)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "driftlab")
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import"
            if not node.module or node.module.split(".")[0] != "driftlab":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in MODULES else node.module)
    unknown = out - MODULES.keys()
    assert not unknown, f"{module} imports modules that do not exist: {unknown}"
    return out - {module}


@functools.cache
def _graph() -> dict[str, set[str]]:
    """driftlab's import graph, parsed when a test asks (not at collection, which every xdist worker pays)."""
    return {m: _imports(m) for m in MODULES}


def test_every_package_has_a_layer() -> None:
    units = {_unit(m) for m in MODULES}
    assert units <= RANK.keys(), f"place these in LAYERS (and in docs/architecture.md): {units - RANK.keys()}"


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports from one package to another of the same or a higher layer."""
    return [f"{m} -> {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
            if _unit(t) != _unit(m) and RANK[_unit(t)] <= RANK[_unit(m)]]


def test_imports_only_point_down() -> None:
    upward = _upward(_graph())
    assert not upward, "imports that run up or sideways between packages:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    circles = _cycles(_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize("graph, expect", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_circle_finder_finds_circles(graph, expect) -> None:
    assert _cycles(graph) == expect


def test_an_upward_or_sideways_import_would_be_seen() -> None:
    """The checks are not vacuous: imports are read, and a wrong one is named."""
    graph = _graph()
    assert "driftlab.protocol.runner" in graph["driftlab.protocol.selfchat"]
    assert "driftlab.chat.hf" in graph["driftlab.chat"]  # a lazy import inside a function counts
    bad = {**graph, "driftlab.records.rundir": graph["driftlab.records.rundir"] | {"driftlab.protocol.runner"},
           "driftlab.stats": graph["driftlab.stats"] | {"driftlab.bench"}}
    assert _upward(bad) == ["driftlab.records.rundir -> driftlab.protocol.runner", "driftlab.stats -> driftlab.bench"]

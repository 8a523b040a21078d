"""No import cycle among the modules of `gptcalc/`, `reference_model/` and `reports/`.

The graph is read from the source with `ast`, so a lazy import (inside a function) counts as
much as one at module level: a cycle it closes still makes the modules' order of loading
depend on who is imported first. An edge runs from the importing module to:

- `import a.b.c`: `a.b.c`;
- `from a.b import c`: `a.b.c` where that is a module, else `a.b` (a name defined there);
- relative imports resolved against the importer's package first;
- the packages above the target (`import a.b.c` runs `a/__init__` and `a/b/__init__`),
  except those that contain the importer.

How a package's `__init__` counts: it is the module named by the package (`gptcalc.memory`).
A package importing its own submodules is an edge from the package to each of them, and not a
cycle by itself: a submodule runs only once its package has started loading, so the package
above a submodule is not an edge from it (the last rule above). A submodule that imports its
package by name (`from . import name` where `name` is not a submodule, `from gptcalc.memory
import x` inside `gptcalc/memory/`) is an edge to the package's `__init__`; if that `__init__`
imports the submodule back, directly or through others, it is a cycle and this test fails.

Modules outside the three packages (torch, the standard library) are not nodes.
`python -m tests.test_import_cycles` prints the cycles found.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ._imports import import_targets, modules as all_modules

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gptcalc", "reference_model", "reports")


def modules() -> dict[str, Path]:
    """Every module of the three packages by dotted name (a package by its own name)."""
    return all_modules(*PACKAGES)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def edges() -> dict[str, dict[str, int]]:
    """importer -> {imported module: first line importing it}, project modules only."""
    mods = modules()
    out: dict[str, dict[str, int]] = {m: {} for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in import_targets(node, package, mods):
                above = [a for a in _ancestors(target)
                         if not (name == a or name.startswith(a + "."))]
                for t in (target, *above):
                    if t in mods and t != name:
                        out[name].setdefault(t, node.lineno)
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (first node repeated at the end) per strongly connected component of more
    than one module (Tarjan's algorithm); empty exactly when `graph` has no cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            component.append(v)
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for u in frontier:
            for w in sorted(graph[u]):
                if w not in component:
                    continue
                if w == start:
                    path = [u]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = u
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + (
        f" -> {cycle[-1]}")


def test_no_import_cycle():
    graph = edges()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(c, graph) for c in found)


def test_the_finder_sees_a_cycle():
    """The finder itself: a two-module loop and a package loop are found, a package importing
    its submodules is not one."""
    assert cycles({"a": {"b": 1}, "b": {"a": 2}}) == [["a", "b", "a"]]
    assert cycles({"p": {"p.x": 1}, "p.x": {}}) == []
    loop = {"p": {"p.x": 1}, "p.x": {"p.y": 3}, "p.y": {"p": 5}}
    assert cycles(loop) == [["p", "p.x", "p.y", "p"]]


def test_lazy_and_relative_imports_are_edges():
    graph = edges()
    # a lazy import (inside a function) of a module, relative: `from .finetune import ...`
    assert "gptcalc.memory.finetune" in graph["gptcalc.memory.activations"]
    # `from . import memory` inside gptcalc/__init__ is the submodule, not the package itself
    assert "gptcalc.memory" in graph["gptcalc"]
    # `from .engines import ...` in memory/peak.py: the engines package, not memory's
    # __init__ (which imports peak): no loop through the package
    assert "gptcalc.memory.engines" in graph["gptcalc.memory.peak"]
    assert "gptcalc.memory" not in graph["gptcalc.memory.peak"]
    # an absolute import of a submodule also loads the packages above it
    assert "gptcalc" in graph["reference_model.distributed"]


if __name__ == "__main__":
    g = edges()
    found = cycles(g)
    for c in found:
        print(describe(c, g))
    print(f"{len(g)} modules of {', '.join(PACKAGES)}, {sum(map(len, g.values()))} imports "
          f"(lazy ones included), {len(found)} import cycles")

"""gptcalc's import structure against docs/architecture.md: no import cycle, every import on
its own floor or below, heavy packages only where the document allows them.

The import graph is read from the source (an AST walk; imports inside functions count), so a
lazy import cannot hide a cycle. `python -m tests.test_architecture` prints the summary.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from ._imports import import_targets, modules as all_modules

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gptcalc"
DOC = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Import:
    importer: str  # short module name: "memory.states", "gptcalc" for the package itself
    target: str  # a gptcalc module (short name), or the top-level name of another package
    line: int
    in_function: bool
    internal: bool  # target is a gptcalc module


def short(dotted: str) -> str:
    return "gptcalc" if dotted == "gptcalc" else dotted.removeprefix("gptcalc.")


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (packages by their own name)."""
    return all_modules("gptcalc")


def _function_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes that sit inside a function."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import,
                                                                         ast.ImportFrom)))
    return inside


def imports() -> list[Import]:
    """Every import statement of the package, resolved to the module it loads: `from X import
    Y` is X.Y where that is a module, else X; relative imports resolved against the package."""
    mods = modules()
    out = []
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        inside = _function_nodes(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = import_targets(node, pkg, mods)
            for t in targets:
                internal = t in mods
                if not internal and t.split(".")[0] == "gptcalc":
                    raise AssertionError(f"{name}:{node.lineno} imports {t}, not a module")
                if internal and t == name:
                    continue
                out.append(Import(short(name), short(t) if internal else t.split(".")[0],
                                  node.lineno, id(node) in inside, internal))
    return out


def graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {short(m): set() for m in modules()}
    for imp in imports():
        if imp.internal:
            g[imp.importer].add(imp.target)
    return g


def find_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first search meets (each as its path, first node repeated at the
    end); empty exactly when `g` has no cycle."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    found = []

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(g.get(u, ())):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for u in sorted(g):
        if u not in state:
            visit(u, [])
    return found


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table under `## heading` in docs/architecture.md, as cells."""
    text = DOC.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines()
            if line.startswith("|")]
    return [[c.strip() for c in r] for r in rows[2:]]  # header and rule dropped


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def matches(module: str, pattern: str) -> bool:
    """`pattern` is a module's short name, or `pkg.*`: the package and everything in it."""
    if pattern.endswith(".*"):
        stem = pattern[:-2]
        return module == stem or module.startswith(stem + ".")
    return module == pattern


def floors() -> dict[str, int]:
    """Each gptcalc module's floor as the Floors table places it (exact names before `pkg.*`)."""
    rules = [(pattern, int(row[0])) for row in _table("Floors") for pattern in _names(row[2])]
    out = {}
    for m in graph():
        hits = [(not p.endswith(".*"), len(p), f) for p, f in rules if matches(m, p)]
        if hits:
            out[m] = max(hits)[2]
    return out


def upward(g: dict[str, set[str]], floor: dict[str, int]) -> list[str]:
    """Imports of a module on a higher floor than the importer's (unplaced modules are
    `test_every_module_has_a_floor`'s to report)."""
    return [f"{u} (floor {floor[u]}) imports {v} (floor {floor[v]})"
            for u in sorted(g) for v in sorted(g[u])
            if u in floor and v in floor and floor[v] > floor[u]]


def heavy_violations() -> list[str]:
    out = []
    rules = [(_names(pkgs), _names(top), _names(fn)) for pkgs, top, fn in _table("Heavy packages")]
    for imp in imports():
        if imp.internal:
            continue
        for pkgs, top, fn in rules:
            if imp.target not in pkgs:
                continue
            allowed = top + fn if imp.in_function else top
            if not any(matches(imp.importer, p) for p in allowed):
                where = "inside a function" if imp.in_function else "at module level"
                out.append(f"{imp.importer}:{imp.line} imports {imp.target} {where}")
    return out


def test_no_import_cycle_in_gptcalc():
    cycles = find_cycles(graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_module_has_a_floor():
    unplaced = sorted(set(graph()) - set(floors()))
    assert not unplaced, f"modules missing from the Floors table of {DOC.name}: {unplaced}"


def test_no_module_imports_a_higher_floor():
    assert upward(graph(), floors()) == []


def test_heavy_packages_only_where_documented():
    assert heavy_violations() == []


def test_the_floors_table_names_only_real_modules():
    real = set(graph())
    named = [p for row in _table("Floors") for p in _names(row[2])]
    assert named, "no Floors table found"
    assert [p for p in named if not any(matches(m, p) for m in real)] == []


def test_the_checks_catch_what_they_forbid():
    # the walkers on a planted graph, so a checker that found nothing anywhere would fail here
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(g) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    assert upward({"low": {"high"}, "high": set()}, {"low": 0, "high": 1}) == [
        "low (floor 0) imports high (floor 1)"]
    # and on the real package: the walk sees the imports inside functions
    lazy = [i for i in imports() if i.importer == "training" and i.in_function and i.internal]
    assert "memory.profile_transformers" in {i.target for i in lazy}


if __name__ == "__main__":
    g, floor = graph(), floors()
    n_imports = sum(map(len, g.values()))
    cycles, up, heavy = find_cycles(g), upward(g, floor), heavy_violations()
    print(f"gptcalc: {len(g)} modules, {n_imports} internal imports, {len(cycles)} import "
          f"cycles, {len(up)} imports of a higher floor, {len(heavy)} undocumented heavy "
          "imports")
    for line in [" -> ".join(c) for c in cycles] + up + heavy:
        print(" ", line)

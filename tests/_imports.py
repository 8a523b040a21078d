"""Reading a package's imports from its source (an AST walk), shared by the architecture and
import-cycle tests."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(*packages: str) -> dict[str, Path]:
    """Every module of `packages` by dotted name (a package by its own name)."""
    out = {}
    for package in packages:
        for p in (ROOT / package).rglob("*.py"):
            rel = p.relative_to(ROOT).with_suffix("")
            out[".".join(rel.parts).removesuffix(".__init__")] = p
    return out


def import_targets(node: ast.AST, package: str, mods: dict[str, Path]) -> list[str]:
    """The modules an import statement names: `from X import Y` is X.Y where that is one of
    `mods`, else X; relative imports resolved against `package` (the importer's)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package
        for _ in range(node.level - 1):
            base = base.rsplit(".", 1)[0]
        module = base + "." + node.module if node.module else base
    else:
        module = node.module or ""
    return [module + "." + a.name if module + "." + a.name in mods else module
            for a in node.names]

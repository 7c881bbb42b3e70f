"""The package's import graph, read with ``ast``: no cycles, no private names across modules.

A cycle hidden inside a function body still ties two modules together (neither can be
understood, moved or tested alone), so function-level imports count as edges like
module-level ones; only ``if TYPE_CHECKING:`` imports, which never run, are left out.
``from P import n`` is an edge to ``P.n`` when that is a module, else to ``P``; the
implicit import of a parent package's ``__init__`` is not an edge (as in import-linter).

The tests assert no cycles between modules.  Run as a script, this file also prints the
cycles between the package's top-level parts (``megalite.tensor_parallel``,
``megalite.models``, ...): layering inversions such as tensor_parallel -> checkpointing ->
models -> tensor_parallel where no two modules import each other.  Those are reported, not
asserted: ``megalite.planner`` is both a pure-Python library (the FLOP and memory models
training reuses) and an application (``--validate-run`` runs a training iteration).

Run this file as a script to print the graph's cycles and private imports.
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import pytest

PACKAGE = "megalite"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    function_level: bool     # inside a def (runs at call time, not at import time)


@dataclass(frozen=True)
class PrivateUse:
    source: str
    target: str
    name: str
    line: int


def module_files(root: str = ROOT) -> Dict[str, str]:
    """Dotted module name -> file path for every ``.py`` under the package."""
    out = {}
    base = os.path.join(root, PACKAGE)
    for folder, _, files in os.walk(base):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(folder, f)
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _ImportVisitor(ast.NodeVisitor):
    """Collects this module's imports of package modules, and the names they bind."""

    def __init__(self, module: str, is_package: bool, modules: Set[str]):
        self.module, self.modules = module, modules
        self.package = module if is_package else module.rpartition(".")[0]
        self.depth = 0
        self.edges: List[Edge] = []
        self.private: List[PrivateUse] = []
        self.aliases: Dict[str, str] = {}    # local name -> package module it is bound to

    def _absolute(self, node: ast.ImportFrom) -> Optional[str]:
        if not node.level:
            return node.module
        parts = self.package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1])
        return f"{base}.{node.module}" if node.module else base

    def _edge(self, target: str, line: int) -> None:
        if target != self.module:
            self.edges.append(Edge(self.module, target, line, self.depth > 0))

    def visit_FunctionDef(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):   # never runs: not an import
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name in self.modules:
                self._edge(a.name, node.lineno)
                if a.asname:
                    self.aliases[a.asname] = a.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        source = self._absolute(node)
        if source is None or not (source == PACKAGE or source.startswith(PACKAGE + ".")):
            return
        for a in node.names:
            sub = f"{source}.{a.name}"
            if sub in self.modules:
                self._edge(sub, node.lineno)
                self.aliases[a.asname or a.name] = sub
            else:
                self._edge(source, node.lineno)
                if _is_private(a.name) and source != self.module:
                    self.private.append(PrivateUse(self.module, source, a.name, node.lineno))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases \
                and _is_private(node.attr):
            target = self.aliases[node.value.id]
            if target != self.module:
                self.private.append(PrivateUse(self.module, target, node.attr, node.lineno))
        self.generic_visit(node)


def scan(root: str = ROOT) -> Tuple[List[Edge], List[PrivateUse]]:
    files = module_files(root)
    edges, private = [], []
    for module, path in sorted(files.items()):
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
        v = _ImportVisitor(module, path.endswith("__init__.py"), set(files))
        v.visit(tree)
        edges += v.edges
        private += v.private
    return edges, private


def strongly_connected(edges: List[Edge]) -> List[List[str]]:
    """Tarjan's SCCs with more than one module: each is a set of mutually importing modules."""
    graph: Dict[str, Set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def part_of(module: str) -> str:
    """The top-level part of the package holding a module: ``megalite.x`` of ``megalite.x.y``."""
    return ".".join(module.split(".")[:2])


def part_edges(edges: List[Edge]) -> List[Edge]:
    """Edges between top-level parts, labelled by the parts (the line is the source's)."""
    return [Edge(part_of(e.source), part_of(e.target), e.line, e.function_level)
            for e in edges if part_of(e.source) != part_of(e.target)]


def describe(cycles: List[List[str]], edges: List[Edge], private: List[PrivateUse]) -> str:
    """Each cycle with the module edges that close it, then each private name used."""
    lines = []
    for comp in cycles:
        lines.append("cycle: " + " <-> ".join(comp))
        members = set(comp)
        for e in sorted(set(edges), key=lambda e: (e.source, e.line, e.target)):
            if part_of(e.source) in members and part_of(e.target) in members \
                    and part_of(e.source) != part_of(e.target) or \
                    e.source in members and e.target in members:
                kind = "function-level" if e.function_level else "module-level"
                lines.append(f"    {e.source}:{e.line} -> {e.target} ({kind})")
    for p in private:
        lines.append(f"private: {p.source}:{p.line} uses {p.target}.{p.name}")
    return "\n".join(lines)


def test_scanner_sees_both_import_levels():
    """The checker itself finds module- and function-level edges (so an empty result means
    something): ``megalite.cli.validation`` imports ``config`` at module level."""
    edges, _ = scan()
    assert any(e.source == "megalite.cli.validation" and e.target == "megalite.config"
               and not e.function_level for e in edges)
    assert any(e.function_level for e in edges)
    assert len({e.source for e in edges}) > 30


def test_checker_finds_hidden_cycles_and_private_names(tmp_path):
    """On a made-up package: a cycle closed inside a function, a private name imported and
    one reached through a module alias are found; TYPE_CHECKING imports and dunders are not."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from megalite.sub import b\nfrom megalite.c import _hidden, __version__\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..a import x\n    return x\n",
        "c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megalite import a\n"
                 "import megalite.d as dee\ny = dee._private\n"),
        "d.py": "_private = 1\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    edges, private = scan(str(tmp_path))
    assert strongly_connected(edges) == [["megalite.a", "megalite.sub.b"]]
    back = [e for e in edges if e.source == "megalite.sub.b"]
    assert [(e.target, e.function_level) for e in back] == [("megalite.a", True)]
    assert not any(e.source == "megalite.c" and e.target == "megalite.a" for e in edges)
    assert sorted((p.source, p.target, p.name) for p in private) == [
        ("megalite.a", "megalite.c", "_hidden"), ("megalite.c", "megalite.d", "_private")]
    assert strongly_connected(part_edges(edges)) == [["megalite.a", "megalite.sub"]]


def test_no_import_cycles_between_modules():
    edges, _ = scan()
    cycles = strongly_connected(edges)
    assert not cycles, "import cycles:\n" + describe(cycles, edges, [])


def test_no_private_names_cross_modules():
    _, private = scan()
    assert not private, describe([], [], private)


if __name__ == "__main__":
    all_edges, all_private = scan()
    print("between modules:")
    print(describe(strongly_connected(all_edges), all_edges, []) or "  none")
    print("between package parts:")
    print(describe(strongly_connected(part_edges(all_edges)), all_edges, []) or "  none")
    print("private names across modules:")
    print(describe([], [], all_private) or "  none")

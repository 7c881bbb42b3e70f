"""The package's import graph, read with ``ast``: no cycles, layers that point one way, few
function-level imports, no private names across modules.

A cycle hidden inside a function body still ties two modules together (neither can be
understood, moved or tested alone), so function-level imports count as edges like
module-level ones; only ``if TYPE_CHECKING:`` imports, which never run, are left out.
``from P import n`` is an edge to ``P.n`` when that is a module, else to ``P``; the
implicit import of a parent package's ``__init__`` is not an edge (as in import-linter).

``LAYERS`` (docs/architecture.md#layers says why each part sits where it does) orders the package's
parts, lowest first; a module may import its own layer's parts and those below, never one
above, and the parts do not import each other in a circle.  ``PENDING`` lists the edges
that still break that order, each in a file another branch rewrites, with its fix: the
test fails on a new one and on a fixed one still listed.

Run this file as a script to print the graph's cycles, the imports up a layer, the
function-level imports and the private imports.
"""
from __future__ import annotations

import ast
import os
import re
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


# ---- layers ------------------------------------------------------------------------------
# Lowest first.  A module belongs to the longest entry that is it or a package above it.
# Every top-level package sits in one layer; only the programs a user runs (the scripts
# ``__main__`` and the ``megalite`` command, which dispatches by name) are applications
# inside a lower package.
LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("foundations", ("megalite.errors", "megalite.param_spec", "megalite.testing",
                     "megalite.torch_classes")),
    ("configuration and torch-free registries", ("megalite.config",)),
    ("groups and collectives", ("megalite.parallel_state", "megalite.comm")),
    ("data, state format", ("megalite.data", "megalite.state_format")),
    ("tensor parallel", ("megalite.tensor_parallel",)),
    ("layers", ("megalite.transformer", "megalite.context_parallel", "megalite.moe",
                "megalite.backends")),
    ("pipeline and optimizer", ("megalite.pipeline_parallel", "megalite.optimizer")),
    ("data parallel", ("megalite.distributed",)),
    ("models", ("megalite.models",)),
    ("checkpointing", ("megalite.checkpointing",)),
    ("diagnostics", ("megalite.diagnostics",)),
    ("command-line side", ("megalite.cli",)),
    ("planner and viz", ("megalite.planner", "megalite.viz")),
    ("elastic", ("megalite.elastic",)),
    ("training", ("megalite.training",)),
    ("applications", ("megalite.commands", "megalite.generate", "megalite.cli.main",
                      "megalite.cli.__main__", "megalite.planner.__main__",
                      "megalite.__main__", "megalite")),
)

# Edges that still run up a layer or close a circle between parts, each in a file another
# branch rewrites: (importer, imported) -> the fix.  Delete an entry with its edge.
PENDING: Dict[Tuple[str, str], str] = {
}


def layer_of(module: str) -> Tuple[int, str]:
    """(layer index, the ``LAYERS`` entry holding ``module``: its part)."""
    best = None
    for i, (_, parts) in enumerate(LAYERS):
        for p in parts:
            if (module == p or module.startswith(p + ".")) and \
                    (best is None or len(p) > len(best[1])):
                best = (i, p)
    if best is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS")
    return best


def _re_export(e: Edge, packages: Set[str]) -> bool:
    """A package's ``__init__`` naming one of its own modules: the package's face, which a
    caller reaches through the package, not a dependency between parts."""
    return e.source in packages and e.target.startswith(e.source + ".")


def layer_edges(edges: List[Edge]) -> List[Edge]:
    """Edges between parts of ``LAYERS`` (labelled by the modules), re-exports left out."""
    packages = {m for m, path in module_files().items() if path.endswith("__init__.py")}
    return [e for e in edges if layer_of(e.source)[1] != layer_of(e.target)[1]
            and not _re_export(e, packages)]


def upward(edges: List[Edge]) -> List[Edge]:
    return [e for e in layer_edges(edges) if layer_of(e.source)[0] < layer_of(e.target)[0]]


def part_cycles(edges: List[Edge]) -> List[List[str]]:
    """Cycles between the parts of ``LAYERS``."""
    return strongly_connected([Edge(layer_of(e.source)[1], layer_of(e.target)[1], e.line,
                                    e.function_level) for e in edges])


# ---- function-level imports --------------------------------------------------------------
REASON = re.compile(r"#\s*(optional dependency|start-up time):\s*\S")
PER_1000_LINES = 3

# Modules another branch rewrites: their function-level imports are left to the lead's pass
# after the merge (hoist each, or write its reason); the count must match.
LEAD_PASS: Dict[str, int] = {}


@dataclass(frozen=True)
class InnerImport:
    module: str
    line: int
    reason: Optional[str]    # the "# optional dependency: ..." / "# start-up time: ..." text


def _reason(lines: List[str], node: ast.stmt) -> Optional[str]:
    """The reason comment on the import's own line(s) or the comment lines just above it."""
    for text in lines[node.lineno - 1:node.end_lineno]:
        m = REASON.search(text)
        if m:
            return text[m.start():].strip()
    i = node.lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        m = REASON.search(lines[i])
        if m:
            return lines[i].strip()
        i -= 1
    return None


class _InnerImportVisitor(ast.NodeVisitor):
    def __init__(self, module: str, lines: List[str]):
        self.module, self.lines, self.depth = module, lines, 0
        self.found: List[InnerImport] = []

    def visit_FunctionDef(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node) -> None:
        if self.depth:
            self.found.append(InnerImport(self.module, node.lineno, _reason(self.lines, node)))

    visit_ImportFrom = visit_Import


def function_level_imports(root: str = ROOT) -> Tuple[List[InnerImport], int]:
    """Every import inside a function (stdlib and third-party ones too), and the package's
    line count."""
    found, lines = [], 0
    for module, path in sorted(module_files(root).items()):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        lines += text.count("\n")
        v = _InnerImportVisitor(module, text.split("\n"))
        v.visit(ast.parse(text, filename=path))
        found += v.found
    return found, lines


def describe_inner(found: List[InnerImport]) -> str:
    return "\n".join(f"    {i.module}:{i.line}" + (f"  {i.reason}" if i.reason else "")
                     for i in found)

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


def is_script(module: str) -> bool:
    """A ``__main__`` module is a program the user runs (``python -m megalite.planner``);
    nothing imports it, so it ties no package to another."""
    return module.rpartition(".")[2] == "__main__"


def test_no_import_cycles_between_top_level_packages():
    """The package's folders (``megalite.config``, ``megalite.training``, ...; a root module
    counts as one) do not import each other in a circle, counting function-level imports:
    each folder sits in one layer (docs/architecture.md#layers)."""
    edges, _ = scan()
    kept = [e for e in edges if not is_script(e.source)]
    cycles = strongly_connected(part_edges(kept))
    assert not cycles, "cycles between top-level packages:\n" + describe(cycles, kept, [])


def test_layer_order_on_a_made_up_package(tmp_path, monkeypatch):
    """An import up a layer, a circle between two parts of one layer and a re-export are told
    apart; a module takes the layer of its longest entry."""
    pkg = tmp_path / PACKAGE
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    files = {
        "__init__.py": "", "low/__init__.py": "from megalite.low import b\n",
        "low/a.py": "def f():\n    from megalite.high import c\n",     # up a layer
        "low/b.py": "from megalite import side\n",
        "side.py": "from megalite.low import a\n",                    # circle: low <-> side
        "high/__init__.py": "", "high/c.py": "from megalite.low import b\n",
        "high/d.py": "",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    monkeypatch.setitem(globals(), "LAYERS", (
        ("low", ("megalite.low", "megalite.side", "megalite.high.d")),
        ("high", ("megalite.high", "megalite"))))
    edges, _ = scan(str(tmp_path))
    assert layer_of("megalite.high.d") == (0, "megalite.high.d")
    assert layer_of("megalite.high.c") == (1, "megalite.high")
    assert [(e.source, e.target) for e in upward(edges)] == [("megalite.low.a", "megalite.high.c")]
    assert part_cycles(layer_edges(edges)) == [
        ["megalite.high", "megalite.low", "megalite.side"]]
    assert not any(e.source == "megalite.low" for e in layer_edges(edges))   # a re-export


def test_every_module_has_a_layer():
    for module in module_files():
        layer_of(module)


def test_no_import_runs_up_a_layer():
    """Each import points down the layers or within one (the edges ``PENDING`` lists aside,
    which must still exist: a fixed one is deleted from the list)."""
    edges, _ = scan()
    found = {(e.source, e.target) for e in upward(edges)}
    new = sorted(found - set(PENDING))
    assert not new, "imports up a layer (docs/architecture.md#layers):\n" + "\n".join(
        f"    {s} -> {t}  ({LAYERS[layer_of(s)[0]][0]} -> {LAYERS[layer_of(t)[0]][0]})"
        for s, t in new)
    closed = {(e.source, e.target) for e in layer_edges(edges)}
    stale = sorted(set(PENDING) - closed)
    assert not stale, f"PENDING lists edges that are gone; delete them: {stale}"


def test_no_cycle_between_parts():
    """No two parts of ``LAYERS`` import each other, directly or round a circle, counting
    function-level imports (``PENDING``'s edges aside)."""
    edges, _ = scan()
    kept = [e for e in layer_edges(edges) if (e.source, e.target) not in PENDING]
    cycles = part_cycles(kept)
    assert not cycles, "cycles between parts:\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_function_level_imports_are_few_and_explained():
    """At most ``PER_1000_LINES`` imports inside functions per 1,000 lines, each with its
    reason beside it (``# optional dependency: ...`` or ``# start-up time: ...``); the rest
    belong at the top of the module, where the layering shows."""
    found, lines = function_level_imports()
    per_module: Dict[str, int] = {}
    for i in found:
        per_module[i.module] = per_module.get(i.module, 0) + 1
    stale = {m: (n, per_module.get(m, 0)) for m, n in LEAD_PASS.items()
             if per_module.get(m, 0) != n}
    assert not stale, f"LEAD_PASS out of date (module: (listed, found)): {stale}"
    rest = [i for i in found if i.module not in LEAD_PASS]
    unexplained = [i for i in rest if not i.reason]
    assert not unexplained, "function-level imports without a reason:\n" + \
        describe_inner(unexplained)
    budget = PER_1000_LINES * lines / 1000
    assert len(rest) <= budget, f"{len(rest)} function-level imports, budget {budget:.0f}:\n" \
        + describe_inner(rest)


def test_reason_comments_are_recognised():
    lines = ["def f():", "    # optional dependency: matplotlib", "    import matplotlib",
             "    import os", "    import yaml  # start-up time: 40 ms"]
    tree = ast.parse("\n".join(lines))
    v = _InnerImportVisitor("m", lines)
    v.visit(tree)
    assert [(i.line, i.reason) for i in v.found] == [
        (3, "# optional dependency: matplotlib"), (4, None), (5, "# start-up time: 40 ms")]


if __name__ == "__main__":
    all_edges, all_private = scan()
    print("between modules:")
    print(describe(strongly_connected(all_edges), all_edges, []) or "  none")
    print("between top-level packages (scripts aside):")
    kept_edges = [e for e in all_edges if not is_script(e.source)]
    print(describe(strongly_connected(part_edges(kept_edges)), kept_edges, []) or "  none")
    print("between parts of LAYERS (PENDING's edges included):")
    print("\n".join("  " + " <-> ".join(c) for c in part_cycles(layer_edges(all_edges)))
          or "  none")
    print("imports up a layer:")
    print("\n".join(f"  {e.source}:{e.line} -> {e.target}"
                    + ("  (pending)" if (e.source, e.target) in PENDING else "")
                    for e in upward(all_edges)) or "  none")
    inner, n_lines = function_level_imports()
    print(f"function-level imports: {len(inner)} in {n_lines} lines "
          f"({1000 * len(inner) / n_lines:.2f} per 1,000)")
    print(describe_inner(inner))
    print("private names across modules:")
    print(describe([], [], all_private) or "  none")

"""The modules under ``helpers/`` import one another without a cycle, the cost model (``helpers/cost/``)
imports nothing from ``parallel/`` or ``training/``, and only ``make``'s tools import ``helpers.tools`` (issue
37, items 3 and 6).

A cycle means two modules can only be understood together, and the first of them imported sees the other half
built; a function-level or ``TYPE_CHECKING`` import only hides it, so every import statement counts, wherever
it sits. Pure Python: the graph is read from the sources with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import glob
import os
import re

import jupytext

from helpers import ROOT

# Cycles that are known and not yet broken, each as its modules in sorted order, with the issue that tracks it
KNOWN_CYCLES: set[tuple[str, ...]] = set()

# The cost model sits below what runs on ranks: these may import it, it imports none of them
COST = "helpers.cost"
ABOVE_COST = ("helpers.parallel", "helpers.training")

# What may import helpers.tools from outside it, and why ("what only make runs")
TOOLS_USERS = {
    # chapter 00 shows how a chapter becomes a torchrun script: it calls make torchrun's exporter
    ("notebooks/00_how_this_book_runs.md", "helpers.tools.px_script"),
}


def modules() -> dict[str, str]:
    """Every module under helpers/, packages by their own name: dotted name -> path."""
    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "helpers", "**", "*.py"), recursive=True)):
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        found[name.removesuffix(".__init__")] = path
    return found


def imported(tree: ast.AST, here: str, known: set[str]) -> set[str]:
    """The helpers modules ``tree`` imports anywhere in it (``from package import module`` names the module,
    ``from module import name`` the module); ``here`` resolves relative imports."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")[:-node.level]
                base = ".".join(parts + ([base] if base else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in out if m in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {}
    for name, path in known.items():
        with open(path) as f:
            here = name + ".__init__" if path.endswith("__init__.py") else name
            edges[name] = imported(ast.parse(f.read()), here, set(known)) - {name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                found.append(tuple(sorted(component)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_cycles_finds_a_cycle_and_only_one():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(edges) == [("a", "b", "c")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_helpers_modules():
    found = set(cycles(graph()))
    assert not found - KNOWN_CYCLES, f"import cycles among helpers' modules: {sorted(found - KNOWN_CYCLES)}"


def test_every_known_cycle_is_still_there():
    gone = KNOWN_CYCLES - set(cycles(graph()))
    assert not gone, f"tests/test_imports.py lists cycles that are gone (remove them from KNOWN_CYCLES): " \
                     f"{gone}"


def test_the_cost_model_imports_nothing_above_it():
    edges = graph()
    assert any(name.startswith(COST + ".") for name in edges), f"no module under {COST}"
    upward = sorted((name, m) for name, imports in edges.items()
                    if name == COST or name.startswith(COST + ".")
                    for m in imports if any(m == top or m.startswith(top + ".") for top in ABOVE_COST))
    assert not upward, f"the cost model ({COST}) imports from {ABOVE_COST}: {upward}"


def test_only_make_tools_import_helpers_tools():
    known = set(modules())
    users = set()
    for name, path in modules().items():
        if not name.startswith("helpers.tools"):
            with open(path) as f:
                tree = ast.parse(f.read())
            started = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                       and node.value in known}  # a module run by name: python -m helpers.tools.x
            users.update((os.path.relpath(path, ROOT), m) for m in imported(tree, name, known) | started
                         if m.startswith("helpers.tools"))
    magic = re.compile(r"\s*(%{1,2}[A-Za-z]|!)")
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.md"))):
        for cell in jupytext.read(path).cells:
            if cell.cell_type == "code":
                source = "\n".join("" if magic.match(line) else line for line in cell.source.splitlines())
                users.update((os.path.relpath(path, ROOT), m) for m in imported(ast.parse(source), "", known)
                             if m.startswith("helpers.tools"))
    assert not users - TOOLS_USERS, \
        f"helpers/tools/ is what only make runs; these import it from outside: {sorted(users - TOOLS_USERS)}"
    assert not TOOLS_USERS - users, f"tests/test_imports.py lists users that are gone: {TOOLS_USERS - users}"

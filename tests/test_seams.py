"""The package's modules talk through declared seams, read from the sources: no import
circle among them counting every import (those under ``TYPE_CHECKING`` and inside
functions too), no module importing another's private name, no scheduler book importing
the coordinator's state, no class over 400 lines, no folder over 12 modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "daskdist"
# the rooms held to these rules: the whole package
ROOMS = ("daskdist",)
MAX_CLASS_LINES = 400
MAX_MODULES = 12  # per folder, its subpackages apart


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}


def _in_rooms(module: str) -> bool:
    return any(module == r or module.startswith(r + ".") for r in ROOMS)


def _imports(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from daskdist... import name`` anywhere in ``path``
    (``name`` "": a plain ``import``), relative imports resolved."""
    me = _module(path)
    package = me if path.stem == "__init__" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(base, a.name) for a in node.names]
    return [(m, n) for m, n in out if m == "daskdist" or m.startswith("daskdist.")]


def _graph() -> dict[str, set[str]]:
    """Every module's daskdist imports (a name that is a module counts as that module)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        deps = set()
        for base, name in _imports(path):
            full = f"{base}.{name}" if name else base
            while full and full not in MODULES:
                full = full.rpartition(".")[0]
            if full and full != module:
                deps.add(full)
        graph[module] = deps
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_no_import_circle_counting_every_import():
    circles = [c for c in strongly_connected(_graph()) if any(map(_in_rooms, c))]
    assert not circles, circles


def test_the_scc_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_name():
    bad = [f"{module} imports {base}.{name}" for module, path in MODULES.items()
           for base, name in _imports(path)
           if name.startswith("_") and not name.startswith("__")
           and (_in_rooms(module) or _in_rooms(base))]
    assert not bad, bad


def test_only_the_plugin_and_its_names_know_the_coordinator_state():
    """Each book asks its coordinator through a Protocol of its own, never through
    ``CoordinatorState`` itself; the plugin and the coordinators' lives make them."""
    state = "daskdist.plugins.scheduler.state"
    graph = _graph()
    importers = sorted(m for m, deps in graph.items() if state in deps)
    assert importers == ["daskdist.plugins.scheduler.names",
                         "daskdist.plugins.scheduler.plugin"], importers


@pytest.mark.parametrize("room", ROOMS)
def test_no_class_over_400_lines(room):
    big = []
    for module, path in MODULES.items():
        if not (module == room or module.startswith(room + ".")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - start + 1
                if lines > MAX_CLASS_LINES:
                    big.append(f"{module}.{node.name}: {lines} lines")
    assert not big, big


@pytest.mark.parametrize("room", ROOMS)
def test_no_folder_over_12_modules(room):
    folder = ROOT / room.replace(".", "/")
    for d in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        modules = sorted(p.name for p in d.glob("*.py"))
        assert len(modules) <= MAX_MODULES, (str(d.relative_to(ROOT)), modules)

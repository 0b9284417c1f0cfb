"""Imports that say the truth (SPEC §1): what each side loads, checked in a fresh
interpreter (``sys.modules`` after the import, not the file's own import lines), the
package's import graph free of circles, and the rooms importing only what they may."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "daskdist"
HEAVY = ("distributed", "tornado", "torch")

# the pure state machines: every module under core/, and the per-rank rules of observe/
PURE = sorted(
    [".".join(p.relative_to(ROOT).with_suffix("").parts)
     for p in (PACKAGE / "core").rglob("*.py") if p.stem != "__init__"]
    + ["daskdist.observe.steptimes", "daskdist.observe.stragglers", "daskdist.observe.hangs"])
# what a gang member measures on its worker: the scheduler side never loads it
WORKER_OBSERVE = ("daskdist.observe.phases", "daskdist.observe.stacks",
                  "daskdist.observe.recorder")


def loaded_after(statement: str) -> set[str]:
    """The modules in ``sys.modules`` after ``statement`` runs in a fresh interpreter."""
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_state_machines_are_among_the_pure_modules():
    assert {"daskdist.core.queue", "daskdist.core.leases.table", "daskdist.core.leases.commits",
            "daskdist.core.gang", "daskdist.core.membership", "daskdist.core.backends",
            "daskdist.core.protocol", "daskdist.core.intervals",
            "daskdist.core.inference"} <= set(PURE)


@pytest.mark.parametrize("module", PURE)
def test_pure_module_loads_no_dask_tornado_or_torch(module):
    loaded = loaded_after(f"import {module}")
    assert module in loaded
    assert not [m for m in loaded if m.split(".")[0] in HEAVY], module


def test_import_daskdist_is_cheap():
    loaded = loaded_after("import daskdist")
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY + ("pyarrow", "numpy"))
    assert not heavy
    assert "daskdist.client.coordinator" not in loaded  # imported when first named


def test_the_scheduler_side_never_imports_torch_or_the_other_sides():
    loaded = loaded_after("import daskdist.plugins.scheduler")
    assert "daskdist.plugins.scheduler.plugin" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "pyarrow")]
    others = ("daskdist.client", "daskdist.plugins.worker", "daskdist.data",
              "daskdist.collective", "daskdist.inference")
    assert not [m for m in loaded if m.startswith(others)], sorted(loaded)


def test_the_client_never_imports_the_scheduler_side_or_torch():
    loaded = loaded_after("import daskdist as dd; dd.Coordinator")
    assert "daskdist.client.coordinator" in loaded
    assert not [m for m in loaded if m.startswith("daskdist.plugins.scheduler")]
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "pyarrow")]


def test_the_worker_plugin_loads_no_torch_until_a_device_is_bound():
    loaded = loaded_after("import daskdist.plugins.worker.plugin")
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "pyarrow")]
    assert not [m for m in loaded if m.startswith(("daskdist.plugins.scheduler",
                                                   "daskdist.client"))]


def test_the_asynchronous_package_and_its_worker_routes_load_no_torch():
    loaded = loaded_after("import daskdist as dd; dd.asynchronous.Nesterov; "
                          "import daskdist.asynchronous.routes, daskdist.client.asynchronous")
    assert "daskdist.asynchronous.outer" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "pyarrow")]


def test_the_step_clock_loads_no_dask_tornado_or_torch():
    loaded = loaded_after("import daskdist.observe.phases, daskdist.observe.stacks")
    assert "daskdist.observe.phases" in loaded
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]


# -- the import graph, read from the sources ------------------------------------------------
def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """The daskdist modules ``path`` imports (module level only, or anywhere)."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.If) and top_level_only:  # TYPE_CHECKING blocks: no import
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if (ROOT / (full.replace(".", "/") + ".py")).exists()
                        or (ROOT / full.replace(".", "/")).is_dir() else base)
    return {m for m in out if m == "daskdist" or m.startswith("daskdist.")}


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {d for d in _imports(p, top_level_only) if d in modules and d != m}
            for m, p in modules.items()}


def test_no_import_circle_in_the_package():
    graph = _graph(top_level_only=True)
    # a package __init__ that re-exports a submodule is its parent, not a circle
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(path + [m, d]))
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


RULES = {  # room -> rooms it must not import (anywhere in the file, lazily too)
    "daskdist.core": ("daskdist.client", "daskdist.plugins", "daskdist.data",
                      "daskdist.collective", "daskdist.cli", "daskdist.config",
                      "daskdist.session", "daskdist.observe"),
    # what a closure runs with: read by the data and collective layers, below them all
    "daskdist.session": ("daskdist.client", "daskdist.plugins", "daskdist.data",
                         "daskdist.collective", "daskdist.cli", "daskdist.observe"),
    "daskdist.plugins.scheduler": ("daskdist.client", "daskdist.plugins.worker",
                                   "daskdist.data", "daskdist.collective", "daskdist.cli",
                                   "daskdist.asynchronous", "daskdist.inference",
                                   *WORKER_OBSERVE),
    "daskdist.plugins.worker": ("daskdist.client", "daskdist.plugins.scheduler",
                                "daskdist.cli"),
    "daskdist.client": ("daskdist.plugins.scheduler", "daskdist.plugins.worker",
                        "daskdist.collective", "daskdist.cli"),
    "daskdist.data": ("daskdist.collective", "daskdist.plugins", "daskdist.client",
                      "daskdist.cli", "daskdist.inference"),
    "daskdist.collective": ("daskdist.data", "daskdist.plugins", "daskdist.client",
                            "daskdist.cli", "daskdist.inference"),
    # one model trained asynchronously: its workers' side (replicas, holder, standby),
    # below the plugins that route to it and the client that makes it
    "daskdist.asynchronous": ("daskdist.client", "daskdist.plugins", "daskdist.data",
                              "daskdist.cli", "daskdist.inference"),
    # batch inference's worker side and output: above the data layer, beside the
    # collective one, never the client's, the plugins' or the scheduler's
    "daskdist.inference": ("daskdist.collective", "daskdist.plugins", "daskdist.client",
                           "daskdist.cli", "daskdist.asynchronous"),
    # the step clock the data and collective layers call: theirs, and nobody's above
    "daskdist.observe": ("daskdist.data", "daskdist.collective", "daskdist.plugins",
                         "daskdist.client", "daskdist.cli"),
}


# the one crossing: dd.collective.CollectiveGroup is the client's description of a group
ALLOWED = {("daskdist.collective", "daskdist.client.group")}


def test_each_room_imports_only_what_it_may():
    graph = _graph(top_level_only=False)
    bad = []
    for m, deps in graph.items():
        for room, banned in RULES.items():
            if m == room or m.startswith(room + "."):
                bad += [f"{m} imports {d}" for d in deps
                        if any(d == b or d.startswith(b + ".") for b in banned)
                        and (m, d) not in ALLOWED]
    assert not bad, bad

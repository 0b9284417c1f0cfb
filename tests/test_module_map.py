"""docs/architecture.md's module map names every module of the package, read from the
tree (``daskdist/**/*.py``, the ``__init__.py`` of every folder included), and names no
module that does not exist; each entry says what the module holds."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def module_map() -> dict[str, str]:
    """``{path: what it holds}`` of the map's block (``## The module map``): a line at the
    left margin names a folder, an indented one a module of it (one a line, its line
    after it), a deeper one goes on with the line before."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert "## The module map" in text, "docs/architecture.md has no module map"
    block = text.split("## The module map", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    out: dict[str, str] = {}
    folder, last = None, None
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            folder = line.split()[0]
            assert folder.startswith("daskdist/") and folder.endswith("/"), line
            last = None
            continue
        m = re.match(r"^  (\S+\.py)(?:\s+(.*))?$", line)
        if m:
            assert folder is not None, line
            last = folder + m.group(1)
            assert last not in out, f"{last} is in the map twice"
            out[last] = m.group(2) or ""
        else:
            assert last is not None and line.startswith("     "), f"not a map line: {line!r}"
            out[last] += " " + line.strip()
    return out


def modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "daskdist").rglob("*.py")}


def test_every_module_of_the_package_is_in_the_map():
    missing = sorted(modules() - set(module_map()))
    assert not missing, f"docs/architecture.md's module map leaves out {missing}"


def test_the_map_names_only_modules_that_exist():
    extra = sorted(set(module_map()) - modules())
    assert not extra, f"docs/architecture.md's module map names no module: {extra}"


def test_each_entry_says_what_its_module_holds():
    empty = sorted(path for path, what in module_map().items() if len(what.split()) < 2)
    assert not empty, f"module map entries without a line of what they hold: {empty}"

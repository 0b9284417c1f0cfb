"""Every ``python`` block of the README and of each page under ``docs/`` runs, top to
bottom, against a real LocalCluster: a page's blocks share one namespace (a block may
use names from earlier blocks of its page, as a reader would), each page its own.

Blocks fenced ``python no-run`` are fragments that need what the tests do not have (an
HPC system, a GPU) and are left out; a page says so where they start.

The code's pointers resolve: every ``SPEC §N`` the package, its tests and its
benchmarks cite names a section of ``docs/spec.md``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
pytestmark = pytest.mark.timeout(300)


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """``(section, info string, code)`` of every fenced block of ``page``, in order."""
    out, section = [], ""
    for m in re.finditer(r"^(#+ [^\n]*)$|^```([^\n]*)\n(.*?)^```$", page.read_text(),
                         re.M | re.S):
        if m.group(1):
            section = m.group(1).lstrip("#").strip()
        else:
            out.append((section, m.group(2).strip(), m.group(3)))
    return out


def spec_sections() -> set[str]:
    """The section numbers of docs/spec.md's headings (``## 2. ...``, ``### 2.5a ...``)."""
    return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)?[a-z]?)\.? ",
                          (ROOT / "docs" / "spec.md").read_text(), re.M))


def spec_citations() -> dict[str, set[str]]:
    """``{section: files citing it}`` of every ``§N`` in the package, the tests and the
    benchmarks (``SPEC §4.1, §4.2``, ``§4.3 through §4.4``: each one)."""
    out: dict[str, set[str]] = {}
    for folder in ("daskdist", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for section in re.findall(r"§(\d+(?:\.\d+)?[a-z]?)", path.read_text()):
                out.setdefault(section, set()).add(path.relative_to(ROOT).as_posix())
    return out


def python_blocks(page: Path) -> list[tuple[str, str]]:
    return [(section, code) for section, info, code in blocks(page)
            if info.split()[:1] == ["python"] and "no-run" not in info.split()]


def test_the_readme_guides_in_at_most_400_lines_and_links_every_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 400
    assert "## Contents" in text
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in text, f"the README does not link docs/{page.name}"
    assert len(python_blocks(ROOT / "README.md")) >= 1


def test_every_spec_citation_names_a_section_of_docs_spec():
    cited = spec_citations()
    assert len([f for files in cited.values() for f in files if f.startswith("daskdist/")]) \
        >= 20  # the package cites its specification
    missing = {s: sorted(files) for s, files in cited.items() if s not in spec_sections()}
    assert not missing, f"cited, but no heading of docs/spec.md: {missing}"


def test_the_package_says_where_its_specification_is():
    import daskdist

    assert "docs/spec.md" in daskdist.__doc__
    assert "docs/spec.md" in (ROOT / "docs" / "architecture.md").read_text()


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)],
                         ids=lambda p: p.name)
def test_every_python_block_runs(page):
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    try:
        for section, code in python_blocks(page):
            try:
                exec(compile(code, f"{page.name} ({section})", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{page.name} block in {section!r} failed: {e!r}\n"
                                     f"{code}") from e
    finally:
        for name in ("coord", "client", "cluster"):  # a failed block leaves them open
            obj = namespace.get(name)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    pass

"""Every ``python`` block of the README runs, top to bottom, against a real LocalCluster.

Blocks share one namespace (a block may use names from earlier blocks, as a reader
would). Blocks fenced ``python no-run`` are fragments that need what the tests do not
have (an HPC system) and are left out; the README says so where it starts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
pytestmark = pytest.mark.timeout(240)


def blocks() -> list[tuple[str, str, str]]:
    """``(section, info string, code)`` of every fenced block, in order."""
    out, section = [], ""
    text = README.read_text()
    for m in re.finditer(r"^(#+ [^\n]*)$|^```([^\n]*)\n(.*?)^```$", text, re.M | re.S):
        if m.group(1):
            section = m.group(1).lstrip("#").strip()
        else:
            out.append((section, m.group(2).strip(), m.group(3)))
    return out


def python_blocks() -> list[tuple[str, str]]:
    return [(section, code) for section, info, code in blocks()
            if info.split()[:1] == ["python"] and "no-run" not in info.split()]


def test_readme_has_runnable_blocks_and_few_fragments():
    infos = [info for _, info, _ in blocks() if info.startswith("python")]
    assert len(python_blocks()) >= 5
    assert sum("no-run" in i for i in infos) <= 2  # fragments stay the exception


def test_readme_python_blocks_run():
    namespace: dict = {"__name__": "readme"}
    ran = []
    try:
        for section, code in python_blocks():
            try:
                exec(compile(code, f"README.md ({section})", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"README block in {section!r} failed: {e!r}\n{code}") from e
            ran.append(section)
    finally:
        for name in ("coord", "client", "cluster"):  # a failed block leaves them open
            obj = namespace.get(name)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    pass
    assert {"Async closures", "Data", "Collectives and elastic training",
            "JupyterLab and the dashboard"} <= set(ran)

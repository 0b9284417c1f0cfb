"""pyproject.toml and environment.yml list the same packages (conda users get what pip gets)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def _name(requirement: str) -> str:
    name = re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0]
    return name.lower().replace("_", "-")


def pyproject_packages() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    return {_name(r) for r in reqs}


def environment_packages() -> set[str]:
    names = set()
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"\s+-\s+([A-Za-z0-9_.\-]+)", line)
        if m and m.group(1) not in ("python", "pip", "conda-forge"):
            names.add(CONDA_NAMES.get(m.group(1), m.group(1)).lower().replace("_", "-"))
    return names


def test_environment_lists_what_pyproject_lists():
    pip, conda = pyproject_packages(), environment_packages()
    assert pip == conda, (f"only in pyproject.toml: {sorted(pip - conda)}; "
                          f"only in environment.yml: {sorted(conda - pip)}")


def test_dashboard_dependencies_present():
    # Dask's dashboard needs bokeh at the version distributed asks for
    from distributed.versions import BOKEH_REQUIREMENT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bokeh = [r for r in project["dependencies"] if _name(r) == "bokeh"]
    assert bokeh and bokeh[0].replace(" ", "") == str(BOKEH_REQUIREMENT).replace(" ", "")

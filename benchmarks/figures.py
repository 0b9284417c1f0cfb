"""A benchmark's headline figure: printed as the benchmark words it, and recorded.

Every benchmark reports each headline figure through :func:`record`: it prints the
figure's line and, when the environment variable ``DASKDIST_BENCH_FIGURES`` names a file,
appends the figure to it as one JSON line (a :class:`Figure`). ``benchmarks/table.py``
renders such a file as ``docs/benchmarks.md``, and ``bash scripts/dev.sh bench`` does
both for every benchmark. Each figure carries the commit it was measured at (and whether
the tree had uncommitted changes), so the page can say which figures are older than the
code they measure.

A figure is ours beside an anchor in the same unit, and the ratio is always ours /
anchor. The anchor is what the figure is judged against: the other system's figure
measured in the same run where there is one, otherwise the bound of the target (so a
recovery time reads as a share of its target).

    from figures import record

    record(f"latency {ours:.2f} ms (target <= 2 ms)", what="schedule + fetch round trip",
           ours=ours, unit="ms", anchor="submit + result", anchor_value=theirs,
           target="≤ 2 ms", met=ours <= 2)
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ENV = "DASKDIST_BENCH_FIGURES"


@dataclasses.dataclass(frozen=True)
class Figure:
    """One row of the benchmarks table."""

    benchmark: str  # the script that measured it, e.g. "bench_closures"
    what: str  # what is measured, in a few words
    ours: float | None  # None (as anchor_value) in a figure known only as a ratio
    unit: str  # of ``ours`` and ``anchor_value`` alike
    anchor: str  # what ours is set beside
    anchor_value: float | None
    ratio: float | None  # ours / anchor_value (None where the anchor is 0)
    target: str | None  # e.g. "≥ 0.9x", "≤ 1 s"; None: shown for context
    met: bool | None  # None when there is no target
    machine: str  # e.g. "2-core VM, 24 GB, CPU"
    load: float | None  # the 1-minute load average when recorded (None: not known)
    date: str  # ISO date, e.g. "2026-11-27"
    commit: str | None = None  # ``git rev-parse --short HEAD`` of the tree measured
    dirty: bool = False  # the tree had uncommitted changes to tracked files

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Figure:
        return cls(**json.loads(line))


@functools.cache
def machine() -> str:
    """This machine in a few words: cores, whether it is a VM, memory, GPU or CPU."""
    cores = os.cpu_count() or 1
    try:
        with open("/proc/cpuinfo") as f:
            kind = "VM" if " hypervisor" in f.read() else "machine"
    except OSError:
        kind = "machine"
    try:
        ram = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GB"
    except (ValueError, OSError):
        ram = "? GB"
    return f"{cores}-core {kind}, {ram}, {_gpu() or 'CPU'}"


def _gpu() -> str | None:
    """The first GPU's name from ``nvidia-smi`` (no CUDA context in this process: a
    benchmark that forks workers later must not have initialized CUDA)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n.strip() for n in out.splitlines() if n.strip()]
    if not names:
        return None
    return names[0] if len(names) == 1 else f"{len(names)}x {names[0]}"


@functools.cache
def revision() -> tuple[str | None, bool]:
    """The commit this checkout is at (short) and whether its tracked files have
    uncommitted changes; ``(None, False)`` outside a git checkout."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=30, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return None, False
    return commit, bool(git("status", "--porcelain", "--untracked-files=no"))


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 1)
    except (AttributeError, OSError):  # not every platform has one
        return None


def record(line: str | None, *, what: str, ours: float, unit: str, anchor: str,
           anchor_value: float, target: str | None = None,
           met: bool | None = None) -> Figure:
    """Print ``line`` (``None``: the figure shares a line printed with another) and, when
    ``DASKDIST_BENCH_FIGURES`` is set, append the figure to that file as a JSON line.

    ``target`` and ``met`` go together: a figure with a target says whether it met it,
    one without is shown for context. The benchmark is the running script's name; the
    commit is this checkout's (:func:`revision`)."""
    if (target is None) != (met is None):
        raise ValueError("a target needs met=True/False, and met needs a target")
    if line is not None:
        print(line, flush=True)
    fig = Figure(
        benchmark=Path(sys.argv[0]).stem, what=what, ours=float(ours), unit=unit,
        anchor=anchor, anchor_value=float(anchor_value),
        ratio=float(ours) / float(anchor_value) if anchor_value else None,
        target=target, met=None if met is None else bool(met), machine=machine(),
        load=_load(), date=datetime.date.today().isoformat(), commit=revision()[0],
        dirty=revision()[1])
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(fig.to_json() + "\n")
    return fig

"""Sets of row ids as sorted, disjoint, non-adjacent half-open intervals ``(start, stop)``.

Pure helpers shared by the lease table (:mod:`daskdist.core.leases`, the scheduler
side of the ``"dynamic"`` policy) and the loader (:mod:`daskdist.data`, the worker
side), so neither imports the other. Imports nothing from Dask, torch, pyarrow or the
rest of the package.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Interval = tuple[int, int]

__all__ = [
    "Interval",
    "intervals_from_ids",
    "normalize",
    "subtract",
    "union",
]


def normalize(ranges: Iterable[Sequence[int]]) -> list[Interval]:
    """Sort and merge overlapping or adjacent intervals; drop empty ones."""
    items = sorted((int(a), int(b)) for a, b in ranges if int(b) > int(a))
    out: list[Interval] = []
    for a, b in items:
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def union(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """``x`` and ``y`` together (normalized)."""
    if not x:
        return list(y)
    if not y:
        return list(x)
    return normalize(x + y)


def subtract(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """``x`` minus ``y`` (both normalized)."""
    out: list[Interval] = []
    j = 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        cur = a
        while k < len(y) and y[k][0] < b:
            if y[k][0] > cur:
                out.append((cur, y[k][0]))
            cur = max(cur, y[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def _intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """Ids in both ``x`` and ``y`` (both normalized)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(x) and j < len(y):
        a = max(x[i][0], y[j][0])
        b = min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _size(x: Iterable[Interval]) -> int:
    """Number of ids in the intervals."""
    return sum(b - a for a, b in x)


def intervals_from_ids(ids: Iterable[int]) -> list[Interval]:
    """Intervals covering exactly the given row ids (for tests and small inputs)."""
    return normalize((i, i + 1) for i in ids)


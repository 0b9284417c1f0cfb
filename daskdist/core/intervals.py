"""Sets of row ids as sorted, disjoint, non-adjacent half-open intervals ``(start, stop)``.

Pure helpers shared by the lease table (:mod:`daskdist.core.leases.table`, the scheduler
side of the ``"dynamic"`` policy) and the loader (:mod:`daskdist.data`, the worker
side), so neither imports the other: list helpers for small sets, and :class:`RowSet`,
a mutable set whose single-interval operations cost O(log fragments) to find the place
(plus a list shift of pointers), never O(rows) or O(units). Imports nothing from Dask,
torch, pyarrow or the rest of the package.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence

Interval = tuple[int, int]

__all__ = [
    "Interval",
    "RowSet",
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


def intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
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


def size_of(x: Iterable[Interval]) -> int:
    """Number of ids in the intervals."""
    return sum(b - a for a, b in x)


def intervals_from_ids(ids: Iterable[int]) -> list[Interval]:
    """Intervals covering exactly the given row ids (for tests and small inputs)."""
    return normalize((i, i + 1) for i in ids)



class RowSet:
    """A mutable set of row ids: sorted, disjoint, non-adjacent intervals kept in two
    parallel lists (``starts``, ``stops``), and the number of ids (``size``).

    Each operation on one interval finds its place by bisection; memory grows with the
    number of fragments, never with the rows. Not thread-safe.
    """

    __slots__ = ("size", "starts", "stops")

    def __init__(self, intervals: Iterable[Sequence[int]] = ()) -> None:
        self.starts: list[int] = []
        self.stops: list[int] = []
        self.size = 0
        for a, b in normalize(intervals):
            self.starts.append(a)
            self.stops.append(b)
            self.size += b - a

    def __len__(self) -> int:
        """Fragments (intervals), not ids: see :attr:`size`."""
        return len(self.starts)

    def __bool__(self) -> bool:
        return self.size > 0

    def __iter__(self) -> Iterator[Interval]:
        return zip(self.starts, self.stops, strict=True)

    def items(self) -> list[Interval]:
        return list(zip(self.starts, self.stops, strict=True))

    def __repr__(self) -> str:
        return f"RowSet({self.items()!r})"

    def covers(self, a: int, b: int) -> bool:
        """Every id of ``[a, b)`` is in the set (``a < b``)."""
        i = bisect_right(self.starts, a) - 1
        return i >= 0 and self.stops[i] >= b

    def add(self, a: int, b: int) -> None:
        """Add ``[a, b)``, which must be disjoint from the set (``ValueError`` if not);
        merged with the intervals it touches."""
        if a >= b:
            return
        starts, stops = self.starts, self.stops
        i = bisect_right(starts, a)
        if (i > 0 and stops[i - 1] > a) or (i < len(starts) and starts[i] < b):
            raise ValueError(f"rows [{a}, {b}) overlap the set")
        left = i > 0 and stops[i - 1] == a
        right = i < len(starts) and starts[i] == b
        if left and right:
            stops[i - 1] = stops[i]
            del starts[i], stops[i]
        elif left:
            stops[i - 1] = b
        elif right:
            starts[i] = a
        else:
            starts.insert(i, a)
            stops.insert(i, b)
        self.size += b - a

    def remove(self, a: int, b: int) -> bool:
        """Remove ``[a, b)`` if every id of it is in the set; ``False`` (nothing changed)
        if not."""
        if a >= b:
            return True
        starts, stops = self.starts, self.stops
        i = bisect_right(starts, a) - 1
        if i < 0 or stops[i] < b:
            return False
        s, t = starts[i], stops[i]
        if s == a and t == b:
            del starts[i], stops[i]
        elif s == a:
            starts[i] = b
        elif t == b:
            stops[i] = a
        else:
            stops[i] = a
            starts.insert(i + 1, b)
            stops.insert(i + 1, t)
        self.size -= b - a
        return True

    def intersect(self, a: int, b: int) -> list[Interval]:
        """The ids of ``[a, b)`` that are in the set, as intervals."""
        starts, stops = self.starts, self.stops
        i = max(0, bisect_right(starts, a) - 1)
        out: list[Interval] = []
        while i < len(starts) and starts[i] < b:
            lo, hi = max(a, starts[i]), min(b, stops[i])
            if lo < hi:
                out.append((lo, hi))
            i += 1
        return out

"""A dataset's units as the lease table sees them (pure): where each unit's row ids lie.

Two kinds, one interface (:class:`Units`), so the table never asks which it holds:

- :class:`DenseUnits`: units whose row counts are known when the dataset is defined
  (files' row groups, dask Arrays' chunks), run-length encoded: 16 bytes per run of
  equal units, however many units. Row ids are dense: ``0 .. total``.
- :class:`StridedUnits`: a Dask collection's partitions of unknown length (a lazy
  DataFrame: lengths are learned as partitions are computed, never by a pass first).
  Partition ``p`` owns the ``STRIDE`` ids from ``p * STRIDE``; once its length is
  learned the ids past it are *absent* (they leave every epoch).

Imports nothing from Dask, torch, pyarrow or the rest of the package.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from itertools import groupby

from daskdist.core.intervals import Interval, RowSet, subtract
from daskdist.core.leases.partitions import MAX_UNITS, STRIDE

__all__ = ["DenseUnits", "StridedUnits", "Units", "unit_runs"]


def unit_runs(unit_rows: Iterable[int]) -> list[tuple[int, int]]:
    """Per-unit row counts run-length encoded: ``[(rows per unit, units), ...]``."""
    runs: list[tuple[int, int]] = []
    for r in unit_rows:
        r = int(r)
        if runs and runs[-1][0] == r:
            runs[-1] = (r, runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs


class Units:
    """What the lease table asks of a dataset's units.

    ``total`` is the id space and ``units`` the unit count; ``runs`` is what two
    definitions are compared by; ``absent`` holds ids learned not to exist (empty for
    dense units); ``known`` / ``known_rows`` count the units of known length and their
    rows."""

    total: int
    units: int
    known: int
    known_rows: int
    absent: RowSet

    @property
    def runs(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def bounds(self, unit: int) -> Interval:
        """The ids of ``unit`` that may exist, as ``(start, stop)``."""
        raise NotImplementedError

    def unit_of(self, row: int) -> int:
        """The unit holding id ``row``."""
        raise NotImplementedError

    def stop_of(self, row: int) -> int:
        """The end of the id space of the unit holding ``row``."""
        raise NotImplementedError

    def learn(self, unit: int, length: int) -> int | None:
        """``unit`` was read and has ``length`` rows: ``None`` if that agrees with what
        is known, else the length known before (nothing changes then)."""
        raise NotImplementedError

    def length_runs(self) -> list[tuple[int, int]] | None:
        """Lengths learned so far (``None``: all were defined)."""
        return None

    def length_of(self, unit: int) -> int:
        """``unit``'s rows (``-1``: not known yet)."""
        a, b = self.bounds(unit)
        return b - a

    def fits(self, length: int) -> bool:
        """Whether a unit may have ``length`` rows."""
        return length >= 0

    def tail(self, unit: int) -> Interval | None:
        """The ids of ``unit``'s id space past its known length (``None``: none)."""
        return None

    def units_in(self, rows: int) -> float:
        """About how many whole units ``rows`` free rows make, in O(1)."""
        raise NotImplementedError

    def phantoms(self, ranges: Iterable[Interval]) -> int:
        """How many ids of ``ranges`` may not exist (counted per unit they touch)."""
        return 0

    def universe(self) -> list[Interval]:
        """Every id that may exist: all ids minus the absent ones."""
        if not self.total:
            return []
        return subtract([(0, self.total)], self.absent.items()) if self.absent else [
            (0, self.total)]

    def nbytes(self) -> int:
        raise NotImplementedError


class DenseUnits(Units):
    """Units from their runs (:func:`unit_runs`): where each run starts and its units'
    size, 16 bytes per run; finds the unit holding a row by bisection."""

    __slots__ = ("_r0", "_runs", "_sz", "_u0", "absent", "known", "known_rows", "size",
                 "start", "total", "units")

    def __init__(self, runs: Sequence[Sequence[int]]) -> None:
        self._runs = [(int(r), int(n)) for r, n in runs]
        self.start = array("q", [0])
        self.size = array("q")
        # per run, zero-row runs included: its first unit, first row and unit size
        self._u0, self._r0, self._sz = array("q"), array("q"), array("q")
        pos = units = 0
        for rows, count in self._runs:
            if rows < 0 or count < 1:
                raise ValueError(f"a run of units must have rows >= 0 and units >= 1, "
                                 f"got {(rows, count)}")
            self._u0.append(units)
            self._r0.append(pos)
            self._sz.append(rows)
            if rows:  # units of no rows hold no ids: nothing to find
                self.size.append(rows)
                pos += rows * count
                self.start.append(pos)
            units += count
        self.total = self.known_rows = pos
        self.units = self.known = units
        self.absent = RowSet()  # every id exists

    @property
    def runs(self) -> list[tuple[int, int]]:
        return self._runs

    def bounds(self, unit: int) -> Interval:
        i = bisect_right(self._u0, unit) - 1
        a = self._r0[i] + (unit - self._u0[i]) * self._sz[i]
        return a, a + self._sz[i]

    def unit_of(self, row: int) -> int:
        i = bisect_right(self._r0, row) - 1
        return self._u0[i] + (row - self._r0[i]) // self._sz[i]

    def stop_of(self, row: int) -> int:
        i = bisect_right(self.start, row) - 1
        size = self.size[i]
        first = self.start[i]
        return first + ((row - first) // size + 1) * size

    def learn(self, unit: int, length: int) -> int | None:
        a, b = self.bounds(unit)
        return None if length == b - a else b - a

    def units_in(self, rows: int) -> float:
        return rows * self.units / self.total if self.total else 0.0

    def nbytes(self) -> int:
        return self.start.itemsize * (len(self.start) + len(self.size))


class StridedUnits(Units):
    """``units`` partitions of ``stride`` ids each, with the lengths known so far
    (``-1``: unknown); ids past a known length are in :attr:`absent`."""

    __slots__ = ("_runs", "absent", "known", "known_rows", "lengths", "stride", "total",
                 "units")

    def __init__(self, units: int, stride: int = STRIDE) -> None:
        units, stride = int(units), int(stride)
        if not 0 <= units <= MAX_UNITS:
            raise ValueError(f"a collection has 0 .. {MAX_UNITS} partitions, got {units}")
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.units = units
        self.stride = stride
        self.total = units * stride
        self.lengths = array("q", [-1]) * units
        self.known = 0
        self.known_rows = 0
        self.absent = RowSet()
        self._runs: tuple[int, list[tuple[int, int]]] | None = None  # (known, runs)

    @property
    def runs(self) -> list[tuple[int, int]]:
        """``[(-stride, units)]``: a negative row count marks strided ids (dense runs
        never have one)."""
        return [(-self.stride, self.units)]

    def unit_of(self, row: int) -> int:
        return row // self.stride

    def bounds(self, unit: int) -> Interval:
        a = unit * self.stride
        n = self.lengths[unit]
        return a, a + (self.stride if n < 0 else n)

    def stop_of(self, row: int) -> int:
        return (row // self.stride + 1) * self.stride

    def learn(self, unit: int, length: int) -> int | None:
        """Record ``unit``'s length (its tail ids become absent); ``ValueError`` for a
        length of ``stride`` or more."""
        if not self.fits(length):
            raise ValueError(f"partition {unit} has {length} rows; a partition may have "
                             f"at most {self.stride - 1}")
        old = self.lengths[unit]
        if old >= 0:
            return None if old == length else old
        self.lengths[unit] = length
        self.known += 1
        self.known_rows += length
        a, b = unit * self.stride + length, (unit + 1) * self.stride
        if a < b:
            self.absent.add(a, b)
        return None

    def length_of(self, unit: int) -> int:
        return self.lengths[unit]

    def fits(self, length: int) -> bool:
        return 0 <= length < self.stride

    def tail(self, unit: int) -> Interval | None:
        n = self.lengths[unit]
        return None if n < 0 else (unit * self.stride + n, (unit + 1) * self.stride)

    def length_runs(self) -> list[tuple[int, int]]:
        """The lengths known so far, run-length encoded in partition order, ``-1`` for
        a run of unknown ones (what a ledger carries). Built once per change."""
        if self._runs is None or self._runs[0] != self.known:
            runs = [(n, sum(1 for _ in same)) for n, same in groupby(self.lengths)]
            self._runs = (self.known, runs)
        return list(self._runs[1])

    def units_in(self, rows: int) -> float:
        """``stride`` free ids per partition of unknown length, the rest by the mean of
        the lengths learned (exact while learned partitions' free rows sum under
        ``stride``)."""
        unknown, rest = divmod(rows, self.stride)
        return unknown + (rest * self.known / self.known_rows if self.known_rows else 0)

    def phantoms(self, ranges: Iterable[Interval]) -> int:
        """``stride`` per unit of unknown length touched, or of known length whose tail
        ``ranges`` hold."""
        s = self.stride
        n = 0
        for a, b in ranges:
            for u in range(a // s, (b - 1) // s + 1):
                length = self.lengths[u]
                if length < 0 or (u * s + length < b and a < (u + 1) * s):
                    n += s
        return n

    def nbytes(self) -> int:
        return self.lengths.itemsize * len(self.lengths)

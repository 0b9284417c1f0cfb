"""How a batch-inference unit names itself: its file and row groups, or its partition,
and its row ids (what a failure and the job's error say), and the partition lengths
reading it learned (what its ledger record keeps, so a new run leases no id past them).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

from daskdist.core.intervals import Interval
from daskdist.core.leases.partitions import STRIDE

__all__ = ["describe", "lengths_learned"]


def _ranges(rows: Sequence[Interval]) -> str:
    shown = ", ".join(f"[{a}, {b})" for a, b in rows[:3])
    return shown + (f" and {len(rows) - 3} more" if len(rows) > 3 else "")


def describe(source: Any, rows: Sequence[Interval]) -> str:
    """``rows`` of ``source`` in words: ``"data/a.parquet row groups 0-2, rows [0, 3000)"``,
    ``"partition 3 of the dask DataFrame (12 partitions), rows [...]"``."""
    if not rows:
        return "no rows"
    first = rows[0][0]
    last = rows[-1][1] - 1
    units = getattr(getattr(source, "shards", None), "units", None)
    if units is not None and hasattr(source, "unit_groups"):  # files: their row groups
        starts = [u.start for u in units]
        lo, hi = units[bisect_right(starts, first) - 1], units[bisect_right(starts, last) - 1]
        if lo.path == hi.path:
            groups = (f"row group {lo.piece}" if lo.piece == hi.piece
                      else f"row groups {lo.piece}-{hi.piece}")
            where = f"{lo.path} {groups}"
        else:
            where = f"{lo.path} row group {lo.piece} to {hi.path} row group {hi.piece}"
        return f"{where}, rows {_ranges(rows)}"
    lengths = getattr(source, "lengths", None)
    if hasattr(source, "num_partitions"):  # a collection: its partitions
        if lengths is None:
            lo, hi = first // STRIDE, last // STRIDE
        else:
            starts = [0]
            for n in lengths[:-1]:
                starts.append(starts[-1] + n)
            lo, hi = bisect_right(starts, first) - 1, bisect_right(starts, last) - 1
        part = f"partition {lo}" if lo == hi else f"partitions {lo}-{hi}"
        return f"{part} of the {source.what}, rows {_ranges(rows)}"
    return f"rows {_ranges(rows)} of {source!r}"


def lengths_learned(source: Any, rows: Sequence[Interval]) -> list[tuple[int, int]]:
    """``(partition, rows)`` of the partitions ``rows`` cover whole, for a collection
    whose lengths are learned by reading (a lease of such a collection is one partition,
    whole); ``[]`` for any other source."""
    if not hasattr(source, "num_partitions") or getattr(source, "lengths", 0) is not None:
        return []
    counts: dict[int, int] = {}
    for a, b in rows:
        counts[a // STRIDE] = counts.get(a // STRIDE, 0) + (b - a)
    return sorted(counts.items())

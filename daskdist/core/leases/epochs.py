"""A ``"dynamic"`` dataset and its epochs' row pools (pure): what the lease table keeps per
dataset, and the moves of rows between pools that do not involve sessions' indexes.

Per epoch every row id that may exist is *free*, *deferred* (given back by a failed read:
served after every other free row), *leased* to one session, or *acknowledged*. Each
pool is a :class:`~daskdist.core.intervals.RowSet`: memory grows with fragmentation,
never with rows or units. Ids a collection learned not to exist (``units.absent``) are
in no pool and not in the epoch's ``total``.

Imports nothing from Dask, torch, pyarrow or the rest of the package.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from daskdist.core.intervals import (
    Interval,
    RowSet,
    intersect,
    normalize,
    size_of,
    subtract,
    union,
)
from daskdist.core.leases.partitions import Permutation
from daskdist.core.leases.units import Units

__all__ = ["Dataset", "Epoch", "Rates"]


class Rates:
    """Rows a second each session's loader consumes from one dataset, as the loaders
    measured them, and their sum: what weighs a reader's share of an epoch's rows.
    Kept across epochs (a loader's pace outlives its epoch); a lost session's goes."""

    __slots__ = ("of", "total")

    def __init__(self) -> None:
        self.of: dict[str, float] = {}
        self.total = 0.0

    def set(self, session: str, rate: float) -> None:
        """``session`` consumes ``rate`` rows a second (its newest measure)."""
        self.total += rate - self.of.get(session, 0.0)
        self.of[session] = rate

    def forget(self, session: str) -> None:
        """``session`` was lost: its rate weighs no share any more."""
        self.total -= self.of.pop(session, 0.0)
        if not self.of:
            self.total = 0.0  # no drift left behind by float sums

    def weight(self, session: str, parts: int) -> float | None:
        """``session``'s share of the ``parts`` readers' consumption: its rate over
        their sum (a reader that measured none counts as the mean); ``None`` (an equal
        share) while ``session`` measured none."""
        rate = self.of.get(session)
        known = len(self.of)
        if rate is None or self.total <= 0:
            return None
        return min(1.0, rate / (self.total * max(parts, known) / known))


@dataclass
class Epoch:
    """One epoch's pools and counts."""

    total: int
    free: RowSet
    acked: RowSet
    deferred: RowSet = field(default_factory=RowSet)
    leased: dict[str, RowSet] = field(default_factory=dict)
    n_leased: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # source -> failed reads
    failed: str | None = None  # why the epoch cannot complete
    # a shuffled dataset's units are leased in a seeded order, this far along it
    order: Permutation | None = None
    cursor: int = 0
    # ids of leased rows that may not exist (a unit of unknown length, or the tail of one
    # learned since it was leased); ``total`` counts them
    phantom_leased: int = 0
    # of a dataset leased in whole units (its loaders report each unit they read): per
    # session, the leased rows its loader has not read yet, what the tail rule weighs.
    # Rows read stay leased until the closure that took them completes, which for a loop
    # over a whole epoch is its end: counted as held, they would keep that loader from
    # the epoch's last units although it holds none of them to read
    ahead: dict[str, RowSet] = field(default_factory=dict)

    @property
    def n_free(self) -> int:
        """Rows that may be leased (deferred ones included)."""
        return self.free.size + self.deferred.size

    def not_ahead(self, session: str, a: int, b: int) -> None:
        """Ids ``[a, b)`` of ``session``'s lease are read, acknowledged or given back:
        no longer ahead of its loader."""
        rows = self.ahead.get(session)
        if rows is None:
            return
        for lo, hi in rows.intersect(a, b):
            rows.remove(lo, hi)
        if not rows:
            del self.ahead[session]

    def drop_rows(self, rows: RowSet, a: int, b: int) -> None:
        """Ids ``[a, b)`` learned not to exist leave ``rows`` (one of this epoch's
        pools or leases) and the epoch's total."""
        n = 0
        for lo, hi in rows.intersect(a, b):
            rows.remove(lo, hi)
            n += hi - lo
        self.total -= n
        if rows is not self.free and rows is not self.deferred:
            self.n_leased -= n


@dataclass
class Dataset:
    """A defined (or registered) dataset: label, owner, seed, units and epochs.

    ``shuffle``: units are leased in an order seeded by ``(seed, epoch)``; ``whole``: a
    unit is leased whole, never split by the tail rule (a collection's partition read in
    part is computed whole)."""

    label: str
    owner: str
    seed: int = 0
    units: Units | None = None  # None: registered, not defined yet
    epochs: dict[int, Epoch] = field(default_factory=dict)
    completed: list[Interval] = field(default_factory=list)  # intervals of epochs
    shuffle: bool = False
    whole: bool = False
    rates: Rates = field(default_factory=Rates)  # its readers' paces

    @property
    def defined(self) -> Units:
        """The units (``LookupError`` for a dataset registered, not defined yet)."""
        if self.units is None:
            raise LookupError(f"dataset {self.label!r} has no units defined yet")
        return self.units

    def is_complete(self, epoch: int) -> bool:
        units = self.units
        if units is not None and units.total == units.absent.size:
            return True  # no row at all (an empty collection's learned lengths too)
        i = bisect_right(self.completed, (epoch, float("inf"))) - 1
        return i >= 0 and self.completed[i][0] <= epoch < self.completed[i][1]

    def complete(self, epoch: int) -> Epoch:
        """Every row of ``epoch`` is acknowledged: keep only that fact; its table."""
        ep = self.epochs.pop(epoch)
        self.completed = union(self.completed, [(epoch, epoch + 1)])
        return ep

    def uncomplete(self, epoch: int) -> None:
        self.completed = subtract(self.completed, [(epoch, epoch + 1)])

    def check_rows(self, rows: list[Interval], name: str) -> list[Interval]:
        """``rows`` (normalized) inside the id space, absent ids left out;
        ``ValueError`` naming the dataset for rows outside."""
        total = self.defined.total
        if rows and (rows[0][0] < 0 or rows[-1][1] > total):
            raise ValueError(f"acknowledged rows {rows[0]}..{rows[-1]} are outside "
                             f"dataset {name}'s [0, {total})")
        absent = self.defined.absent
        return subtract(rows, absent.items()) if absent else rows

    def new_epoch(self, epoch: int, acknowledged: Iterable[Sequence[int]], name: str,
                  max_epochs: int) -> Epoch:
        """A table for ``epoch`` with ``acknowledged`` rows acknowledged, the rest free."""
        if len(self.epochs) >= max_epochs:
            raise ValueError(f"dataset {name} has {len(self.epochs)} unfinished epochs; "
                             f"at most {max_epochs}")
        acked = self.check_rows(normalize(acknowledged), name)
        universe = self.defined.universe()
        ep = Epoch(size_of(universe), RowSet(subtract(universe, acked)), RowSet(acked))
        self.epochs[epoch] = ep
        return ep

    def returned(self, ep: Epoch, a: int, b: int) -> list[Interval]:
        """Rows ``[a, b)`` coming back to a pool, minus ids learned not to exist (those
        leave the epoch's total)."""
        absent = self.defined.absent
        gone = absent.intersect(a, b) if absent else None
        if not gone:
            return [(a, b)]
        ep.total -= size_of(gone)
        return subtract([(a, b)], gone)

    def permuted(self, ep: Epoch, epoch: int, need: int,
                 cap: int | None = None) -> list[Interval]:
        """Take the free rows of whole units in the order seeded by ``(seed, epoch)``
        until ``need`` rows are taken; ``[]`` once the order is walked through (rows that
        came back since are served lowest first). A unit's free rows beyond ``cap``
        (the tail rule) are taken only as far as ``need``: the rest stays free, served
        once the order is walked. O(1) amortized per unit."""
        units = self.defined
        if ep.order is None:
            ep.order = Permutation(units.units, self.seed, epoch)
        out: list[Interval] = []
        while need > 0 and ep.cursor < ep.order.n:
            a, b = units.bounds(ep.order[ep.cursor])
            ep.cursor += 1
            for lo, hi in ep.free.intersect(a, b):
                if cap is not None and hi - lo > cap:
                    if need <= 0:
                        break
                    hi = lo + need
                ep.free.remove(lo, hi)
                out.append((lo, hi))
                need -= hi - lo
        return out

    def held_rows(self, ep: Epoch) -> list[Interval]:
        """Rows leased or deferred now (normalized)."""
        return normalize([iv for rs in (*ep.leased.values(), ep.deferred) for iv in rs])

    def clash(self, ep: Epoch, acked: list[Interval]) -> list[Interval]:
        """Rows of ``acked`` that are leased or deferred now."""
        return intersect(acked, self.held_rows(ep))

    def progress(self, dataset_id: str, epoch: int) -> dict:
        """``total``, ``acknowledged``, ``leased``, ``free`` (deferred rows included)
        rows, ``complete`` (every row acknowledged) and ``failed`` (why the epoch cannot
        complete, or ``None``); ``ids``, the id space, and ``units``. Of a collection
        whose lengths are learned: ``total`` counts the rows of partitions computed so
        far, ``known`` is False until every length is, ``units_known`` counts them; ids
        that may not exist are in no count."""
        out = {"dataset_id": dataset_id, "name": self.label, "epoch": epoch,
               "known": False, "total": 0, "acknowledged": 0, "leased": 0, "free": 0,
               "units": 0, "complete": False, "failed": None}
        units = self.units
        if units is None:
            return out
        real = units.known_rows
        out.update(known=units.known == units.units, total=real, units=units.units,
                   ids=units.total)
        if units.length_runs() is not None:
            out["units_known"] = units.known
        ep = self.epochs.get(epoch)
        if self.is_complete(epoch):
            out.update(acknowledged=real, complete=True)
        elif ep is None:
            out.update(free=real)
        else:
            phantom = ep.total - real  # ids of unknown lengths (and stale tails)
            out.update(acknowledged=ep.acked.size, leased=ep.n_leased - ep.phantom_leased,
                       free=ep.n_free - (phantom - ep.phantom_leased), failed=ep.failed)
        return out

    def takes(self, session: str) -> bool:
        """Whether a closure reading this dataset should run on ``session`` now: yes
        unless its free rows are gone and other sessions, not this one, hold its leased
        rows (the epoch's tail: the rows are with those readers, a closure elsewhere
        would find none). O(unfinished epochs)."""
        held = False
        for ep in self.epochs.values():
            if ep.free or ep.deferred:
                return True
            if ep.leased:
                if session in ep.leased:
                    return True
                held = True
        return not held

"""Rows a leased pass holds: leased to this worker's session and not yet handed to a
caller. The one copy of the ``"dynamic"`` policy's bookkeeping on the worker, whatever
kind of source the rows come from.

- :meth:`LeaseHolder.hold`: a lease arrived (the prefetch thread);
- :meth:`LeaseHolder.delivered`: a batch's rows went to a caller (under the iterator's
  lock, in the caller's thread): they count for the caller's closure (its
  :class:`~daskdist.core.protocol.LeaseToken`, acknowledged if the closure completes,
  released if it fails); taken where no closure can acknowledge them (a thread the
  closure did not start, or one left running after it), they go back to the pool at
  once and the caller gets an error saying how to take batches;
- :meth:`LeaseHolder.give_back`: rows not handed on go back to the pool (free, or
  deferred with a failure counted, when they could not be read);
- :meth:`LeaseHolder.drop`: leased ids found not to exist (the table dropped them);
- :meth:`LeaseHolder.close`: everything still held goes back.

Its lock guards the held rows: the prefetch thread adds, gives back and drops, callers'
threads remove, ``close`` (after the prefetch thread was joined) gives back the rest.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from daskdist.core.intervals import Interval, RowSet
from daskdist.core.protocol import LeaseToken
from daskdist.session.scope import ClosureEndedError
from daskdist.session.tokens import record_consumed

__all__ = ["ConsumptionRate", "LeaseHolder"]


class ConsumptionRate:
    """Rows a second a loader's callers take, measured from its first batch of an epoch
    to now (the previous epoch's figure until ``min_span`` seconds have passed,
    ``daskdist.data.pace-span``): what weighs its share of a ``"dynamic"`` epoch's rows
    against the other readers', so a slow worker is leased fewer. Callers' threads add,
    the prefetch thread reads; a lock guards it.
    """

    def __init__(self, min_span: float = 0.25) -> None:
        self.min_span = min_span
        self._lock = threading.Lock()
        self._t0: float | None = None  # the epoch's first batch (its rows not counted)
        self._rows = 0
        self._last: float | None = None  # the previous epoch's rate

    def start(self) -> None:
        """A new epoch's pass: measure afresh, the last figure standing in meanwhile."""
        with self._lock:
            self._last = self._measured() or self._last
            self._t0, self._rows = None, 0

    def add(self, rows: int) -> None:
        """A batch of ``rows`` went to a caller."""
        with self._lock:
            if self._t0 is None:
                self._t0 = time.monotonic()
            else:
                self._rows += rows

    def rate(self) -> float | None:
        """Rows a second (``None``: not measured yet)."""
        with self._lock:
            return self._measured() or self._last

    def _measured(self) -> float | None:
        if self._t0 is None or not self._rows:
            return None
        span = time.monotonic() - self._t0
        return self._rows / span if span >= self.min_span and span > 0 else None


class LeaseHolder:
    """Leased rows not yet delivered, per lease, of one dataset's epoch."""

    def __init__(self, services: Any, dataset_id: str, epoch: int, label: str,
                 outside: bool = False) -> None:
        self.services = services
        self.dataset_id = dataset_id
        self.epoch = epoch
        self.label = label
        # no coordinator runs the closures (a LocalLeaseService): the caller acknowledges
        self.outside = outside
        self._lock = threading.Lock()
        self._leases: list[RowSet] = []  # held rows, per lease, oldest first

    def hold(self, ranges: list[Interval]) -> None:
        with self._lock:
            self._leases.append(RowSet(ranges))

    def _remove(self, ranges: list[Interval]) -> None:
        """Rows leave the held ones (under the lock)."""
        if len(ranges) == 1 and self._leases and self._leases[0].remove(*ranges[0]):
            if not self._leases[0]:  # the usual case: one run of the oldest lease
                del self._leases[0]
            return
        emptied = False
        for a, b in ranges:
            for held in self._leases:
                for lo, hi in held.intersect(a, b):
                    held.remove(lo, hi)
                emptied |= not held
        if emptied:
            self._leases = [held for held in self._leases if held]

    def delivered(self, ranges: list[Interval]) -> None:
        """Rows handed to the caller: no longer ours to give back; they count for the
        caller's closure (see the module doc)."""
        with self._lock:
            self._remove(ranges)
        try:
            if record_consumed(LeaseToken.of(self.dataset_id, self.epoch, ranges)) \
                    or self.outside:
                return
            problem = "which runs no daskdist closure"
        except ClosureEndedError:
            problem = "after the closure it was started in ended"
        # no closure will acknowledge these rows: back to the pool now, never stranded
        self.services.release(self.dataset_id, self.epoch, ranges)
        raise RuntimeError(
            f"thread {threading.current_thread().name!r} took a batch of dataset "
            f"{self.label!r} {problem}: no closure could acknowledge its rows, so "
            f"they went back to the pool. Take batches in the closure's own thread, or "
            f"start the thread in the closure's context (threading.Thread(target="
            f"contextvars.copy_context().run, args=(fn,))) and join it before the "
            f"closure returns: its rows then count for the closure")

    def give_back(self, ranges: list[Interval],
                  failure: tuple[str, str] | None = None) -> None:
        """Rows not handed on go back to the pool: deferred with ``failure`` (``(source,
        message)``, counted) when they could not be read, else free."""
        if not ranges:
            return
        with self._lock:
            self._remove(ranges)
        self.services.release(self.dataset_id, self.epoch, ranges, failure=failure)

    def drop(self, ranges: list[Interval]) -> None:
        """Leased ids that do not exist (the lease table dropped them already)."""
        with self._lock:
            self._remove(ranges)

    def close(self) -> None:
        """Give back every row still held."""
        with self._lock:
            rest = [iv for held in self._leases for iv in held]
            self._leases = []
        if rest:
            self.services.release(self.dataset_id, self.epoch, rest)

    def unread(self) -> int:
        """Rows held and not handed to a caller yet."""
        with self._lock:
            return sum(held.size for held in self._leases)

    def outstanding(self) -> list[Interval]:
        with self._lock:
            return [iv for held in self._leases for iv in held]

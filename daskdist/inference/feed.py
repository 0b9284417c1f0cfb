"""A member's units of a batch-inference job, read ahead: leased, read and converted in
a thread of the engine's own, handed whole to the job's closures.

:class:`UnitFeed` leases one unit at a time from the session's lease service (the
``"dynamic"`` policy's: whole row groups of at least ``unit_rows`` rows, or one
partition, a persisted one first to the member holding it), has the source's unit reads
read it (a collection's partitions computed ``partitions-ahead`` ahead, by helpers
under ``Coordinator(resources=...)``), stages it to the device (CUDA: through the
loader's pinned staging ring) and keeps one unit ready beyond the one being read. A
closure's :meth:`UnitFeed.take` gets the next unit whole; its rows count for that
closure (its lease token). When no row is free right now the pass ends, and the next
``take`` starts another (rows may have come back to the pool).

A unit that cannot be read or converted gives its rows back deferred, its failure
counted by the lease table (``max_worker_failures`` fail the job, naming it), and is
reported to the job (:attr:`UnitFeed.failures`); the feed goes on with the next.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from daskdist.core.intervals import Interval, normalize, subtract
from daskdist.data import batching
from daskdist.data.collections.compute import Interrupted
from daskdist.data.leased.held import LeaseHolder
from daskdist.data.prefetch import CLOSED, END, Failure, Feed
from daskdist.data.sources import ChunkItem, Pending, SourceReader, UnitFailure, UnitReads

__all__ = ["ReadUnit", "UnitFeed"]

EPOCH = 0  # a job reads its input once


@dataclass
class ReadUnit:
    """One leased unit, read: its rows (the ids that exist) and converted blocks."""

    ranges: list[Interval]
    items: list[ChunkItem]
    rows: int  # how many (what the feed's buffer counts)


class UnitFeed:
    """Units read ahead for the closures of one engine (module doc)."""

    def __init__(self, reader: SourceReader, services: Any, dataset_id: str, label: str,
                 stage: Any = None,
                 on_failure: Callable[[str, list[Interval], str], None] | None = None) -> None:
        self.reader = reader
        self.services = services
        self.dataset_id = dataset_id
        self.stage = stage  # a DeviceStage for CUDA, else None
        self.holder = LeaseHolder(services, dataset_id, EPOCH, label)
        self.on_failure = on_failure
        self.error: BaseException | None = None  # the lease service's last refusal
        self._lock = threading.Lock()
        self._feed: Feed | None = None
        self._reads: UnitReads | None = None  # the pass's (close interrupts its waits)
        self._closed = False

    def take(self) -> ReadUnit | None:
        """The next unit, whole (waits while it is read), its rows recorded for the
        calling closure; ``None`` when no row is free to lease now (or the feed closed,
        or the job's input failed: :attr:`error`)."""
        with self._lock:
            if self._closed:
                return None
            feed = self._feed
            if feed is None:
                feed = self._feed = Feed(self._units(), 1, f"daskdist-infer-{self.dataset_id}")
        item = feed.get()
        if item is END or item is CLOSED or isinstance(item, Failure):
            if isinstance(item, Failure):
                self.error = item.exc
            with self._lock:
                ended = self._feed is feed
                if ended:
                    self._feed = None
            if ended:
                feed.stop()  # its producer returned: others waiting on it get CLOSED
            return None
        if self.stage is not None:
            self.stage.ready(item.items)
        self.holder.delivered(item.ranges)
        return item

    def _units(self) -> Iterator[ReadUnit]:
        """One pass: lease, read and convert units until none is free right now."""
        reads = self._reads = self.reader.unit_reads(EPOCH, self.holder.drop)
        pending: deque[tuple[list[Interval], list[Pending]]] = deque()
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) <= reads.ahead:
                    rows, least = reads.lease_size
                    ranges = self.services.acquire(self.dataset_id, EPOCH, rows, least)
                    if not ranges:
                        exhausted = True
                        break
                    ranges = [(int(a), int(b)) for a, b in ranges]
                    self.holder.hold(ranges)
                    pending.append((ranges, reads.plan(ranges)))
                reads.check()
                if not pending:
                    reads.finish()
                    return
                ranges, plans = pending.popleft()
                unit = self._read(reads, ranges, plans)
                if unit is not None:
                    yield unit
        finally:
            for _, plans in pending:  # closed early: their rows go back with close()
                for p in plans:
                    reads.cancel(p)
            reads.close()

    def _read(self, reads: UnitReads, ranges: list[Interval],
              plans: list[Pending]) -> ReadUnit | None:
        """A leased unit's reads, converted (and staged); ``None`` when none of its ids
        exist (an empty partition) or a read failed (its rows given back, reported)."""
        items: list[ChunkItem] = []
        for i, p in enumerate(plans):
            try:
                item = reads.read(p)
            except Interrupted:
                for q in plans[i + 1:]:
                    reads.cancel(q)
                raise
            except UnitFailure as f:
                for q in plans[i + 1:]:
                    reads.cancel(q)
                self._failed(ranges, p, f)
                return None
            if item is not None and item.rows:
                items.append(item)
        if not items:
            return None
        rows = normalize(iv for it in items for iv in batching.ranges_of_ascending(it.ids))
        if self.stage is not None:
            items = [self.stage.stage(piece) for it in items for piece in self.stage.pieces(it)]
        return ReadUnit(rows, items, sum(it.rows for it in items))

    def _failed(self, ranges: list[Interval], p: Pending, f: UnitFailure) -> None:
        """A read failed: its rows go back deferred (the failure counted), the rest of
        the unit free; the job hears of it."""
        err = f.error()
        bad = normalize(f.rows if f.rows is not None else p.rows)
        self.holder.give_back(bad, failure=(f.source, str(err)))
        self.holder.give_back(subtract(normalize(ranges), bad))
        if self.on_failure is not None:
            self.on_failure(f.source, bad, f"{type(err).__name__}: {err}")

    def close(self) -> None:
        """Stop reading; leased rows no closure took go back to the pool."""
        with self._lock:
            self._closed = True
            feed, self._feed = self._feed, None
            reads = self._reads
        if reads is not None:
            reads.interrupt()  # a wait for a partition ends now
        if feed is not None:
            feed.stop()
        self.reader.close()
        self.holder.close()

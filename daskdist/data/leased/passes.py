"""A pass over an epoch's leased rows (``"dynamic"``), for any kind of source.

:class:`LeasedPass` asks the lease service for rows until none are free *right now*,
has the source's :class:`~.sources.UnitReads` read them, and keeps what it holds in a
:class:`~.held.LeaseHolder`. Once the loader's pace is measured, the next lease is
asked for while the rows held are read, as soon as they would last under
``daskdist.data.lease-lead`` at that pace: its round trip overlaps the reads, and a
slow reader does not hold a second lease's rows while the others run dry at the
epoch's end. The scheduler weighs a reader's share by its pace, so until it is
measured the loader asks for the least lease and only when it needs rows (a slow
worker never starts an epoch holding a fast one's share).
``reads.ahead`` planned reads (a collection's partitions computing) are kept beyond the
one being read.

No lease is an answer about the moment it was asked: asked while reads were planned,
it may be the tail rule holding this reader back for what it holds
(:mod:`daskdist.core.leases.tail`), so the pass asks again once those are read. Only
an answer to an ask made with nothing left to read, after the reads' reports reached
the table (what it counts as read), ends the pass: none is free for this reader.

A read that fails gives back at once what the pass holds and has not handed on: the
failed read's rows deferred with the failure counted (the scheduler fails the epoch
after ``max_worker_failures``), the rest free. Then the error is raised once, to the
closure that reaches it, naming the unit (and the column, for a conversion);
``InputError`` once the epoch failed. When it reaches the iterator, every block read
before was taken: the iterator's :meth:`close` then gives back the rest of what is
held (the rows of the batch it was cutting, which no caller received). ``chunks()`` may
run again after it ended, or was closed, to pick up rows that came back to the pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from daskdist.core.intervals import Interval, normalize, subtract
from daskdist.data.collections.compute import Interrupted
from daskdist.data.leased.held import ConsumptionRate, LeaseHolder
from daskdist.data.sources import ChunkItem, Pending, ReadSpec, UnitFailure, UnitReads
from daskdist.errors import InputError

__all__ = ["LeasedPass"]


class LeasedPass:
    """Leased rows of one epoch, read through a source's unit reads (module doc)."""

    def __init__(self, spec: ReadSpec, epoch: int,
                 reads: Callable[[Callable[[list[Interval]], None]], UnitReads],
                 define: Callable[[], None], outside: bool, rate: ConsumptionRate,
                 lead: float, lease_seconds: float) -> None:
        self.spec = spec
        self.epoch = epoch
        self.held = LeaseHolder(spec.services, spec.dataset_id, epoch,
                                spec.label or spec.dataset_id, outside)
        # the loader's (kept across its epochs): weighs this worker's share of leases
        self.rate = rate
        rate.start()
        self.lead = lead  # seconds of rows left unread when the next lease is asked for
        self.lease_seconds = lease_seconds  # seconds of rows a lease covers at most
        self._define = define  # the loader's definition of its dataset, once
        self._make_reads = reads
        self._reads: UnitReads | None = None

    def _ask(self, reads: UnitReads) -> Any:
        rows, least = reads.lease_size
        rate = self.rate.rate()
        if rate is None:  # pace not measured yet: the least lease (a batch), not a share
            rows = least
        elif self.lease_seconds:  # what it reads in ``lease_seconds``, at least ``least``
            rows = min(rows, max(least, int(rate * self.lease_seconds)))
        return self.spec.services.acquire_async(self.spec.dataset_id, self.epoch, rows,
                                                least=least, rate=rate)

    def _ahead(self, reads: UnitReads) -> bool:
        """Whether to ask for the next lease now, before the rows held are read: a source
        that plans reads ahead (a collection's partitions computing) always; else once
        the rows held and not handed on would last under ``lead`` seconds at the
        loader's pace, so the round trip hides behind them while a slow reader holds no
        second lease near the epoch's end (the others would run dry first)."""
        rate = self.rate.rate()
        if rate is None:
            return False
        return bool(reads.ahead) or self.held.unread() <= rate * self.lead

    def chunks(self) -> Iterator[ChunkItem]:
        """Lease, read and convert rows until none are free right now."""
        self._define()
        reads = self._reads = self._make_reads(self.held.drop)
        held = self.held
        pending: deque[Pending] = deque()
        ask: Any = self._ask(reads)
        dry = True  # the ask in flight was made with nothing left to read
        exhausted = False
        waiting = False  # held back: ask again once the planned reads are read
        try:
            while True:
                if ask is None and pending and not exhausted and not waiting \
                        and self._ahead(reads):
                    ask, dry = self._ask(reads), False  # read after what is held
                while not exhausted and len(pending) <= reads.ahead and not (
                        waiting and pending):
                    if ask is None:
                        dry = not pending
                        if dry:  # the table counts every unit read before it answers
                            reads.finish()
                        ask = self._ask(reads)
                    ranges, ask = ask.result(), None  # ends when the RPC does (or times out)
                    if not ranges:
                        exhausted, waiting = dry, not dry
                        continue
                    waiting = False
                    ranges = [(int(a), int(b)) for a, b in ranges]
                    held.hold(ranges)
                    pending.extend(reads.plan(ranges))
                    if self._ahead(reads):
                        # asked now, read after this lease; a reader whose pace is not
                        # measured yet asks when it needs rows, its share then weighed
                        ask, dry = self._ask(reads), False
                reads.check()
                if not pending:
                    reads.finish()
                    return
                p = pending.popleft()
                try:
                    item = reads.read(p)
                except Interrupted:  # closed: its rows are given back by close()
                    reads.cancel(p)
                    return
                except UnitFailure as f:
                    self._failed(reads, p, pending, f)
                if item is not None and item.rows:
                    yield item
        finally:
            for p in pending:  # closed early, or failed: their rows are given back
                reads.cancel(p)
            reads.close()
            if ask is not None:  # asked ahead, never read: given back
                try:
                    rest = ask.result()
                except Exception:  # noqa: BLE001 - no lease came: nothing to give back
                    rest = None
                if rest:
                    self.spec.services.release(self.spec.dataset_id, self.epoch, rest)

    def _failed(self, reads: UnitReads, p: Pending, pending: deque[Pending],
                f: UnitFailure) -> None:
        """A read failed: its rows go back deferred (counted), every other row held and
        not handed on goes back free; then the error is raised (``InputError`` once the
        epoch failed)."""
        err = f.error()
        bad = normalize(f.rows if f.rows is not None else p.rows)
        rest = normalize([*subtract(normalize(p.rows), bad),
                          *(iv for q in pending for iv in q.rows)])
        while pending:
            reads.cancel(pending.popleft())
        reads.cancel(p)
        self.held.give_back(bad, failure=(f.source, str(err)))
        self.held.give_back(rest)
        s = self.spec
        failed = s.services.progress(s.dataset_id, self.epoch).get("failed")
        if failed:  # that was its last allowed failure: the epoch cannot complete
            raise InputError(failed, f.exc) from f.exc
        raise err from f.exc

    def delivered(self, ranges: list[Interval]) -> None:
        self.rate.add(sum(b - a for a, b in ranges))
        self.held.delivered(ranges)

    def interrupt(self) -> None:
        """End the producer's wait for a read now (its iterator is closing)."""
        reads = self._reads
        if reads is not None:
            reads.interrupt()

    def close(self) -> None:
        """Give back leased rows no caller received."""
        self.held.close()

    def state(self) -> dict:
        return {"epoch": self.epoch, "outstanding": self.held.outstanding()}

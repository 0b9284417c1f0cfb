"""The lease service a loader talks to under ``policy="dynamic"``.

:class:`LeaseService` is the protocol: inside a coordinator the worker plugin provides
it (:class:`~daskdist.plugins.worker.services.SessionServices`: RPCs to the scheduler
plugin, which holds a :class:`~daskdist.core.leases.LeaseTable`);
:class:`LocalLeaseService` implements it in-process on a local table, for tests and
single-process use. Acknowledgements do not go through this protocol: the loader
records a :class:`~daskdist.core.protocol.LeaseToken` per batch with
:func:`daskdist.context.record_consumed`, and whoever ran the closure acks or releases
those rows (the worker/scheduler plugins; :meth:`LocalLeaseService.ack_tokens` here).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from daskdist.core.leases import EpochFailed, LeaseTable
from daskdist.core.protocol import LEASE_TOKEN, CollectionDef, DatasetDef, LeaseToken
from daskdist.errors import InputError

__all__ = ["LEASE_TOKEN", "LeaseService", "LocalLeaseService", "lease_token"]

Interval = tuple[int, int]


def lease_token(dataset_id: str, epoch: int, ranges: list[Interval]) -> LeaseToken:
    """The token a loader records for one batch (a :class:`LeaseToken`)."""
    return LeaseToken.of(dataset_id, epoch, ranges)


@runtime_checkable
class LeaseService(Protocol):
    """What :class:`~daskdist.data.ArrowLoader` needs for the dynamic policy."""

    def define(self, dataset: DatasetDef) -> None:
        """Define the dataset's units once (``ValueError`` if a definition differs)."""
        ...

    def acquire(self, dataset_id: str, epoch: int, rows: int,
                least: int = 1) -> list[Interval] | None:
        """Lease ``rows`` free rows of the epoch, rounded up to whole units, to this
        worker's session (fewer near the epoch's end, not under ``least``): the rows
        as intervals, or ``None`` when none is free right now. ``InputError`` when the
        epoch failed."""
        ...

    def progress(self, dataset_id: str, epoch: int) -> dict:
        """At least ``total``, ``acknowledged``, ``leased``, ``free``, ``complete``."""
        ...

    def release(self, dataset_id: str, epoch: int, ranges: list[Interval],
                failure: tuple[str, str] | None = None) -> int:
        """Give back leased rows no closure received (``failure``: ``(file, message)``
        when they could not be read). Rows freed."""
        ...

    # Optional (used when present): ``acquire_async(dataset_id, epoch, rows, least)``, a
    # ``concurrent.futures.Future`` of what ``acquire`` returns, so the loader asks for
    # its next lease while it reads the current one.
    #
    # For Dask collections (data/collections.py): ``define_collection(CollectionDef)``,
    # ``acquire_partition(dataset_id, epoch)`` (one partition's free rows; the scheduler
    # prefers one this worker holds) and ``report_length(dataset_id, epoch, partition,
    # rows)`` (``InputError`` when a recomputed partition's length differs).


class LocalLeaseService:
    """An in-process :class:`LeaseService` over a :class:`LeaseTable` (thread-safe).

    Several services may share one table with different ``session`` names, which is
    how tests model several workers. ``ack_tokens``/``release_tokens``/``drop_session``
    play the scheduler plugin's part.
    """

    def __init__(self, table: LeaseTable | None = None, session: str = "local",
                 lock: threading.Lock | None = None) -> None:
        self.table = table if table is not None else LeaseTable()
        self.session = session
        self._lock = lock if lock is not None else threading.Lock()

    def for_session(self, session: str) -> LocalLeaseService:
        """Another service on the same table (and lock) for another session."""
        return LocalLeaseService(self.table, session, self._lock)

    def define(self, dataset: DatasetDef) -> None:
        d = DatasetDef._make(dataset)
        with self._lock:
            self.table.define(d.dataset_id, d.runs, d.label)

    def define_collection(self, definition: CollectionDef) -> None:
        d = CollectionDef._make(definition)
        with self._lock:
            self.table.define_collection(d.dataset_id, d.units, d.runs, d.label,
                                         seed=d.seed, shuffle=d.shuffle)

    def acquire_partition(self, dataset_id: str, epoch: int) -> list[Interval] | None:
        """Lease one partition of a collection (its free rows)."""
        return self.acquire(dataset_id, epoch, 1)

    def report_length(self, dataset_id: str, epoch: int, unit: int, length: int) -> None:
        """A computed partition's length; ``InputError`` when it differs from the one
        learned before (the epoch failed)."""
        with self._lock:
            why = self.table.set_length(self.session, dataset_id, epoch, unit, length)
        if why is not None:
            raise InputError(why)

    def acquire(self, dataset_id: str, epoch: int, rows: int,
                least: int = 1) -> list[Interval] | None:
        with self._lock:
            try:
                return self.table.acquire(self.session, dataset_id, epoch, rows,
                                          least=least)
            except EpochFailed as e:
                raise InputError(str(e)) from None

    def progress(self, dataset_id: str, epoch: int) -> dict:
        with self._lock:
            return self.table.progress(dataset_id, epoch)

    def release(self, dataset_id: str, epoch: int, ranges: list[Interval],
                failure: tuple[str, str] | None = None) -> int:
        """Give back leased rows that no closure received (e.g. prefetched batches of a
        closed iterator); only rows leased to this session move. Rows freed."""
        with self._lock:
            return self.table.release(self.session, dataset_id, epoch, ranges, failure)

    def ack_tokens(self, tokens: Iterable[Any]) -> bool:
        """Acknowledge the rows of lease tokens (a completed closure); all or nothing."""
        with self._lock:
            return self.table.ack_tokens(self.session, list(tokens))

    def release_tokens(self, tokens: Iterable[Any]) -> int:
        """Return the rows of lease tokens to the pool (a failed closure); rows freed."""
        with self._lock:
            return self.table.release_tokens(self.session, list(tokens))

    def drop_session(self) -> int:
        """This session's worker is lost: its leased rows go back to the pool."""
        with self._lock:
            return self.table.drop_session(self.session)

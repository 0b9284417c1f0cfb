"""The lease service a loader talks to under ``policy="dynamic"``.

:class:`LeaseService` is the protocol: inside a coordinator the worker plugin provides
it (:class:`~daskdist.plugins.worker.services.SessionServices`: RPCs to the scheduler
plugin, which holds a :class:`~daskdist.core.leases.table.LeaseTable`);
:class:`LocalLeaseService` implements it in-process on a local table, for tests and
single-process use. The same calls serve every kind of source (files, a Dask
collection's partitions). Acknowledgements do not go through this protocol: the loader
records a :class:`~daskdist.core.protocol.LeaseToken` per batch with
:func:`daskdist.session.tokens.record_consumed`, and whoever ran the closure acks or releases
those rows (the worker/scheduler plugins; :meth:`LocalLeaseService.ack_tokens` here).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from daskdist.core.leases import resume
from daskdist.core.leases.table import EpochFailed, LeaseTable
from daskdist.core.protocol import LEASE_TOKEN, DatasetDef, LeaseToken
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

    def acquire(self, dataset_id: str, epoch: int, rows: int, least: int = 1,
                rate: float | None = None) -> list[Interval] | None:
        """Lease ``rows`` free rows of the epoch, rounded up to whole units, to this
        worker's session (fewer near the epoch's end, not under ``least``; a unit this
        worker holds first; ``rate``: the rows a second the loader consumes, which
        weighs its share against other readers'): the rows as intervals, or ``None``
        when none is free right now. ``InputError`` when the epoch failed."""
        ...

    def acquire_async(self, dataset_id: str, epoch: int, rows: int, least: int = 1,
                      rate: float | None = None) -> concurrent.futures.Future:
        """:meth:`acquire` without waiting (asked while the previous lease is read)."""
        ...

    def progress(self, dataset_id: str, epoch: int) -> dict:
        """At least ``total``, ``acknowledged``, ``leased``, ``free``, ``complete``."""
        ...

    def release(self, dataset_id: str, epoch: int, ranges: list[Interval],
                failure: tuple[str, str] | None = None) -> int:
        """Give back leased rows no closure received (``failure``: ``(source, message)``
        when they could not be read). Rows freed."""
        ...

    def report_length_async(self, dataset_id: str, epoch: int, unit: int,
                            length: int) -> concurrent.futures.Future:
        """A read unit's length (a computed partition's), without waiting: the future
        raises ``InputError`` when it differs from the one learned before."""
        ...


class _Later:
    """A call made when its result is first asked for: an in-process service asks
    nothing ahead (there is no round trip to overlap)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._call: Any = (fn, args)
        self._out: Any = None
        self._err: BaseException | None = None

    def done(self) -> bool:
        return self._call is None

    def result(self, timeout: float | None = None) -> Any:
        if self._call is not None:
            fn, args = self._call
            self._call = None
            try:
                self._out = fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised to every result() caller
                self._err = e
        if self._err is not None:
            raise self._err
        return self._out


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
            if d.runs is None and d.units is None:
                self.table.register(d.dataset_id, d.label, seed=d.seed)
            else:
                self.table.define(d.dataset_id, d.runs, d.label, seed=d.seed, units=d.units,
                                  shuffle=d.shuffle, whole=d.whole)

    def acquire(self, dataset_id: str, epoch: int, rows: int, least: int = 1,
                rate: float | None = None) -> list[Interval] | None:
        with self._lock:
            try:
                return self.table.acquire(self.session, dataset_id, epoch, rows,
                                          least=least, rate=rate)
            except EpochFailed as e:
                raise InputError(str(e)) from None

    def acquire_async(self, dataset_id: str, epoch: int, rows: int, least: int = 1,
                      rate: float | None = None) -> Any:
        """:meth:`acquire`, made when its result is asked for."""
        return _Later(self.acquire, dataset_id, epoch, rows, least, rate)

    def report_length(self, dataset_id: str, epoch: int, unit: int, length: int) -> None:
        """A computed unit's length; ``InputError`` when it differs from the one learned
        before (the epoch failed)."""
        with self._lock:
            why = resume.set_length(self.table, self.session, dataset_id, epoch, unit, length)
        if why is not None:
            raise InputError(why)

    def report_length_async(self, dataset_id: str, epoch: int, unit: int,
                            length: int) -> Any:
        """:meth:`report_length`, made now (its error kept for ``result()``)."""
        out = _Later(self.report_length, dataset_id, epoch, unit, length)
        with contextlib.suppress(InputError):
            out.result()
        return out

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

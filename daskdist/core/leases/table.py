"""Lease/ack bookkeeping for the ``"dynamic"`` sharding policy: a pure state machine.

The scheduler plugin holds one :class:`LeaseTable` per coordinator. Rows have global
ids (their position in the stable order of units, :mod:`daskdist.core.leases.units`).

- **A dataset is defined once** (:meth:`LeaseTable.define`): its units (row counts
  run-length encoded, or partitions of unknown length), label, owner, seed and how its
  units are leased. Every later message names only the dataset, an epoch and row
  intervals; nothing ever carries or rebuilds a per-unit list.
- **Per epoch** (:mod:`daskdist.core.leases.epochs`) every row is free, deferred, leased to one
  worker session, or acknowledged; a transition costs O(log fragments) per interval.

Transitions:

- :meth:`LeaseTable.acquire`: a session leases consecutive free rows, at least the rows
  it asks for rounded up to the end of a unit, at most a share of what is left, with
  the tail rule near the end (:mod:`daskdist.core.leases.tail`); :meth:`acquire_unit` leases
  one given unit (a partition the session's worker holds);
- :meth:`LeaseTable.ack_tables` (and :meth:`ack`, :meth:`ack_tokens`,
  :meth:`ack_sessions` through it): completed work acknowledges rows leased to its
  session; all or nothing, refused when the session expired or any row is not leased
  to it: fencing, so a late or duplicate message never counts a row twice;
- :meth:`LeaseTable.transfer_tokens`: rows leased to one session move to another's lease
  (an asynchronous model's push hands its rows to the model until the delta is durable);
- :meth:`LeaseTable.release`: rows go back (a failed closure, a closed loader); a failed
  read defers them and counts a failure of its source; the ``max_failures``-th fails
  the epoch (:class:`EpochFailed`), rather than retrying forever;
- :meth:`LeaseTable.drop_session`: a lost worker; its rows go back, the session is
  expired for good;
- learned lengths and resuming: :mod:`daskdist.core.leases.resume`, on this table.

Invariant (checked by the tests' ``check_leases``): per epoch, acknowledged ∪ leased ∪
free ∪ deferred is every id that may exist, pairwise disjoint. Imports nothing from
Dask, torch, pyarrow, numpy or the rest of the package.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from daskdist.core.intervals import Interval, RowSet, normalize
from daskdist.core.leases.datasets import DatasetIndex, UnknownDataset
from daskdist.core.leases.epochs import Dataset, Epoch
from daskdist.core.leases.tail import TailRule
from daskdist.core.leases.units import unit_runs
from daskdist.core.protocol import LeaseToken

__all__ = [
    "EpochFailed",
    "LeaseTable",
    "SessionExpired",
    "UnknownDataset",
    "group_tokens",
    "merge_tokens",
    "unit_runs",
]


class SessionExpired(RuntimeError):
    """A session that was dropped (its worker was lost) asked for a new lease."""


class EpochFailed(RuntimeError):
    """The epoch cannot complete: reads of one source failed for good."""


def group_tokens(tokens: Iterable[object]) -> dict[tuple[str, int], list[Interval]]:
    """Lease tokens (:class:`~daskdist.core.protocol.LeaseToken`) grouped by epoch table.

    Tokens of other kinds are ignored; a lease token of the wrong shape raises
    ``ValueError`` (it must not be skipped while the acknowledgement reports success).
    """
    groups: dict[tuple[str, int], list[Interval]] = {}
    for tok in tokens:
        lease = LeaseToken.parse(tok)
        if lease is not None:
            groups.setdefault((lease.dataset_id, lease.epoch), []).extend(lease.ranges)
    return groups


def merge_tokens(tokens: list) -> list:
    """One closure's tokens with its lease tokens merged, one per epoch table (fewer,
    shorter intervals to send and check); tokens of other kinds kept. A malformed lease
    token leaves the list as it is (the scheduler refuses it)."""
    try:
        groups = group_tokens(tokens)
    except ValueError:
        return tokens
    if sum(LeaseToken.parse(t) is not None for t in tokens) <= len(groups):
        return tokens  # nothing to merge
    others = [t for t in tokens if LeaseToken.parse(t) is None]
    return others + [LeaseToken.of(ds, epoch, normalize(ranges))
                     for (ds, epoch), ranges in groups.items()]


class LeaseTable(DatasetIndex):
    """Datasets, and per epoch their free / deferred / leased / acknowledged rows.

    Sessions are opaque strings (the worker plugin's session id). Not thread-safe: the
    scheduler plugin calls it from its event loop only.

    Memory stays bounded: an epoch whose every row is acknowledged drops its table and
    is remembered as one interval of completed epochs in its dataset; a dataset goes
    with :meth:`forget` (its handle was dropped) or :meth:`drop_owner` (its coordinator
    closed); the ids of the last ``max_expired`` dropped sessions are kept for fencing
    (the scheduler fences older ones by membership: sessions are never reused). At most
    ``max_epochs`` unfinished epochs per dataset.
    """

    def __init__(self, max_expired: int = 4096,
                 on_ack: Callable[[str, list[tuple[str, int]]], None] | None = None,
                 max_failures: int = 3, max_epochs: int = 1024,
                 on_open: Callable[[str], None] | None = None) -> None:
        # told (dataset_id, [(session, rows), ...]) of every acknowledgement, whichever
        # path made it (a closure's result, a gang commit: one call a table), for the
        # dashboard's and the metrics' counters
        self._on_ack = on_ack
        # told a dataset id when any session may find its rows again (rows went back to
        # the pool, or an epoch completed): closures set aside at its tail may run anywhere
        self._on_open = on_open
        self.max_failures = max(1, int(max_failures))
        self.max_epochs = max_epochs
        self._expired: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self._max_expired = max_expired
        # session -> keys of the epochs where it holds rows now (for drop_session)
        self._session_keys: dict[str, set[tuple[str, int]]] = {}
        # session -> the datasets whose readers' rates have its (for drop_session)
        self._rated: dict[str, set[str]] = {}
        super().__init__()

    def _forgotten(self, dataset_id: str, ds: Dataset) -> None:
        for epoch, ep in ds.epochs.items():
            for session in ep.leased:
                self._unkey(session, (dataset_id, epoch))
        for session in ds.rates.of:
            rated = self._rated.get(session)
            if rated is not None:
                rated.discard(dataset_id)
                if not rated:
                    del self._rated[session]

    # -- leases ------------------------------------------------------------------------
    def acquire(self, session: str, dataset_id: str, epoch: int, rows: int = 1,
                parts: int | None = None, least: int = 1,
                tail: bool = False, rate: float | None = None) -> list[Interval] | None:
        """Lease free rows to ``session``: the lowest free rows (a shuffled dataset's:
        whole units in its seeded order), at least ``rows`` of them rounded up to the
        end of a unit, but no more than ``free / (2 * parts)`` (``parts``: the readers
        sharing the epoch, by default the sessions holding rows of it) unless that is
        less than ``least`` (a lease worth its round trip). Rows given back by failed
        reads are served only once no other row is free. ``tail``: the tail rule
        (:class:`~daskdist.core.leases.tail.TailRule`). ``rate``: the rows a second
        ``session``'s loader consumes, as it measured them: the share and the tail rule
        weigh readers by it (equal shares until a reader said).

        Returns the leased rows as intervals, or ``None`` when none is free right now.
        Raises :class:`SessionExpired` for a dropped session, :class:`UnknownDataset`
        and :class:`EpochFailed`.
        """
        found = self._open(session, dataset_id, epoch)
        if found is None:
            return None
        ds, ep = found
        n_free = ep.n_free
        if not n_free:
            return None
        if parts is None:
            parts = len(ep.leased) + (session not in ep.leased)
        if rate is not None and rate > 0:
            ds.rates.set(session, float(rate))
            self._rated.setdefault(session, set()).add(dataset_id)
        weight = ds.rates.weight(session, parts)
        share = (-(-n_free // (2 * max(1, parts))) if weight is None
                 else max(1, math.ceil(n_free * weight / 2)))
        need = min(max(1, int(rows)), max(1, int(least), share))
        units = ds.defined
        if tail and TailRule.holds_back(units, ds.whole, ep.leased.get(session),
                                        ep.n_leased, parts, need, n_free, weight,
                                        ep.ahead.get(session)):
            return None
        cap = TailRule.cap(ds.whole, need, share) if tail else None
        pool = ep.free if ep.free else ep.deferred
        if ds.shuffle and pool is ep.free:
            picked = ds.permuted(ep, int(epoch), need, cap)
            if picked:
                return self._lease(session, dataset_id, int(epoch), ds, ep, picked)
        out: list[Interval] = []
        while need > 0 and pool:
            a, b = pool.starts[0], pool.stops[0]
            if b - a <= need:
                c = b
            else:
                c = min(b, units.stop_of(a + need - 1))
                if cap is not None and c - a > cap:
                    c = a + need
            pool.remove(a, c)
            out.append((a, c))
            need -= c - a
        return self._lease(session, dataset_id, int(epoch), ds, ep, out)

    def holds_share(self, session: str, dataset_id: str, epoch: int, parts: int) -> bool:
        """Whether :meth:`acquire` with ``tail`` would hold ``session`` back now (a lease
        of one row asked): asked before a lease by locality, so the tail rule comes
        first. Read-only; ``False`` for an epoch not started."""
        ds = self.datasets.get(dataset_id)
        ep = ds.epochs.get(int(epoch)) if ds is not None else None
        if ep is None or ds is None:
            return False
        parts = max(1, int(parts))
        return TailRule.holds_back(ds.defined, ds.whole, ep.leased.get(session),
                                   ep.n_leased, parts, 1, ep.n_free,
                                   ds.rates.weight(session, parts), ep.ahead.get(session))

    def acquire_unit(self, session: str, dataset_id: str, epoch: int,
                     unit: int) -> list[Interval] | None:
        """Lease the free rows of one unit to ``session`` (a partition its worker holds:
        no transfer), or ``None`` if none of them is free. Raises as :meth:`acquire`."""
        found = self._open(session, dataset_id, epoch)
        if found is None:
            return None
        ds, ep = found
        a, b = ds.defined.bounds(int(unit))
        out = ep.free.intersect(a, b)
        for lo, hi in out:
            ep.free.remove(lo, hi)
        return self._lease(session, dataset_id, int(epoch), ds, ep, out) or None

    def _open(self, session: str, dataset_id: str,
              epoch: int) -> tuple[Dataset, Epoch] | None:
        """The epoch's table for a lease, made if new (``None``: complete)."""
        if session in self._expired:
            raise SessionExpired(f"session {session!r} expired; its worker was lost")
        ds = self.dataset(dataset_id)
        epoch = int(epoch)
        if ds.is_complete(epoch):
            return None
        ep = ds.epochs.get(epoch)
        if ep is None:
            ep = ds.new_epoch(epoch, (), self.label_of(dataset_id), self.max_epochs)
        if ep.failed is not None:
            raise EpochFailed(ep.failed)
        return ds, ep

    def _lease(self, session: str, dataset_id: str, epoch: int, ds: Dataset, ep: Epoch,
               out: list[Interval]) -> list[Interval]:
        """Rows taken from a pool become ``session``'s (and, of whole units, ahead of
        its loader until it reports them read: :func:`~.resume.set_length`)."""
        if not out:
            return out
        held = ep.leased.get(session)
        if held is None:
            held = ep.leased[session] = RowSet()
            self._session_keys.setdefault(session, set()).add((dataset_id, epoch))
        ahead = ep.ahead.setdefault(session, RowSet()) if ds.whole else None
        for a, c in out:
            held.add(a, c)
            ep.n_leased += c - a
            if ahead is not None:
                ahead.add(a, c)
        ep.phantom_leased += ds.defined.phantoms(out)
        return out

    # -- acknowledgements ----------------------------------------------------------------
    def ack(self, session: str, dataset_id: str, epoch: int,
            ranges: Iterable[Sequence[int]]) -> bool:
        """Acknowledge rows consumed by a completed closure of ``session`` (all or
        nothing, as :meth:`ack_tables`)."""
        return self.ack_tables({(dataset_id, int(epoch)): [(session, normalize(ranges))]})

    def ack_tokens(self, session: str, tokens: Iterable[object]) -> bool:
        """Acknowledge every lease token of one completed closure, atomically."""
        return self.ack_sessions({session: tokens})

    def ack_sessions(self, per_session: Mapping[str, Iterable[object]]) -> bool:
        """Acknowledge the lease tokens of several sessions at once (a gang commit), or
        of one (a closure); other tokens are ignored; all or nothing."""
        tables: dict[tuple[str, int], list] = {}
        for session, tokens in per_session.items():
            try:
                groups = group_tokens(tokens)
            except ValueError:
                return False  # refused: nothing acknowledged
            for key, ranges in groups.items():
                tables.setdefault(key, []).append((session, ranges))
        return self.ack_tables(tables)

    def ack_tables(self, tables: Mapping[tuple[str, int],
                                         Sequence[tuple[str, Sequence[Sequence[int]]]]]) -> bool:
        """Acknowledge, per epoch table ``(dataset_id, epoch)``, the rows of each
        ``(session, rows)`` in its list (a session at most once a table): all or
        nothing: if any is refused (an unknown table, an expired session, a row not
        leased to its session) nothing changes and ``False`` is returned. Checked, then
        applied, table by table, so a gang commit's thousand parts of one table look it
        up once. O(parts)."""
        checked = []  # (key, dataset, epoch table, [(session, held, rows)])
        expired = self._expired
        for key, parts in tables.items():
            ds = self.datasets.get(key[0])
            ep = ds.epochs.get(int(key[1])) if ds is not None else None
            if ep is None:
                return False
            holds = []
            for session, ranges in parts:
                held = ep.leased.get(session)
                if held is None or session in expired:
                    return False
                if len(ranges) != 1 or ranges[0][0] >= ranges[0][1]:  # one batch: usual
                    ranges = normalize(ranges)
                for a, b in ranges:
                    if not held.covers(a, b):
                        return False
                holds.append((session, held, ranges))
            checked.append((key, ds, ep, holds))
        for key, ds, ep, holds in checked:
            acked, leased, total, counts = ep.acked, ep.leased, 0, []
            for session, held, ranges in holds:
                rows = 0
                for a, b in ranges:
                    held.remove(a, b)
                    acked.add(a, b)
                    rows += b - a
                    if ep.ahead:
                        ep.not_ahead(session, a, b)
                if not held.size:
                    del leased[session]
                    self._unkey(session, key)
                if rows:
                    counts.append((session, rows))
                    total += rows
            ep.n_leased -= total
            if self._on_ack is not None and counts:
                self._on_ack(key[0], counts)
            if acked.size == ep.total:
                self.complete(key[0], ds, key[1])
        return True

    # -- handing rows over -------------------------------------------------------------------
    def transfer_tokens(self, source: str, target: str, tokens: Iterable[object]) -> bool:
        """Move the rows of lease tokens leased to ``source`` to ``target``'s lease, all
        or nothing: refused (``False``, nothing moves) when either session expired, a
        token is malformed, or a row is not leased to ``source``. The rows stay leased
        (counts unchanged); ``target`` then acknowledges or releases them, and a loss of
        ``source`` no longer touches them (an asynchronous model's push: its rows wait
        with the delta until the delta is durable)."""
        expired = self._expired
        if source in expired or target in expired:
            return False
        try:
            groups = group_tokens(tokens)
        except ValueError:
            return False
        checked = []
        for key, ranges in groups.items():
            ds = self.datasets.get(key[0])
            ep = ds.epochs.get(int(key[1])) if ds is not None else None
            held = ep.leased.get(source) if ep is not None else None
            if ep is None or held is None:
                return False
            ranges = normalize(ranges)
            if not all(held.covers(a, b) for a, b in ranges):
                return False
            checked.append(((key[0], int(key[1])), ep, held, ranges))
        for key, ep, held, ranges in checked:
            into = ep.leased.get(target)
            if into is None:
                into = ep.leased[target] = RowSet()
                self._session_keys.setdefault(target, set()).add(key)
            for a, b in ranges:
                held.remove(a, b)
                into.add(a, b)
                if ep.ahead:  # rows a closure took: read
                    ep.not_ahead(source, a, b)
            if not held.size:
                del ep.leased[source]
                self._unkey(source, key)
        return True

    # -- give-backs ------------------------------------------------------------------------
    def release_tokens(self, session: str, tokens: Iterable[object]) -> int:
        """Release the rows of every lease token of one failed closure; rows freed (0
        for a malformed token: nothing can be said of its rows)."""
        try:
            groups = group_tokens(tokens)
        except ValueError:
            return 0
        return sum(self.release(session, dataset_id, epoch, ranges)
                   for (dataset_id, epoch), ranges in groups.items())

    def release(self, session: str, dataset_id: str, epoch: int,
                ranges: Iterable[Sequence[int]],
                failure: tuple[str, str] | None = None) -> int:
        """Give rows back to the pool; only rows leased to ``session`` move. Returns
        how many moved.

        ``failure`` is ``(source, message)`` when the rows could not be read (a file, a
        partition): they are deferred (served once no other row is free) and the
        source's failure is counted; at the ``max_failures``-th the epoch fails with
        ``message``, rather than retrying forever.
        """
        if session in self._expired:
            return 0
        ds = self.datasets.get(dataset_id)
        epoch = int(epoch)
        ep = ds.epochs.get(epoch) if ds is not None else None
        held = ep.leased.get(session) if ep is not None else None
        if held is None or ds is None or ep is None:
            return 0
        pool = ep.deferred if failure is not None else ep.free
        units = ds.defined
        moved = 0
        for a, b in normalize(ranges):
            for lo, hi in held.intersect(a, b):
                held.remove(lo, hi)
                if ep.ahead:
                    ep.not_ahead(session, lo, hi)
                if ep.phantom_leased:
                    ep.phantom_leased -= units.phantoms([(lo, hi)])
                for x, y in ds.returned(ep, lo, hi):
                    pool.add(x, y)
                moved += hi - lo
        ep.n_leased -= moved
        if not held:
            del ep.leased[session]
            self._unkey(session, (dataset_id, epoch))
        if units.absent and ep.acked.size == ep.total:  # only absent ids came back
            self.complete(dataset_id, ds, epoch)
            return moved
        if moved:
            self._opened(dataset_id)
        if failure is not None and moved:
            source, message = failure
            n = ep.failures[source] = ep.failures.get(source, 0) + 1
            if n >= self.max_failures and ep.failed is None:
                ep.failed = (f"{message} (reads of {source} failed {n} times, "
                             f"max_worker_failures={self.max_failures}: dataset "
                             f"{self.label_of(dataset_id)} epoch {epoch} cannot complete)")
        return moved

    def drop_session(self, session: str) -> int:
        """A lost worker: every row leased to ``session`` goes back to free, and later
        acks, releases and acquires from it are refused. Returns rows freed."""
        self._expired[session] = None
        while len(self._expired) > self._max_expired:
            del self._expired[next(iter(self._expired))]
        for dataset_id in self._rated.pop(session, ()):
            ds = self.datasets.get(dataset_id)
            if ds is not None:
                ds.rates.forget(session)
        moved = 0
        for dataset_id, epoch in self._session_keys.pop(session, set()):
            ds = self.datasets.get(dataset_id)
            ep = ds.epochs.get(epoch) if ds is not None else None
            held = ep.leased.pop(session, None) if ep is not None else None
            if held is None or ds is None or ep is None:
                continue
            ep.ahead.pop(session, None)
            units = ds.defined
            if ep.phantom_leased:
                ep.phantom_leased -= units.phantoms(held)
            for a, b in held:
                for x, y in ds.returned(ep, a, b):
                    ep.free.add(x, y)
            ep.n_leased -= held.size
            moved += held.size
            if units.absent and ep.acked.size == ep.total:
                self.complete(dataset_id, ds, epoch)
            elif held.size:
                self._opened(dataset_id)
        return moved

    # -- the table's own bookkeeping (also used by core/leases/resume.py) -----------------------
    def complete(self, dataset_id: str, ds: Dataset, epoch: int) -> None:
        """Every row of the epoch is acknowledged: keep only that fact."""
        ep = ds.complete(epoch)
        for session in ep.leased:
            self._unkey(session, (dataset_id, epoch))
        self._opened(dataset_id)

    def _opened(self, dataset_id: str) -> None:
        if self._on_open is not None:
            self._on_open(dataset_id)

    def unlease(self, session: str, dataset_id: str, epoch: int) -> None:
        """``session``'s lease of the epoch is empty: forget it."""
        ep = self.datasets[dataset_id].epochs[epoch]
        del ep.leased[session]
        ep.ahead.pop(session, None)
        self._unkey(session, (dataset_id, epoch))

    def _unkey(self, session: str, key: tuple[str, int]) -> None:
        keys = self._session_keys.get(session)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._session_keys[session]

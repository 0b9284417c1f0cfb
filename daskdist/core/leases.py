"""Lease/ack bookkeeping for the ``"dynamic"`` sharding policy: a pure state machine.

The scheduler plugin holds one :class:`LeaseTable` per coordinator. Rows have global
ids ``0 .. total`` (their position in the stable order of units).

- **A dataset is defined once** (:meth:`LeaseTable.define`): its units' row counts,
  run-length encoded (a few runs per file, at most 16 bytes per unit), with a label
  and the owner it goes away with. Every later message names only the dataset, an
  epoch and row intervals; nothing ever carries or rebuilds a per-unit list.
- **Per epoch**, every row is *free*, *deferred* (given back by a failed read: served
  after every other free row), *leased* to one worker session, or *acknowledged*
  (consumed by a closure that completed). Each set is a
  :class:`~daskdist.core.intervals.RowSet`, so memory grows with fragmentation, never
  with rows or units, and a transition costs O(log fragments) per interval it moves.

Transitions:

- :meth:`LeaseTable.acquire`: a session leases consecutive free rows, at least the rows
  it asks for (rounded up to the end of a unit, so a unit is read by one worker), at
  most a share of what is left (``free / (2 * parts)``: the end of an epoch is spread
  over every reader); near the end, where a unit is more than twice that share, a lease
  ends inside the unit, and a reader already holding its share of the rows not yet
  acknowledged gets none (the tail rule: leases shrink toward the two batches a loader
  asks for at least, and the rows go to the readers holding less, so no reader idles
  while another holds a whole unit);
- :meth:`LeaseTable.ack`: a completed closure acknowledges rows leased to its session;
  refused (``False``, nothing changed) when the session expired or any row is not
  leased to it: fencing, so a late or duplicate message never counts a row twice;
- :meth:`LeaseTable.release`: rows go back (a failed closure, a closed loader); a
  failed read defers them and counts a failure of its file; the ``max_failures``-th
  fails the epoch (:class:`EpochFailed`), rather than retrying forever;
- :meth:`LeaseTable.drop_session`: a lost worker; its leased rows go back to free and
  the session is expired for good;
- :meth:`LeaseTable.start_epoch` / :meth:`LeaseTable.acknowledged`: an epoch started
  with rows already acknowledged, and the export of those rows (resuming).

Invariant (checked by the tests' ``check_leases``): per epoch, acknowledged ∪ leased ∪ free ∪
deferred is every row, pairwise disjoint. Imports nothing from Dask, torch, pyarrow,
numpy or the rest of the package.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from daskdist.core.intervals import Interval, RowSet, intersect, normalize, size_of, subtract, union
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


class UnknownDataset(LookupError):
    """A lease for a dataset this table has no units for (never defined, or forgotten
    when its handle was dropped or its coordinator closed)."""


class EpochFailed(RuntimeError):
    """The epoch cannot complete: reads of one file failed ``max_failures`` times."""


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


class _Units:
    """A dataset's units from their runs: where each run starts (rows) and its units'
    size, 16 bytes per run. Finds the end of the unit holding a row by bisection."""

    __slots__ = ("runs", "size", "start", "total", "units")

    def __init__(self, runs: Sequence[Sequence[int]]) -> None:
        self.runs = [(int(r), int(n)) for r, n in runs]
        self.start = array("q", [0])
        self.size = array("q")
        pos = units = 0
        for rows, count in self.runs:
            if rows < 0 or count < 1:
                raise ValueError(f"a run of units must have rows >= 0 and units >= 1, "
                                 f"got {(rows, count)}")
            if rows:  # units of no rows hold no ids: nothing to find
                self.size.append(rows)
                pos += rows * count
                self.start.append(pos)
            units += count
        self.total = pos
        self.units = units

    def stop_of(self, row: int) -> int:
        """The end of the unit holding ``row`` (``0 <= row < total``)."""
        i = bisect_right(self.start, row) - 1
        size = self.size[i]
        first = self.start[i]
        return first + ((row - first) // size + 1) * size

    def nbytes(self) -> int:
        return self.start.itemsize * (len(self.start) + len(self.size))


@dataclass
class _Epoch:
    total: int
    free: RowSet
    acked: RowSet
    deferred: RowSet = field(default_factory=RowSet)  # given back by failed reads
    leased: dict[str, RowSet] = field(default_factory=dict)
    n_leased: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # file -> failed reads
    failed: str | None = None  # why the epoch cannot complete


@dataclass
class _Dataset:
    label: str
    owner: str
    seed: int = 0
    units: _Units | None = None  # None: registered, its units not defined yet
    epochs: dict[int, _Epoch] = field(default_factory=dict)
    completed: list[Interval] = field(default_factory=list)  # intervals of epochs

    def is_complete(self, epoch: int) -> bool:
        if self.units is not None and self.units.total == 0:
            return True
        i = bisect_right(self.completed, (epoch, float("inf"))) - 1
        return i >= 0 and self.completed[i][0] <= epoch < self.completed[i][1]


class LeaseTable:
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
                 on_ack: Callable[[str, str, int], None] | None = None,
                 max_failures: int = 3, max_epochs: int = 1024) -> None:
        # told (session, dataset_id, rows) of every acknowledgement, whichever path made
        # it (a closure's result, a gang commit): counters for the dashboard and metrics
        self._on_ack = on_ack
        self.max_failures = max(1, int(max_failures))
        self.max_epochs = max_epochs
        self.datasets: dict[str, _Dataset] = {}
        self._expired: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self._max_expired = max_expired
        # session -> keys of the epochs where it holds rows now (for drop_session)
        self._session_keys: dict[str, set[tuple[str, int]]] = {}

    # -- datasets --------------------------------------------------------------------
    def register(self, dataset_id: str, label: str = "", owner: str = "",
                 seed: int = 0) -> None:
        """Know ``dataset_id`` (its label, owner, seed) before its units are defined."""
        ds = self.datasets.get(dataset_id)
        if ds is None:
            self.datasets[dataset_id] = _Dataset(label, owner, seed)
        elif label and not ds.label:
            ds.label = label

    def define(self, dataset_id: str, runs: Sequence[Sequence[int]], label: str = "",
               owner: str = "", seed: int = 0) -> None:
        """Define the dataset's units (``runs``: see :func:`unit_runs`) once; a later
        definition must agree (``ValueError`` naming the dataset if not). A dataset
        ``"<id>.<k>"`` (a second loader built for one per-worker dataset) takes the
        label and owner of ``"<id>"``."""
        ds = self.datasets.get(dataset_id)
        if ds is None:
            parent = self.datasets.get(dataset_id.partition(".")[0])
            if parent is not None and not owner:
                owner = parent.owner
                label = label or parent.label
            ds = self.datasets[dataset_id] = _Dataset(label, owner, seed)
        elif label and not ds.label:
            ds.label = label
        ds.seed = seed
        units = _Units(runs)
        if ds.units is None:
            ds.units = units
            return
        if units.runs != ds.units.runs:
            raise ValueError(
                f"dataset {self._name(dataset_id)}: its units differ from its definition "
                f"({units.units} units / {units.total} rows given, {ds.units.units} units "
                f"/ {ds.units.total} rows defined); build one loader per dataset call")

    def _name(self, dataset_id: str) -> str:
        ds = self.datasets.get(dataset_id)
        label = ds.label if ds is not None else ""
        return f"{label!r} ({dataset_id})" if label else repr(dataset_id)

    def _dataset(self, dataset_id: str) -> _Dataset:
        ds = self.datasets.get(dataset_id)
        if ds is None or ds.units is None:
            raise UnknownDataset(
                f"dataset {dataset_id!r} is not defined here (never defined, or forgotten "
                "when its handle was dropped or its coordinator closed)")
        return ds

    def forget(self, dataset_id: str) -> bool:
        """Drop a dataset (and the datasets ``"<id>.<k>"`` of its other loaders): its
        epoch tables and completed epochs. Whether anything was dropped."""
        gone = [d for d in self.datasets
                if d == dataset_id or d.startswith(dataset_id + ".")]
        for d in gone:
            ds = self.datasets.pop(d)
            for epoch, ep in ds.epochs.items():
                for session in ep.leased:
                    self._unkey(session, (d, epoch))
        return bool(gone)

    def drop_owner(self, owner: str) -> list[str]:
        """Forget every dataset of ``owner`` (its coordinator closed); their ids."""
        gone = [d for d, ds in self.datasets.items() if ds.owner == owner and owner]
        for d in gone:
            self.forget(d)
        return gone

    def is_complete(self, dataset_id: str, epoch: int) -> bool:
        """Every row of the epoch was acknowledged (its table may be dropped already)."""
        ds = self.datasets.get(dataset_id)
        return ds is not None and ds.is_complete(int(epoch))

    def _complete(self, dataset_id: str, ds: _Dataset, epoch: int, ep: _Epoch) -> None:
        """Every row of the epoch is acknowledged: keep only that fact."""
        del ds.epochs[epoch]
        for session in ep.leased:
            self._unkey(session, (dataset_id, epoch))
        ds.completed = union(ds.completed, [(epoch, epoch + 1)])

    def _new_epoch(self, dataset_id: str, ds: _Dataset, epoch: int,
                   acknowledged: Iterable[Sequence[int]] = ()) -> _Epoch:
        if len(ds.epochs) >= self.max_epochs:
            raise ValueError(f"dataset {self._name(dataset_id)} has {len(ds.epochs)} "
                             f"unfinished epochs; at most {self.max_epochs}")
        total = ds.units.total  # type: ignore[union-attr]
        acked = normalize(acknowledged)
        if acked and (acked[0][0] < 0 or acked[-1][1] > total):
            raise ValueError(f"acknowledged rows {acked[0]}..{acked[-1]} are outside "
                             f"dataset {self._name(dataset_id)}'s [0, {total})")
        ep = _Epoch(total, RowSet(subtract([(0, total)], acked)), RowSet(acked))
        ds.epochs[epoch] = ep
        return ep

    def start_epoch(self, dataset_id: str, epoch: int,
                    acknowledged: Iterable[Sequence[int]]) -> None:
        """Start ``epoch`` with ``acknowledged`` rows already acknowledged (resuming from
        an exported ledger); ``ValueError`` if the epoch has started already. Costs
        O(intervals), whatever the rows."""
        ds = self._dataset(dataset_id)
        epoch = int(epoch)
        if ds.units.total == 0 and not normalize(acknowledged):  # type: ignore[union-attr]
            return  # an empty dataset: every epoch is complete
        ep = ds.epochs.get(epoch)
        if ds.is_complete(epoch) or (ep is not None and (ep.acked or ep.n_leased)):
            raise ValueError(f"dataset {self._name(dataset_id)} epoch {epoch} has started "
                             "already; load a ledger before the epoch's first lease")
        if ep is not None:
            del ds.epochs[epoch]
        ep = self._new_epoch(dataset_id, ds, epoch, acknowledged)
        if ep.acked.size == ep.total:
            self._complete(dataset_id, ds, epoch, ep)

    def restore_epoch(self, dataset_id: str, epoch: int,
                      acknowledged: Iterable[Sequence[int]]) -> int:
        """Make ``acknowledged`` the epoch's acknowledged rows, whatever was acknowledged
        before (an elastic State resumed from a checkpoint: rows acknowledged by commits
        after it were trained by a model that is lost, so they are free again). Leased
        and deferred rows stay as they are; ``ValueError`` if a leased row is among
        ``acknowledged`` (it could be delivered again). Rows now free that were
        acknowledged before."""
        ds = self._dataset(dataset_id)
        epoch = int(epoch)
        total = ds.units.total  # type: ignore[union-attr]
        acked = normalize(acknowledged)
        if acked and (acked[0][0] < 0 or acked[-1][1] > total):
            raise ValueError(f"acknowledged rows {acked[0]}..{acked[-1]} are outside "
                             f"dataset {self._name(dataset_id)}'s [0, {total})")
        if ds.is_complete(epoch):  # its table was dropped: every row was acknowledged
            ds.completed = subtract(ds.completed, [(epoch, epoch + 1)])
            before = [(0, total)] if total else []
            ep = self._new_epoch(dataset_id, ds, epoch, before)
        else:
            ep = ds.epochs.get(epoch) or self._new_epoch(dataset_id, ds, epoch)
        held = [iv for rs in (*ep.leased.values(), ep.deferred) for iv in rs]
        clash = intersect(acked, normalize(held))
        if clash:
            raise ValueError(f"dataset {self._name(dataset_id)} epoch {epoch}: rows "
                             f"{clash[0]}.. are leased now and acknowledged by the ledger "
                             "being restored; restore it before the epoch's first lease")
        freed = subtract(ep.acked.items(), acked)
        ep.acked = RowSet(acked)
        ep.free = RowSet(subtract(subtract([(0, total)], acked), normalize(held)))
        if ep.acked.size == ep.total:
            self._complete(dataset_id, ds, epoch, ep)
        return size_of(freed)

    def acknowledged(self, dataset_id: str, epoch: int) -> list[Interval]:
        """The epoch's acknowledged rows as intervals (what :meth:`start_epoch` takes)."""
        ds = self._dataset(dataset_id)
        epoch = int(epoch)
        if ds.is_complete(epoch):
            total = ds.units.total  # type: ignore[union-attr]
            return [(0, total)] if total else []
        ep = ds.epochs.get(epoch)
        return [] if ep is None else ep.acked.items()

    # -- transitions ------------------------------------------------------------------
    def acquire(self, session: str, dataset_id: str, epoch: int, rows: int = 1,
                parts: int | None = None, least: int = 1,
                tail: bool = False) -> list[Interval] | None:
        """Lease free rows to ``session``: the lowest free rows, at least ``rows`` of
        them rounded up to the end of a unit, but no more than ``free / (2 * parts)``
        (``parts``: the readers sharing the epoch, by default the sessions holding rows
        of it) unless that is less than ``least`` (a lease worth its round trip).
        Rows given back by failed reads are served only once no other row is free.
        With ``tail`` (the scheduler's leases), the tail rule: where rounding up to a
        unit's end would more than double the lease past that share, it ends inside the
        unit, so near the epoch's end leases shrink toward ``least``; and a reader that
        already holds its share of the rows not yet acknowledged (``(free + leased) /
        parts``, leases it asked ahead) gets none while it holds a lease's worth or the
        pool is low: the rows go to the readers holding less, so readers that consume
        alike run out alike, at the epoch's end.

        Returns the leased rows as intervals, or ``None`` when none is free right now.
        Raises :class:`SessionExpired` for a dropped session, :class:`UnknownDataset`
        and :class:`EpochFailed`.
        """
        if session in self._expired:
            raise SessionExpired(f"session {session!r} expired; its worker was lost")
        ds = self._dataset(dataset_id)
        epoch = int(epoch)
        if ds.is_complete(epoch):
            return None
        ep = ds.epochs.get(epoch)
        if ep is None:
            ep = self._new_epoch(dataset_id, ds, epoch)
        if ep.failed is not None:
            raise EpochFailed(ep.failed)
        n_free = ep.free.size + ep.deferred.size
        if not n_free:
            return None
        if parts is None:
            parts = len(ep.leased) + (session not in ep.leased)
        share = -(-n_free // (2 * max(1, parts)))
        need = min(max(1, int(rows)), max(1, int(least), share))
        if tail:
            # a reader already holding its share of what is not acknowledged yet (leases
            # it asked ahead) waits: the rows go to the readers holding less, so readers
            # that consume alike run out alike, at the end of the epoch
            held = ep.leased.get(session)
            if held is not None and held.size * parts >= n_free + ep.n_leased and (
                    held.size >= need or n_free < parts * need):
                return None
        # the tail rule: a lease ends at a unit's end (a unit is read by one worker) unless
        # that would more than double it past its share of what is left: as the pool runs
        # low, leases shrink toward ``least`` (two batches), so every reader has rows to
        # the end of the epoch instead of one holding a whole unit while others idle
        cap = 2 * max(need, share) if tail else None
        pool = ep.free if ep.free else ep.deferred
        units = ds.units
        out: list[Interval] = []
        while need > 0 and pool:
            a, b = pool.starts[0], pool.stops[0]
            if b - a <= need:
                c = b
            else:
                c = min(b, units.stop_of(a + need - 1))  # type: ignore[union-attr]
                if cap is not None and c - a > cap:
                    c = a + need
            pool.remove(a, c)
            out.append((a, c))
            need -= c - a
        held = ep.leased.get(session)
        if held is None:
            held = ep.leased[session] = RowSet()
            self._session_keys.setdefault(session, set()).add((dataset_id, epoch))
        for a, c in out:
            held.add(a, c)
            ep.n_leased += c - a
        return out

    def _held(self, session: str, dataset_id: str, epoch: int,
              ranges: Sequence[tuple[int, int]]):
        """``(dataset, epoch table, the session's rows, pieces)`` if every row of
        ``ranges`` is leased to ``session`` now; ``None`` if not."""
        if session in self._expired:
            return None
        ds = self.datasets.get(dataset_id)
        ep = ds.epochs.get(int(epoch)) if ds is not None else None
        held = ep.leased.get(session) if ep is not None else None
        if held is None:
            return None
        if len(ranges) == 1 and ranges[0][0] < ranges[0][1]:  # one batch: the usual case
            pieces = ranges
        else:
            pieces = normalize(ranges)
        for a, b in pieces:
            if not held.covers(a, b):
                return None
        return ds, ep, held, pieces

    def _acknowledge(self, session: str, dataset_id: str, epoch: int, found) -> None:
        ds, ep, held, pieces = found
        rows = 0
        for a, b in pieces:
            held.remove(a, b)
            ep.acked.add(a, b)
            rows += b - a
        ep.n_leased -= rows
        if not held:
            del ep.leased[session]
            self._unkey(session, (dataset_id, epoch))
        if self._on_ack is not None and rows:
            self._on_ack(session, dataset_id, rows)
        if ep.acked.size == ep.total:
            self._complete(dataset_id, ds, epoch, ep)

    def _unkey(self, session: str, key: tuple[str, int]) -> None:
        keys = self._session_keys.get(session)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._session_keys[session]

    def ack(self, session: str, dataset_id: str, epoch: int,
            ranges: Iterable[Sequence[int]]) -> bool:
        """Acknowledge rows consumed by a completed closure of ``session``.

        All or nothing: ``False`` (nothing changed) if the session expired, the table is
        unknown, or any row is not currently leased to this session.
        """
        found = self._held(session, dataset_id, epoch, normalize(ranges))
        if found is None:
            return False
        self._acknowledge(session, dataset_id, int(epoch), found)
        return True

    def ack_tokens(self, session: str, tokens: Iterable[object]) -> bool:
        """Acknowledge every lease token (``LeaseToken``) of one completed closure,
        atomically (see :meth:`ack_sessions`)."""
        return self.ack_sessions({session: tokens})

    def ack_sessions(self, per_session: Mapping[str, Iterable[object]]) -> bool:
        """Acknowledge the lease tokens of several sessions at once (a gang commit), or
        of one (a closure): all tokens are checked first and, if any is refused (a
        malformed token, an expired session, a row not leased to its session), nothing
        changes and ``False`` is returned. Other tokens are ignored."""
        grouped = {}
        for session, tokens in per_session.items():
            try:
                grouped[session] = group_tokens(tokens)
            except ValueError:
                return False  # refused: nothing acknowledged
        return self.ack_grouped(grouped)

    def ack_grouped(self, per_session: Mapping[str, Mapping[tuple[str, int], list]]) -> bool:
        """:meth:`ack_sessions` with each session's tokens already grouped by epoch table
        (:func:`group_tokens`): all or nothing."""
        found = []
        for session, groups in per_session.items():
            if groups and session in self._expired:
                return False
            for (dataset_id, epoch), ranges in groups.items():
                held = self._held(session, dataset_id, epoch, ranges)
                if held is None:
                    return False
                found.append((session, dataset_id, epoch, held))
        for session, dataset_id, epoch, held in found:
            self._acknowledge(session, dataset_id, epoch, held)
        return True

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

        ``failure`` is ``(file, message)`` when the rows could not be read: they are
        deferred (served once no other row is free) and the file's failure is counted;
        at the ``max_failures``-th the epoch fails with ``message``.
        """
        if session in self._expired:
            return 0
        ds = self.datasets.get(dataset_id)
        ep = ds.epochs.get(int(epoch)) if ds is not None else None
        held = ep.leased.get(session) if ep is not None else None
        if held is None:
            return 0
        pool = ep.deferred if failure is not None else ep.free
        moved = 0
        for a, b in normalize(ranges):
            for lo, hi in held.intersect(a, b):
                held.remove(lo, hi)
                pool.add(lo, hi)
                moved += hi - lo
        ep.n_leased -= moved
        if not held:
            del ep.leased[session]
            self._unkey(session, (dataset_id, int(epoch)))
        if failure is not None and moved:
            source, message = failure
            n = ep.failures[source] = ep.failures.get(source, 0) + 1
            if n >= self.max_failures and ep.failed is None:
                ep.failed = (f"{message} (reads of {source} failed {n} times, "
                             f"max_worker_failures={self.max_failures}: dataset "
                             f"{self._name(dataset_id)} epoch {int(epoch)} cannot complete)")
        return moved

    def drop_session(self, session: str) -> int:
        """A lost worker: every row leased to ``session`` goes back to free, and later
        acks, releases and acquires from it are refused. Returns rows freed."""
        self._expired[session] = None
        while len(self._expired) > self._max_expired:
            del self._expired[next(iter(self._expired))]
        moved = 0
        for dataset_id, epoch in self._session_keys.pop(session, set()):
            ds = self.datasets.get(dataset_id)
            ep = ds.epochs.get(epoch) if ds is not None else None
            held = ep.leased.pop(session, None) if ep is not None else None
            if held is None:
                continue
            for a, b in held:
                ep.free.add(a, b)
            ep.n_leased -= held.size
            moved += held.size
        return moved

    # -- queries -----------------------------------------------------------------------
    def newest_epochs(self) -> dict[str, int]:
        """Every defined dataset's newest epoch, live or completed (its table dropped)."""
        newest = {}
        for dataset_id, ds in self.datasets.items():
            epochs = list(ds.epochs) + ([ds.completed[-1][1] - 1] if ds.completed else [])
            if epochs:
                newest[dataset_id] = max(epochs)
        return newest

    def progress(self, dataset_id: str, epoch: int) -> dict:
        """``total``, ``acknowledged``, ``leased``, ``free`` (deferred rows included)
        rows, ``complete`` (every row acknowledged) and ``failed`` (why the epoch cannot
        complete, or ``None``). An unknown dataset reports ``known=False``. Read-only:
        never creates a table."""
        ds = self.datasets.get(dataset_id)
        epoch = int(epoch)
        out = {"dataset_id": dataset_id, "name": ds.label if ds is not None else "",
               "epoch": epoch, "known": False, "total": 0, "acknowledged": 0,
               "leased": 0, "free": 0, "units": 0, "complete": False, "failed": None}
        if ds is None or ds.units is None:
            return out
        total = ds.units.total
        out.update(known=True, total=total, units=ds.units.units)
        ep = ds.epochs.get(epoch)
        if ds.is_complete(epoch):
            out.update(acknowledged=total, complete=True)
        elif ep is None:
            out.update(free=total)
        else:
            out.update(acknowledged=ep.acked.size, leased=ep.n_leased,
                       free=ep.free.size + ep.deferred.size, failed=ep.failed)
        return out

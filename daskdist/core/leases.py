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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from daskdist.core.intervals import Interval, RowSet, intersect, normalize, size_of, subtract, union
from daskdist.core.partitions import Permutation, StridedUnits
from daskdist.core.protocol import LeaseToken, dataset_key

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

    __slots__ = ("_r0", "_sz", "_u0", "runs", "size", "start", "total", "units")

    def __init__(self, runs: Sequence[Sequence[int]]) -> None:
        self.runs = [(int(r), int(n)) for r, n in runs]
        self.start = array("q", [0])
        self.size = array("q")
        # per run, zero-row runs included: its first unit, first row and unit size
        self._u0, self._r0, self._sz = array("q"), array("q"), array("q")
        pos = units = 0
        for rows, count in self.runs:
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
        self.total = pos
        self.units = units

    def bounds(self, unit: int) -> tuple[int, int]:
        """The rows of ``unit`` (``0 <= unit < units``) as ``(start, stop)``."""
        i = bisect_right(self._u0, unit) - 1
        a = self._r0[i] + (unit - self._u0[i]) * self._sz[i]
        return a, a + self._sz[i]

    def unit_of(self, row: int) -> int:
        """The unit holding ``row`` (``0 <= row < total``)."""
        i = bisect_right(self._r0, row) - 1
        return self._u0[i] + (row - self._r0[i]) // self._sz[i]

    def stop_of(self, row: int) -> int:
        """The end of the unit holding ``row`` (``0 <= row < total``)."""
        i = bisect_right(self.start, row) - 1
        size = self.size[i]
        first = self.start[i]
        return first + ((row - first) // size + 1) * size

    def nbytes(self) -> int:
        return self.start.itemsize * (len(self.start) + len(self.size))

    def learn(self, unit: int, length: int) -> int | None:
        """A computed unit's length: ``None`` if it is the defined one, else that one."""
        a, b = self.bounds(unit)
        return None if length == b - a else b - a


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
    # shuffled collections: units are leased in a seeded order, this far along it
    order: Permutation | None = None
    cursor: int = 0
    # strided collections: ids of leased rows that may not exist (a unit of unknown
    # length, or the tail of one learned since it was leased); ``total`` counts them
    phantom_leased: int = 0


def _units_in(units: _Units | StridedUnits, rows: int) -> float:
    """About how many whole units ``rows`` free rows of a collection make, in O(1): by
    the mean unit for dense ids; strided ids count ``STRIDE`` per partition of unknown
    length and the rest by the mean of the lengths learned (exact while the free rows
    of learned partitions sum under ``STRIDE``)."""
    if isinstance(units, StridedUnits):
        unknown, rest = divmod(rows, units.stride)
        return unknown + (rest * units.known / units.known_rows if units.known_rows else 0)
    return rows * units.units / units.total if units.total else 0.0


@dataclass
class _Dataset:
    label: str
    owner: str
    seed: int = 0
    units: _Units | StridedUnits | None = None  # None: registered, not defined yet
    epochs: dict[int, _Epoch] = field(default_factory=dict)
    completed: list[Interval] = field(default_factory=list)  # intervals of epochs
    shuffle: bool = False  # a collection's units are leased in a seeded order
    # a collection's: a unit is leased whole, never split by the tail rule (a partition
    # read in part is computed whole: two readers of one partition compute it twice)
    whole: bool = False
    absent: RowSet = field(default_factory=RowSet)  # ids learned not to exist (strided)

    def universe(self) -> list[Interval]:
        """Every row id that may exist: all ids minus those learned not to."""
        total = self.units.total if self.units is not None else 0
        return subtract([(0, total)], self.absent.items()) if total else []

    def is_complete(self, epoch: int) -> bool:
        if self.units is not None and self.units.total == self.absent.size:
            return True  # no row at all (an empty collection's learned lengths too)
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
                 on_ack: Callable[[str, list[tuple[str, int]]], None] | None = None,
                 max_failures: int = 3, max_epochs: int = 1024) -> None:
        # told (dataset_id, [(session, rows), ...]) of every acknowledgement, whichever
        # path made it (a closure's result, a gang commit: one call a table), for the
        # dashboard's and the metrics' counters
        self._on_ack = on_ack
        self.max_failures = max(1, int(max_failures))
        self.max_epochs = max_epochs
        self.datasets: dict[str, _Dataset] = {}
        self._expired: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self._max_expired = max_expired
        # session -> keys of the epochs where it holds rows now (for drop_session)
        self._session_keys: dict[str, set[tuple[str, int]]] = {}
        # dataset_key(id) -> id (None: two ids share the key): a packed commit names it
        self._keys: dict[int, str | None] = {}

    def _keyed(self, dataset_id: str) -> None:
        key = dataset_key(dataset_id)
        known = self._keys.get(key, dataset_id)
        self._keys[key] = dataset_id if known == dataset_id else None

    def dataset_of(self, key: int) -> str | None:
        """The dataset whose :func:`~daskdist.core.protocol.dataset_key` is ``key``
        (``None``: none, or two datasets share it and a packed commit naming it is
        refused)."""
        return self._keys.get(key)

    # -- datasets --------------------------------------------------------------------
    def register(self, dataset_id: str, label: str = "", owner: str = "",
                 seed: int = 0) -> None:
        """Know ``dataset_id`` (its label, owner, seed) before its units are defined."""
        ds = self.datasets.get(dataset_id)
        if ds is None:
            self.datasets[dataset_id] = _Dataset(label, owner, seed)
            self._keyed(dataset_id)
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
            self._keyed(dataset_id)
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

    def define_collection(self, dataset_id: str, units: int,
                          runs: Sequence[Sequence[int]] | None = None, label: str = "",
                          owner: str = "", seed: int = 0, shuffle: bool = False) -> None:
        """Define a Dask collection's partitions as units: ``runs`` when their lengths
        are known (dense ids, as files), else ``units`` partitions of strided ids whose
        lengths are learned (:meth:`set_length`). ``shuffle``: units are leased in an
        order seeded by ``(seed, epoch)``. A later definition must agree."""
        if runs is not None:
            self.define(dataset_id, runs, label, owner, seed)
            if self.datasets[dataset_id].units.units != int(units):  # type: ignore[union-attr]
                raise ValueError(f"dataset {self._name(dataset_id)}: its runs hold "
                                 f"{self.datasets[dataset_id].units.units} units, "  # type: ignore[union-attr]
                                 f"not {units}")
        else:
            ds = self.datasets.get(dataset_id)
            new = StridedUnits(units)
            if ds is not None and ds.units is not None:
                if ds.units.runs != new.runs:
                    raise ValueError(
                        f"dataset {self._name(dataset_id)}: {units} partitions of unknown "
                        f"length given, its definition differs ({ds.units.units} units)")
            else:
                self.register(dataset_id, label, owner, seed)
                ds = self.datasets[dataset_id]
                ds.units = new
                ds.seed = seed
        self.datasets[dataset_id].shuffle = bool(shuffle)
        self.datasets[dataset_id].whole = True

    def set_length(self, session: str, dataset_id: str, epoch: int, unit: int,
                   length: int) -> str | None:
        """``session`` computed ``unit`` of a collection and found ``length`` rows.

        The first time, ids past its end go from every live epoch (from the free and
        deferred rows and from ``session``'s lease; rows of the tail leased to another
        session go when they come back) and from every epoch started later. A length
        that differs from the one learned (or defined) before fails ``epoch``: its
        message naming the partition is returned (``None`` when all is well).
        ``ValueError`` for a unit or length out of range."""
        ds = self._dataset(dataset_id)
        units = ds.units
        unit, length, epoch = int(unit), int(length), int(epoch)
        if not 0 <= unit < units.units:  # type: ignore[union-attr]
            raise ValueError(f"dataset {self._name(dataset_id)} has no partition {unit} "
                             f"(it has {units.units})")  # type: ignore[union-attr]
        if length < 0:
            raise ValueError(f"partition {unit}: a length must be >= 0, got {length}")
        old = units.learn(unit, length)  # type: ignore[union-attr]
        if old is not None:
            why = (f"partition {unit} of dataset {self._name(dataset_id)} has {length} rows "
                   f"now and had {old} before: a recomputed partition must be the same "
                   f"(partitions must be deterministic); epoch {epoch} cannot complete")
            ep = ds.epochs.get(epoch)
            if ep is not None and ep.failed is None:
                ep.failed = why
            return why
        if isinstance(units, StridedUnits):
            self._learned(dataset_id, ds, units, unit, length, session)
        return None

    def _learned(self, dataset_id: str, ds: _Dataset, units: StridedUnits, unit: int,
                 length: int, session: str | None) -> None:
        """``unit``'s length was learned: its ids past it leave every live epoch's pools
        (and ``session``'s lease) and every epoch started later."""
        a, b = unit * units.stride + length, (unit + 1) * units.stride
        if not ds.absent.covers(a, b):
            ds.absent.add(a, b)
        for ep_no, ep in list(ds.epochs.items()):
            held = ep.leased.get(session) if session is not None else None
            if held is not None and held.intersect(a, b):
                ep.phantom_leased -= units.stride
                self._drop_rows(ep, held, a, b)
                if not held:
                    del ep.leased[session]
                    self._unkey(session, (dataset_id, ep_no))
            for pool in (ep.free, ep.deferred):
                self._drop_rows(ep, pool, a, b)
            if ep.acked.size == ep.total:  # the last rows were ids that do not exist
                self._complete(dataset_id, ds, ep_no, ep)

    def known_lengths(self, dataset_id: str) -> list[tuple[int, int]] | None:
        """A collection's partition lengths learned so far, run-length encoded
        (:meth:`StridedUnits.length_runs`: ``-1`` for unknown ones); ``None`` for a
        dataset whose lengths were defined (files, dask Arrays)."""
        units = self._dataset(dataset_id).units
        return units.length_runs() if isinstance(units, StridedUnits) else None

    def learn_lengths(self, dataset_id: str, runs: Iterable[Sequence[int]]) -> int:
        """Lengths a ledger carries (:meth:`known_lengths` of an earlier dataset over the
        same collection) become this collection's, as if computed here: a resumed epoch
        leases no id past them, so a partition whose rows were all acknowledged is never
        computed again. ``ValueError`` naming a partition whose length differs from the
        one learned here (nothing changes then), or for runs that do not fit. Costs
        O(runs + partitions of known length). Partitions newly learned."""
        ds = self._dataset(dataset_id)
        units = ds.units
        runs = [(int(n), int(k)) for n, k in runs]
        if not isinstance(units, StridedUnits):
            if runs:
                raise ValueError(f"dataset {self._name(dataset_id)} has lengths defined; "
                                 "a ledger's learned lengths are for a collection of "
                                 "partitions of unknown length")
            return 0
        if sum(k for _, k in runs) > units.units or any(
                k < 1 or not -1 <= n < units.stride for n, k in runs):
            raise ValueError(f"the ledger's partition lengths {runs[:4]}... do not fit "
                             f"dataset {self._name(dataset_id)}'s {units.units} partitions")
        todo = []
        u = 0
        for n, k in runs:
            if n >= 0:
                for unit in range(u, u + k):
                    old = units.lengths[unit]
                    if old >= 0 and old != n:
                        raise ValueError(
                            f"partition {unit} of dataset {self._name(dataset_id)} has "
                            f"{old} rows here and {n} in the ledger being restored "
                            "(partitions must be deterministic)")
                    if old < 0:
                        todo.append((unit, n))
            u += k
        for unit, n in todo:
            units.learn(unit, n)
            self._learned(dataset_id, ds, units, unit, n, None)
        return len(todo)

    @staticmethod
    def _drop_rows(ep: _Epoch, rows: RowSet, a: int, b: int) -> None:
        """Ids ``[a, b)`` learned not to exist leave ``rows`` (and the epoch's total)."""
        n = 0
        for lo, hi in rows.intersect(a, b):
            rows.remove(lo, hi)
            n += hi - lo
        ep.total -= n
        if rows is not ep.free and rows is not ep.deferred:
            ep.n_leased -= n

    def _phantoms(self, ds: _Dataset, ranges: Iterable[Interval]) -> int:
        """Ids of ``ranges`` that may not exist, counted as ``stride`` per unit of unknown
        length, or known length whose tail they hold (strided collections only)."""
        units = ds.units
        if not isinstance(units, StridedUnits):
            return 0
        s = units.stride
        n = 0
        for a, b in ranges:
            for u in range(a // s, (b - 1) // s + 1):
                length = units.lengths[u]
                if length < 0 or (u * s + length < b and a < (u + 1) * s
                                  and u * s + length < (u + 1) * s):
                    n += s
        return n

    def _returned(self, ds: _Dataset, ep: _Epoch, a: int, b: int) -> list[Interval]:
        """Rows ``[a, b)`` coming back to a pool, minus ids learned not to exist (those
        leave the epoch's total)."""
        if not ds.absent:
            return [(a, b)]
        gone = ds.absent.intersect(a, b)
        if not gone:
            return [(a, b)]
        ep.total -= size_of(gone)
        return subtract([(a, b)], gone)

    def acquire_unit(self, session: str, dataset_id: str, epoch: int,
                     unit: int) -> list[Interval] | None:
        """Lease the free rows of one unit to ``session`` (a partition its worker holds:
        no transfer), or ``None`` if none of them is free. Raises as :meth:`acquire`."""
        if session in self._expired:
            raise SessionExpired(f"session {session!r} expired; its worker was lost")
        ds = self._dataset(dataset_id)
        epoch = int(epoch)
        if ds.is_complete(epoch):
            return None
        ep = ds.epochs.get(epoch) or self._new_epoch(dataset_id, ds, epoch)
        if ep.failed is not None:
            raise EpochFailed(ep.failed)
        a, b = ds.units.bounds(int(unit))  # type: ignore[union-attr]
        out = ep.free.intersect(a, b)
        for lo, hi in out:
            ep.free.remove(lo, hi)
        return self._lease(session, dataset_id, epoch, ds, ep, out) or None

    def _lease(self, session: str, dataset_id: str, epoch: int, ds: _Dataset, ep: _Epoch,
               out: list[Interval]) -> list[Interval]:
        """Rows taken from a pool become ``session``'s."""
        if not out:
            return out
        held = ep.leased.get(session)
        if held is None:
            held = ep.leased[session] = RowSet()
            self._session_keys.setdefault(session, set()).add((dataset_id, epoch))
        for a, c in out:
            held.add(a, c)
            ep.n_leased += c - a
        ep.phantom_leased += self._phantoms(ds, out)
        return out

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
            key = dataset_key(d)
            if self._keys.get(key) == d:
                del self._keys[key]
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

    def takes(self, dataset_id: str, session: str) -> bool:
        """Whether a closure reading ``dataset_id`` should run on ``session`` now: yes
        unless the dataset's free rows are gone and other sessions, not this one, hold
        its leased rows (the epoch's tail: the rows are with those readers, a closure
        elsewhere would find none). O(the dataset's unfinished epochs)."""
        ds = self.datasets.get(dataset_id)
        if ds is None:
            return True
        held = False
        for ep in ds.epochs.values():
            if ep.free or ep.deferred:
                return True
            if ep.leased:
                if session in ep.leased:
                    return True
                held = True
        return not held

    def holders(self, dataset_id: str) -> Iterator[str]:
        """The sessions holding leased rows of ``dataset_id`` (lazily: take a few)."""
        ds = self.datasets.get(dataset_id)
        if ds is not None:
            for ep in ds.epochs.values():
                yield from ep.leased

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
        if ds.absent:  # rows learned not to exist are in no epoch
            acked = subtract(acked, ds.absent.items())
        universe = ds.universe()
        ep = _Epoch(size_of(universe), RowSet(subtract(universe, acked)), RowSet(acked))
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
        if ds.absent:
            acked = subtract(acked, ds.absent.items())
        if ds.is_complete(epoch):  # its table was dropped: every row was acknowledged
            ds.completed = subtract(ds.completed, [(epoch, epoch + 1)])
            ep = self._new_epoch(dataset_id, ds, epoch, ds.universe())
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
        universe = ds.universe() if ds.absent else ([(0, total)] if total else [])
        ep.free = RowSet(subtract(subtract(universe, acked), normalize(held)))
        if ep.acked.size == ep.total:
            self._complete(dataset_id, ds, epoch, ep)
        return size_of(freed)

    def acknowledged(self, dataset_id: str, epoch: int) -> list[Interval]:
        """The epoch's acknowledged rows as intervals (what :meth:`start_epoch` takes)."""
        ds = self._dataset(dataset_id)
        epoch = int(epoch)
        if ds.is_complete(epoch):
            return ds.universe()
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
        alike run out alike, at the epoch's end. A collection's partitions are never
        split; once fewer than two are free per reader, one holding two or more waits.

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
        if tail and self._holds_share(ds, session, ep, parts, need, n_free):
            return None
        # the tail rule: a lease ends at a unit's end (a unit is read by one worker) unless
        # that would more than double it past its share of what is left: as the pool runs
        # low, leases shrink toward ``least`` (two batches), so every reader has rows to
        # the end of the epoch instead of one holding a whole unit while others idle; a
        # collection's partitions are never split (the hold-back above is its tail rule)
        cap = 2 * max(need, share) if tail and not ds.whole else None
        pool = ep.free if ep.free else ep.deferred
        if ds.shuffle and pool is ep.free:  # a shuffled collection: units in seeded order
            picked = self._permuted(ds, ep, epoch, need)
            if picked:
                return self._lease(session, dataset_id, epoch, ds, ep, picked)
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
        return self._lease(session, dataset_id, epoch, ds, ep, out)

    @staticmethod
    def _holds_share(ds: _Dataset, session: str, ep: _Epoch, parts: int, need: int,
                     n_free: int) -> bool:
        """The tail rule's hold-back: ``session`` already holds its share of what is not
        acknowledged yet (leases it asked ahead), and a lease's worth or the pool is low:
        it waits, the rows go to the readers holding less, so readers that consume alike
        run out alike at the end of the epoch. A collection's partitions are never
        split, so once fewer than two partitions per member are free (by the mean
        partition), a member holding two (the one it reads, one computed ahead) waits
        too: the last partitions go to members that would otherwise idle while one
        holds several."""
        held = ep.leased.get(session)
        if held is None:
            return False
        if held.size * parts >= n_free + ep.n_leased and (
                held.size >= need or n_free < parts * need):
            return True
        units = ds.units
        if not ds.whole or _units_in(units, n_free) >= 2 * parts:  # type: ignore[arg-type]
            return False  # two partitions or more free per member: not the tail yet
        first = held.starts[0]
        last = held.stops[-1] - 1
        return units.unit_of(last) > units.unit_of(first)  # type: ignore[union-attr]

    def holds_share(self, session: str, dataset_id: str, epoch: int, parts: int) -> bool:
        """Whether :meth:`acquire` with ``tail`` would hold ``session`` back now (a lease
        of one row asked): asked before leasing a partition where it is held, so the
        tail rule comes before locality. Read-only; ``False`` for an epoch not started."""
        ds = self.datasets.get(dataset_id)
        ep = ds.epochs.get(int(epoch)) if ds is not None else None
        if ep is None:
            return False
        return self._holds_share(ds, session, ep, max(1, int(parts)), 1,
                                 ep.free.size + ep.deferred.size)

    def _permuted(self, ds: _Dataset, ep: _Epoch, epoch: int, need: int) -> list[Interval]:
        """Take the free rows of whole units, in the order seeded by ``(seed, epoch)``,
        until ``need`` rows are taken; ``[]`` once the order is walked through (rows
        that came back since are served lowest first). O(1) amortized per unit."""
        units = ds.units
        if ep.order is None:
            ep.order = Permutation(units.units, ds.seed, epoch)  # type: ignore[union-attr]
        out: list[Interval] = []
        while need > 0 and ep.cursor < ep.order.n:
            a, b = units.bounds(ep.order[ep.cursor])  # type: ignore[union-attr]
            ep.cursor += 1
            for lo, hi in ep.free.intersect(a, b):
                ep.free.remove(lo, hi)
                out.append((lo, hi))
                need -= hi - lo
        return out

    def _table(self, dataset_id: str, epoch: int) -> tuple[_Dataset, _Epoch] | None:
        """``(dataset, its epoch table)``; ``None`` if either is unknown (or done)."""
        ds = self.datasets.get(dataset_id)
        ep = ds.epochs.get(int(epoch)) if ds is not None else None
        return None if ep is None else (ds, ep)

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
        return self.ack_tables({(dataset_id, int(epoch)): [(session, normalize(ranges))]})

    def ack_tokens(self, session: str, tokens: Iterable[object]) -> bool:
        """Acknowledge every lease token (``LeaseToken``) of one completed closure,
        atomically (see :meth:`ack_sessions`)."""
        return self.ack_sessions({session: tokens})

    def ack_sessions(self, per_session: Mapping[str, Iterable[object]]) -> bool:
        """Acknowledge the lease tokens of several sessions at once (a gang commit), or
        of one (a closure): all tokens are checked first and, if any is refused (a
        malformed token, an expired session, a row not leased to its session), nothing
        changes and ``False`` is returned. Other tokens are ignored."""
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
        nothing, as :meth:`ack_sessions`. Checked, then applied, table by table, so a
        gang commit's thousand parts of one table look it up once. O(parts)."""
        checked = []  # (key, dataset, epoch table, [(session, held, rows)])
        expired = self._expired
        for key, parts in tables.items():
            found = self._table(*key)
            if found is None:
                return False
            leased = found[1].leased
            holds = []
            for session, ranges in parts:
                held = leased.get(session)
                if held is None or session in expired:
                    return False
                if len(ranges) != 1 or ranges[0][0] >= ranges[0][1]:  # one batch: usual
                    ranges = normalize(ranges)
                for a, b in ranges:
                    if not held.covers(a, b):
                        return False
                holds.append((session, held, ranges))
            checked.append((key, *found, holds))
        on_ack = self._on_ack
        for key, ds, ep, holds in checked:
            acked, leased, total, counts = ep.acked, ep.leased, 0, []
            for session, held, ranges in holds:
                rows = 0
                for a, b in ranges:
                    held.remove(a, b)
                    acked.add(a, b)
                    rows += b - a
                if not held.size:
                    del leased[session]
                    self._unkey(session, key)
                if rows:
                    counts.append((session, rows))
                    total += rows
            ep.n_leased -= total
            if on_ack is not None and counts:
                on_ack(key[0], counts)
            if acked.size == ep.total:
                self._complete(key[0], ds, key[1], ep)
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
                if ep.phantom_leased:
                    ep.phantom_leased -= self._phantoms(ds, [(lo, hi)])
                for x, y in self._returned(ds, ep, lo, hi):
                    pool.add(x, y)
                moved += hi - lo
        ep.n_leased -= moved
        if not held:
            del ep.leased[session]
            self._unkey(session, (dataset_id, int(epoch)))
        if ds.absent and ep.acked.size == ep.total:  # only ids that do not exist came back
            self._complete(dataset_id, ds, int(epoch), ep)
            return moved
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
            if ep.phantom_leased:
                ep.phantom_leased -= self._phantoms(ds, held)
            for a, b in held:
                for x, y in self._returned(ds, ep, a, b):
                    ep.free.add(x, y)
            ep.n_leased -= held.size
            moved += held.size
            if ds.absent and ep.acked.size == ep.total:
                self._complete(dataset_id, ds, epoch, ep)
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
        out.update(known=True, total=total, units=ds.units.units, ids=total)
        ep = ds.epochs.get(epoch)
        if isinstance(ds.units, StridedUnits):
            return self._collection_progress(ds, ep, epoch, out)
        if ds.is_complete(epoch):
            out.update(acknowledged=total, complete=True)
        elif ep is None:
            out.update(free=total)
        else:
            out.update(acknowledged=ep.acked.size, leased=ep.n_leased,
                       free=ep.free.size + ep.deferred.size, failed=ep.failed)
        return out

    @staticmethod
    def _collection_progress(ds: _Dataset, ep: _Epoch | None, epoch: int,
                             out: dict) -> dict:
        """Progress of a collection whose lengths are learned: ``total`` counts the rows
        of partitions computed so far, ``known`` is False until every length is known,
        ``units_known`` counts those partitions; ids that may not exist are in no
        count."""
        units: StridedUnits = ds.units  # type: ignore[assignment]
        real = units.known_rows
        out.update(known=units.known == units.units, total=real,
                   units_known=units.known)
        if ds.is_complete(epoch):
            out.update(acknowledged=real, complete=True)
        elif ep is None:
            out.update(free=real)
        else:
            phantom = ep.total - real  # ids of unknown lengths (and stale tails)
            leased = ep.n_leased - ep.phantom_leased
            out.update(acknowledged=ep.acked.size, leased=leased,
                       free=ep.free.size + ep.deferred.size - (phantom - ep.phantom_leased),
                       failed=ep.failed)
        return out

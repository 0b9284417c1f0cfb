"""Lease/ack bookkeeping for the ``"dynamic"`` sharding policy: a pure state machine.

The scheduler plugin holds one :class:`LeaseTable`. Per ``(dataset_id, epoch)`` it
tracks, for every unit of work (a row group), which of its rows are *free*, *leased*
to a worker session, or *acknowledged* (consumed by a closure that completed). Rows
are global ids ``0 .. total`` (their position in the stable order of units), and every
set is kept as sorted, disjoint half-open intervals ``(start, stop)``, so memory per
epoch grows with fragmentation, never with the number of rows.

Why a separate pure module (SPEC §1, §3.1): the exactly-once guarantee is a property
of these transitions alone, so they are tested exhaustively (hypothesis stateful tests)
without Dask, torch or pyarrow. Transitions:

- :meth:`LeaseTable.acquire`: a session leases the free rows of the next unit that has any.
- :meth:`LeaseTable.ack`: a completed closure acknowledges rows leased to its session.
  Refused (``False``, nothing changed) when the session expired or any row is not
  leased to it: fencing, so a late or duplicate message never counts a row twice.
- :meth:`LeaseTable.release`: a failed closure's rows go back to free.
- :meth:`LeaseTable.drop_session`: a lost worker; all its leased rows go back to free and
  the session is expired for good.

Invariant (:meth:`LeaseTable.check`): per epoch, acknowledged ∪ leased ∪ free is every
row, pairwise disjoint. This module imports nothing from Dask, torch, pyarrow or the
rest of the package.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from daskdist.core.intervals import Interval, _intersect, _size, normalize, subtract, union
from daskdist.core.protocol import LeaseToken

__all__ = ["LeaseTable", "SessionExpired", "group_tokens"]


class SessionExpired(RuntimeError):
    """A session that was dropped (its worker was lost) asked for a new lease."""


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


# ---------------------------------------------------------------------------------------


@dataclass
class _Unit:
    start: int
    stop: int
    free: list[Interval]
    leased: dict[str, list[Interval]] = field(default_factory=dict)
    acked: list[Interval] = field(default_factory=list)


@dataclass
class _Epoch:
    unit_rows: tuple[int, ...]
    starts: list[int]
    units: list[_Unit]
    total: int
    n_acked: int = 0
    n_leased: int = 0
    heap: list[int] = field(default_factory=list)  # unit indices that may have free rows
    in_heap: bytearray = field(default_factory=bytearray)

    def mark_free(self, u: int) -> None:
        if not self.in_heap[u]:
            self.in_heap[u] = 1
            heapq.heappush(self.heap, u)


def _unlease(unit: _Unit, session: str, pieces: list[Interval]) -> None:
    """Take ``pieces`` out of the rows ``unit`` has leased to ``session``."""
    rest = subtract(unit.leased[session], pieces)
    if rest:
        unit.leased[session] = rest
    else:
        del unit.leased[session]


class LeaseTable:
    """Free / leased / acknowledged row intervals per ``(dataset_id, epoch)`` and unit.

    Sessions are opaque strings (the worker plugin's session id). Not thread-safe: the
    scheduler plugin calls it from its event loop only.

    Memory stays bounded: an epoch whose every row is acknowledged drops its table and
    is remembered as one interval of completed epochs per dataset (with its row count);
    the ids of the last ``max_expired`` dropped sessions are kept for fencing (the
    scheduler fences older ones by membership: sessions are never reused).
    """

    def __init__(self, max_expired: int = 4096,
                 on_ack: Callable[[str, str, int], None] | None = None) -> None:
        # told (session, dataset_id, rows) of every acknowledgement, whichever path made
        # it (a closure's result, a gang commit): counters for the dashboard and metrics
        self._on_ack = on_ack
        self._epochs: dict[tuple[str, int], _Epoch] = {}
        self._expired: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self._max_expired = max_expired
        # dataset -> (total rows, intervals of completed epochs): their tables are gone
        self._completed: dict[str, tuple[int, list[Interval]]] = {}
        self.epochs_completed = 0
        self.sessions_dropped = 0
        # session -> keys of the epochs where it holds leases (for drop_session)
        self._session_keys: dict[str, set[tuple[str, int]]] = {}

    # -- table definition --------------------------------------------------------------
    def is_complete(self, dataset_id: str, epoch: int) -> bool:
        """Every row of the epoch was acknowledged (its table may be dropped already)."""
        done = self._completed.get(dataset_id)
        return done is not None and any(a <= int(epoch) < b for a, b in done[1])

    def _complete(self, key: tuple[str, int], ep: _Epoch) -> None:
        """Every row of the epoch is acknowledged: keep only that fact (and its size)."""
        del self._epochs[key]
        for keys in self._session_keys.values():
            keys.discard(key)
        dataset_id, epoch = key
        _, done = self._completed.get(dataset_id, (ep.total, []))
        self._completed[dataset_id] = (ep.total, union(done, [(epoch, epoch + 1)]))
        self.epochs_completed += 1

    def _epoch(self, dataset_id: str, epoch: int, unit_rows: Sequence[int] | None) -> _Epoch:
        key = (dataset_id, int(epoch))
        ep = self._epochs.get(key)
        if unit_rows is None:
            if ep is None:
                raise KeyError(f"no lease table for dataset {dataset_id!r} epoch {epoch}")
            return ep
        rows = tuple(int(r) for r in unit_rows)
        if ep is not None:
            if ep.unit_rows != rows:
                raise ValueError(
                    f"dataset {dataset_id!r} epoch {epoch}: unit row counts differ from the "
                    f"table's ({len(rows)} units / {sum(rows)} rows given, "
                    f"{len(ep.unit_rows)} units / {ep.total} rows known)"
                )
            return ep
        if any(r < 0 for r in rows):
            raise ValueError("unit row counts must be >= 0")
        units, starts, pos = [], [], 0
        for r in rows:
            starts.append(pos)
            units.append(_Unit(pos, pos + r, [(pos, pos + r)] if r else []))
            pos += r
        ep = _Epoch(rows, starts, units, pos, in_heap=bytearray(len(rows)))
        for i, unit in enumerate(units):
            if unit.free:
                ep.mark_free(i)
        self._epochs[key] = ep
        return ep

    def define(self, dataset_id: str, epoch: int, unit_rows: Sequence[int]) -> None:
        """Create the epoch's table (idempotent; ``ValueError`` if the counts differ)."""
        self._epoch(dataset_id, epoch, unit_rows)

    def forget(self, dataset_id: str, epoch: int | None = None) -> None:
        """Drop the tables of one epoch (or every epoch) of a dataset."""
        for key in [k for k in self._epochs if k[0] == dataset_id and epoch in (None, k[1])]:
            del self._epochs[key]
            for keys in self._session_keys.values():
                keys.discard(key)
        if dataset_id in self._completed:
            if epoch is None:
                del self._completed[dataset_id]
            else:
                total, done = self._completed[dataset_id]
                self._completed[dataset_id] = (total, subtract(done, [(epoch, epoch + 1)]))

    # -- transitions ------------------------------------------------------------------
    def acquire(
        self, session: str, dataset_id: str, epoch: int, unit_rows: Sequence[int]
    ) -> tuple[int, list[Interval]] | None:
        """Lease the free rows of the next unit that has any to ``session``.

        Returns ``(unit index, free rows as global intervals)`` or ``None`` when no free
        rows remain right now. ``unit_rows`` defines the table on first use.
        Raises :class:`SessionExpired` for a dropped session.
        """
        if session in self._expired:
            raise SessionExpired(f"session {session!r} expired; its worker was lost")
        if self.is_complete(dataset_id, epoch):
            return None
        ep = self._epoch(dataset_id, epoch, unit_rows)
        while ep.heap:
            u = ep.heap[0]
            unit = ep.units[u]
            if not unit.free:
                heapq.heappop(ep.heap)
                ep.in_heap[u] = 0
                continue
            heapq.heappop(ep.heap)
            ep.in_heap[u] = 0
            rows = unit.free
            unit.free = []
            unit.leased[session] = union(unit.leased.get(session, []), rows)
            ep.n_leased += _size(rows)
            self._session_keys.setdefault(session, set()).add((dataset_id, int(epoch)))
            return u, list(rows)
        return None

    def _split(self, ep: _Epoch, ranges: Iterable[Sequence[int]]) -> dict[int, list[Interval]]:
        """Map normalized global intervals to per-unit pieces; ``ValueError`` if out of range."""
        per_unit: dict[int, list[Interval]] = {}
        for a, b in normalize(ranges):
            if a < 0 or b > ep.total:
                raise ValueError(f"rows [{a}, {b}) are outside the epoch's [0, {ep.total})")
            while a < b:
                u = bisect_right(ep.starts, a) - 1
                while ep.units[u].stop <= a:  # skip empty units sharing a start
                    u += 1
                stop = min(b, ep.units[u].stop)
                per_unit.setdefault(u, []).append((a, stop))
                a = stop
        return per_unit

    def _leased_pieces(
        self, session: str, dataset_id: str, epoch: int, ranges: Iterable[Sequence[int]]
    ) -> tuple[_Epoch, dict[int, list[Interval]]] | None:
        """The epoch and per-unit pieces of ``ranges`` if every row is leased to
        ``session`` now; ``None`` if not (expired session, unknown table, other rows)."""
        if session in self._expired:
            return None
        ep = self._epochs.get((dataset_id, int(epoch)))
        if ep is None:
            return None
        try:
            per_unit = self._split(ep, ranges)
        except ValueError:
            return None
        for u, pieces in per_unit.items():
            if subtract(pieces, ep.units[u].leased.get(session, [])):
                return None
        return ep, per_unit

    def _acknowledge(self, session: str, dataset_id: str, ep: _Epoch,
                     per_unit: dict[int, list[Interval]]) -> None:
        rows = 0
        for u, pieces in per_unit.items():
            unit = ep.units[u]
            _unlease(unit, session, pieces)
            unit.acked = union(unit.acked, pieces)
            n = _size(pieces)
            ep.n_leased -= n
            ep.n_acked += n
            rows += n
        if self._on_ack is not None and rows:
            self._on_ack(session, dataset_id, rows)

    def ack(
        self, session: str, dataset_id: str, epoch: int, ranges: Iterable[Sequence[int]]
    ) -> bool:
        """Acknowledge rows consumed by a completed closure of ``session``.

        All or nothing: ``False`` (nothing changed) if the session expired, the table is
        unknown, or any row is not currently leased to this session.
        """
        found = self._leased_pieces(session, dataset_id, epoch, ranges)
        if found is None:
            return False
        self._acknowledge(session, dataset_id, *found)
        self._drop_completed([(dataset_id, epoch)])
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
        found = []
        keys: set[tuple[str, int]] = set()
        for session, tokens in per_session.items():
            try:
                groups = group_tokens(tokens)
            except ValueError:
                return False  # refused: nothing acknowledged
            if not groups:
                continue
            if session in self._expired:
                return False
            for (dataset_id, epoch), ranges in groups.items():
                pieces = self._leased_pieces(session, dataset_id, epoch, ranges)
                if pieces is None:
                    return False
                found.append((session, dataset_id, pieces))
            keys |= set(groups)
        for session, dataset_id, (ep, per_unit) in found:
            self._acknowledge(session, dataset_id, ep, per_unit)
        self._drop_completed(keys)
        return True

    def _drop_completed(self, keys: Iterable[tuple[str, int]]) -> None:
        for dataset_id, epoch in keys:
            key = (dataset_id, int(epoch))
            ep = self._epochs.get(key)
            if ep is not None and ep.n_acked == ep.total:
                self._complete(key, ep)

    def release_tokens(self, session: str, tokens: Iterable[object]) -> int:
        """Release the rows of every lease token of one failed closure; rows freed (0
        for a malformed token: nothing can be said of its rows)."""
        try:
            groups = group_tokens(tokens)
        except ValueError:
            return 0
        return sum(
            self.release(session, dataset_id, epoch, ranges)
            for (dataset_id, epoch), ranges in groups.items()
        )

    def release(
        self, session: str, dataset_id: str, epoch: int, ranges: Iterable[Sequence[int]]
    ) -> int:
        """Return rows of a failed closure to the pool; only rows leased to ``session``
        move. Returns how many rows went back to free."""
        if session in self._expired:
            return 0
        ep = self._epochs.get((dataset_id, int(epoch)))
        if ep is None:
            return 0
        try:
            per_unit = self._split(ep, ranges)
        except ValueError:
            return 0
        moved = 0
        for u, pieces in per_unit.items():
            unit = ep.units[u]
            back = _intersect(pieces, unit.leased.get(session, []))
            if back:
                moved += self._free(ep, u, session, back)
        return moved

    def _free(self, ep: _Epoch, u: int, session: str, back: list[Interval]) -> int:
        unit = ep.units[u]
        _unlease(unit, session, back)
        unit.free = union(unit.free, back)
        n = _size(back)
        ep.n_leased -= n
        ep.mark_free(u)
        return n

    def drop_session(self, session: str) -> int:
        """A lost worker: every row leased to ``session`` goes back to free, and later
        acks, releases and acquires from it are refused. Returns rows freed."""
        if session not in self._expired:
            self.sessions_dropped += 1
        self._expired[session] = None
        while len(self._expired) > self._max_expired:
            del self._expired[next(iter(self._expired))]
        moved = 0
        for key in self._session_keys.pop(session, set()):
            ep = self._epochs.get(key)
            if ep is None:
                continue
            for u, unit in enumerate(ep.units):
                held = unit.leased.get(session)
                if held:
                    moved += self._free(ep, u, session, list(held))
        return moved

    def is_expired(self, session: str) -> bool:
        return session in self._expired

    # -- queries -----------------------------------------------------------------------
    def newest_epochs(self) -> dict[str, int]:
        """Every dataset's newest epoch, live or completed (its table dropped)."""
        newest = {d: done[-1][1] - 1 for d, (_, done) in self._completed.items() if done}
        for dataset_id, epoch in self._epochs:
            newest[dataset_id] = max(epoch, newest.get(dataset_id, epoch))
        return newest

    def progress(
        self, dataset_id: str, epoch: int, unit_rows: Sequence[int] | None = None
    ) -> dict:
        """``total``, ``acknowledged``, ``leased``, ``free`` rows and ``complete`` (every
        row acknowledged). An unknown table (and no ``unit_rows`` to define it) reports
        ``known=False`` and ``complete=False``."""
        if self.is_complete(dataset_id, epoch):
            total = self._completed[dataset_id][0]
            return {
                "dataset_id": dataset_id, "epoch": int(epoch), "known": True,
                "total": total, "acknowledged": total, "leased": 0, "free": 0,
                "units": len(unit_rows) if unit_rows is not None else 0, "complete": True,
            }
        if unit_rows is None and (dataset_id, int(epoch)) not in self._epochs:
            return {
                "dataset_id": dataset_id, "epoch": int(epoch), "known": False, "total": 0,
                "acknowledged": 0, "leased": 0, "free": 0, "units": 0, "complete": False,
            }
        ep = self._epoch(dataset_id, epoch, unit_rows)
        free = ep.total - ep.n_acked - ep.n_leased
        return {
            "dataset_id": dataset_id,
            "epoch": int(epoch),
            "known": True,
            "total": ep.total,
            "acknowledged": ep.n_acked,
            "leased": ep.n_leased,
            "free": free,
            "units": len(ep.units),
            "complete": ep.n_acked == ep.total,
        }

    def leased_to(self, session: str, dataset_id: str, epoch: int) -> list[Interval]:
        """The rows currently leased to ``session`` in one epoch (global intervals)."""
        ep = self._epochs.get((dataset_id, int(epoch)))
        if ep is None:
            return []
        out: list[Interval] = []
        for unit in ep.units:
            out.extend(unit.leased.get(session, []))
        return out

    def acknowledged(self, dataset_id: str, epoch: int) -> list[Interval]:
        if self.is_complete(dataset_id, epoch):
            total = self._completed[dataset_id][0]
            return [(0, total)] if total else []
        ep = self._epoch(dataset_id, epoch, None)
        return normalize(iv for unit in ep.units for iv in unit.acked)

    def check(self) -> None:
        """Assert the invariant on every epoch: acked ∪ leased ∪ free = all rows,
        pairwise disjoint, counters consistent. Raises ``AssertionError``."""
        for key, ep in self._epochs.items():
            n_acked = n_leased = 0
            for u, unit in enumerate(ep.units):
                parts = [unit.free, unit.acked, *unit.leased.values()]
                for p in parts:
                    assert p == normalize(p), f"{key} unit {u}: not normalized: {p}"
                    for a, b in p:
                        assert unit.start <= a < b <= unit.stop, f"{key} unit {u}: {(a, b)}"
                pieces = sorted(iv for p in parts for iv in p)
                pos = unit.start
                for a, b in pieces:
                    assert a == pos, f"{key} unit {u}: gap or overlap at {pos} (next {a})"
                    pos = b
                assert pos == unit.stop, f"{key} unit {u}: rows up to {unit.stop} not covered"
                if unit.free:
                    assert ep.in_heap[u], f"{key} unit {u}: free rows not schedulable"
                assert all(unit.leased.values()), f"{key} unit {u}: empty lease kept"
                n_acked += _size(unit.acked)
                n_leased += sum(_size(v) for v in unit.leased.values())
            assert n_acked == ep.n_acked and n_leased == ep.n_leased, f"{key}: counters"

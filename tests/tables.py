"""Test-side views of the core state machines' internals: the invariant checks the
property tests run after every step, and queries only tests need (the package never
asks them, so they live here, not on the tables)."""

from __future__ import annotations

from daskdist.core.intervals import Interval, normalize
from daskdist.core.leases.table import LeaseTable
from daskdist.core.protocol import PENDING, RUNNING
from daskdist.core.queue import ClosureQueue


def check_queue(q: ClosureQueue) -> None:
    """Assert the queue's indexes agree: a running closure is in its session's running
    set (and only there), a pinned one in its session's pins, the rest queued."""
    running = {cid for s in q._running.values() for cid in s}
    for cid, c in q.closures.items():
        assert c.state in (PENDING, RUNNING), (cid, c.state)
        if c.state == RUNNING:
            assert cid in q._running.get(c.session, ()), cid
        elif c.pinned is not None:
            assert cid in q._pinned.get(c.pinned, ()), cid
        else:
            assert cid not in running and (cid in q._queue or any(
                cid in routed for routed in q._aside.by_tag.values())), cid
    assert q._aside.count == sum(len(routed) for routed in q._aside.by_tag.values()), \
        "routed count"
    for session, cids in q._running.items():
        for cid in cids:
            assert q.closures[cid].session == session
    assert set(q._running) <= q._sessions, set(q._running) - q._sessions
    # the running counts that spare events a scan agree with a scan
    assert q.queued == sum(1 for c in q.closures.values()
                           if c.state == PENDING and c.pinned is None), "queued count"
    owners: dict[str, int] = {}
    for c in q.closures.values():
        owners[c.owner] = owners.get(c.owner, 0) + 1
    assert q._unfinished == owners, "unfinished counts"
    for session, cids in q._running.items():
        own = sum(1 for cid in cids if q.closures[cid].pinned is None)
        assert q._own.get(session, 0) == own, f"{session}: own count"
    best = max((q.prefetched(s) for s in q._sessions), default=0)
    for thief in list(q._sessions)[:3]:
        victim = q.steal_victim(thief)
        others = max((q.prefetched(s) for s in q._sessions if s != thief), default=0)
        assert (victim is None) == (others == 0), (thief, victim, others)
        if victim is not None:
            assert q.prefetched(victim[0]) == others and victim[0] != thief
    assert best >= 0


def check_leases(t: LeaseTable) -> None:
    """Assert the invariant on every epoch: acked ∪ leased ∪ free ∪ deferred = all
    rows, pairwise disjoint, each set well formed, counters consistent."""
    for dataset_id, ds in t.datasets.items():
        for epoch, ep in ds.epochs.items():
            key = (dataset_id, epoch)
            sets = [ep.free, ep.deferred, ep.acked, *ep.leased.values()]
            for rs in sets:
                items = rs.items()
                assert items == normalize(items), f"{key}: not normalized: {items}"
                assert rs.size == sum(b - a for a, b in items), f"{key}: size"
            pos = 0
            for a, b in sorted(iv for rs in sets for iv in rs):
                assert a >= pos, f"{key}: overlap at {a}"
                pos = b
            # every id is in one set or learned not to exist (a collection's partition
            # tails); a tail may still be leased to a session that has not reported it
            covered = normalize([*(iv for rs in sets for iv in rs), *ds.units.absent])
            total = ds.units.total
            assert covered == ([(0, total)] if total else []), f"{key}: ids not covered"
            for rs in (ep.free, ep.deferred, ep.acked):
                for a, b in ds.units.absent:
                    assert not rs.intersect(a, b), f"{key}: absent ids [{a}, {b}) in a pool"
            assert sum(rs.size for rs in sets) == ep.total, f"{key}: total {ep.total}"
            assert all(ep.leased.values()), f"{key}: empty lease kept"
            assert ep.n_leased == sum(rs.size for rs in ep.leased.values()), \
                f"{key}: leased counter"
            for session in ep.leased:
                assert key in t._session_keys.get(session, ()), f"{key}: keys"


def leased_to(t: LeaseTable, session: str, dataset_id: str, epoch: int) -> list[Interval]:
    """The rows leased to ``session`` in one epoch now (global intervals)."""
    ds = t.datasets.get(dataset_id)
    ep = ds.epochs.get(int(epoch)) if ds is not None else None
    held = ep.leased.get(session) if ep is not None else None
    return [] if held is None else held.items()


def define_collection(t: LeaseTable, dataset_id: str, units: int,
                      runs: list | None = None, **kw) -> None:
    """Define a Dask collection's partitions as the loader's definition does: whole
    units, of unknown length unless ``runs`` are given."""
    t.define(dataset_id, runs, units=units, whole=True, **kw)

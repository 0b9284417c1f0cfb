"""Scheduler-side statistics for the dashboard: per worker, per dataset, group events, history.

Pure bookkeeping (no Dask, Bokeh or torch import). :class:`CoordinatorState` owns one
:class:`CoordinatorStats`, on the scheduler's event loop, and wires its counters into
its books: the closure book counts each result in ``finished`` (a dict: nothing here
runs on a closure's path), the lease table calls ``on_rows`` for each row it
acknowledges, and the stats fold those counts in at each sample, snapshot and session
end; a session's end calls ``on_session_end``, a formation ``on_formation``. ``sample``
appends one point of history (the web pages' sampler calls it every
``daskdist.dashboard.sample-interval``); :func:`snapshot` turns a coordinator into the
JSON-able dict that ``/daskdist/status.json``, the plain page, the Bokeh documents and
the Prometheus collector all read, from the coordinator's own methods. Nothing here
changes the coordinator's state.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from daskdist.core.gang import GroupRecord
from daskdist.core.membership import Membership

RATE_WINDOW = 5.0  # seconds over which the per-worker rates are measured
MARKS = 16  # per-worker counts kept at samples (enough for RATE_WINDOW at 1 s samples)
TOP_WORKERS = 32  # workers a snapshot lists (the busiest), beside the totals of all
TOP_RANKS = 32  # gang ranks a snapshot lists (the stragglers, then the slowest)
DEPARTED = 256  # departed workers whose counters are kept (the newest)


@dataclass
class WorkerCounters:
    """What one worker address finished (cumulative over its sessions), and its counts
    at the last few samples it changed after (for its rates; kept lazily, by its own
    events, so a sample costs O(1) however many workers there are)."""

    closures: int = 0  # closures accepted as done
    failed: int = 0  # closures that raised there
    rows: int = 0  # dynamic-policy rows acknowledged with its results
    # (sample time, closures, rows) at a sample after which it changed, oldest first
    marks: deque = field(default_factory=lambda: deque(maxlen=MARKS))


@dataclass
class GroupEvent:
    """A collective group's loss of a member, or a (re-)formation and how long it took."""

    time: float  # wall-clock seconds (time.time())
    kind: str  # "loss", "formed" or "formation-failed"
    generation: int
    members: int
    seconds: float = 0.0  # formation time (0 for a loss)
    worker: str = ""  # the lost member's address


@dataclass
class CheckpointRecord:
    """The newest complete checkpoint a State's writer reported (``State.checkpoint_to``)."""

    state: str
    url: str
    commits: int  # the commit it holds (the State's step count)
    seconds: float  # how long the write took
    nbytes: int
    time: float  # wall-clock seconds when it completed


@dataclass(slots=True)
class Sample:
    """One point of history: the coordinator's counters (aggregates only: a sample's
    size does not grow with the workers)."""

    time: float
    done: int
    failed: int
    retried: int
    recovered: int
    queued: int
    running: int


class CoordinatorStats:
    """Counters the coordinator's status does not keep, and a bounded history."""

    def __init__(self, history: int = 600, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.workers: dict[str, WorkerCounters] = {}
        self.departed: OrderedDict[str, None] = OrderedDict()  # oldest first, bounded
        self.dataset_rows: dict[str, int] = {}  # rows acknowledged per dataset, all epochs
        self.events: deque[GroupEvent] = deque(maxlen=200)
        self.history: deque[Sample] = deque(maxlen=max(2, int(history)))
        self.losses = 0  # group members lost
        self.formations = 0  # successful formations (the first and every re-formation)
        self.checkpoint: CheckpointRecord | None = None  # the newest one written
        self.checkpoints = 0  # checkpoints written (reported)
        # session -> [done, failed, rows]: closures accepted and rows acknowledged since
        # the last fold (the closure book and ``on_rows`` add each here; :meth:`fold`
        # moves them to the worker's counters); one dict for the stats' life, which the
        # closure book holds
        self.finished: dict[str, list[int]] = {}

    # -- hooks (scheduler event loop) -----------------------------------------------------
    def _worker(self, members: Membership, session: str) -> WorkerCounters:
        member = members.members.get(session)
        address = member.address if member is not None else session
        w = self.workers.get(address)
        if w is None:
            w = self.workers[address] = WorkerCounters()
        elif address in self.departed:
            del self.departed[address]  # back (a new session of the same address)
        if self.history:  # its counts at the newest sample, if it changed since
            t = self.history[-1].time
            if not w.marks or w.marks[-1][0] < t:
                w.marks.append((t, w.closures, w.rows))
        return w

    def fold(self, members: Membership, session: str | None = None) -> None:
        """Move the counts of finished closures and acknowledged rows (``finished``: of
        ``session``, or of every session) to their workers' counters (``members``: the
        coordinator's, naming each session's worker). O(sessions that finished closures
        since the last fold): at a sample, a snapshot, a session's end."""
        finished = self.finished
        if session is not None:
            counts = finished.pop(session, None)
            items = [] if counts is None else [(session, counts)]
        else:
            items = list(finished.items())
            finished.clear()
        for s, (done, failed, rows) in items:
            w = self._worker(members, s)
            w.closures += done
            w.failed += failed
            w.rows += rows

    def on_rows(self, dataset_id: str, counts: list[tuple[str, int]]) -> None:
        """The lease table acknowledged rows of ``dataset_id``, ``(session, rows)`` each
        (a closure's result, or a gang commit's ranks: every acknowledgement comes
        here). Counted in ``finished`` beside the closures, folded in at the next
        sample: a gang commit's thousand parts cost a dict update each."""
        finished, total = self.finished, 0
        for session, rows in counts:
            entry = finished.get(session)  # [done, failed, rows], as the closure book's
            if entry is None:
                entry = finished[session] = [0, 0, 0]
            entry[2] += rows
            total += rows
        self.dataset_rows[dataset_id] = self.dataset_rows.get(dataset_id, 0) + total

    def forget_datasets(self, dataset_ids: list[str]) -> None:
        """Datasets gone (their handles dropped, their coordinator closed): their row
        counts go too."""
        for d in dataset_ids:
            self.dataset_rows.pop(d, None)

    def on_session_end(self, members: Membership, session: str, group: GroupRecord) -> None:
        """Before ``session`` leaves ``members``: its counts folded in; a loss event when
        it was a member of ``group``."""
        self.fold(members, session)
        member = members.members.get(session)
        if member is not None and member.address in self.workers:
            self.departed[member.address] = None
            while len(self.departed) > DEPARTED:
                self.workers.pop(self.departed.popitem(last=False)[0], None)
        if session in group.ranks:
            self.losses += 1
            self.events.append(GroupEvent(self.clock(), "loss", group.generation,
                                          len(group.sessions) - 1,
                                          worker=member.address if member else session))

    def on_formation(self, generation: int, ok: bool, seconds: float, members: int) -> None:
        self.formations += ok
        self.events.append(GroupEvent(self.clock(), "formed" if ok else "formation-failed",
                                      generation, members, seconds))

    def on_checkpoint(self, state: str, url: str, commits: int, seconds: float,
                      nbytes: int) -> None:
        """A State's writer finished a checkpoint (the newest kept for display)."""
        self.checkpoints += 1
        newest = self.checkpoint
        if newest is None or commits >= newest.commits or state != newest.state:
            self.checkpoint = CheckpointRecord(state, url, commits, seconds, nbytes,
                                               self.clock())

    def sample(self, co: Any) -> Sample:
        """One point of history from ``co``'s status, after folding in what its workers
        finished since the last one (their rates' marks are the previous sample's)."""
        self.fold(co.members)
        status = co.status()
        s = Sample(self.clock(), status["done"], status["failed"], status["retried"],
                   status["recovered"], status["queued"], status["running"])
        self.history.append(s)
        return s

    # -- queries ----------------------------------------------------------------------------
    def series(self) -> dict[str, list[float]]:
        """Per-second rates between consecutive samples (``time`` is each interval's end)."""
        out: dict[str, list[float]] = {k: [] for k in (
            "time", "done", "failed", "retried", "recovered", "queued", "running")}
        points = list(self.history)
        for a, b in zip(points, points[1:], strict=False):
            dt = max(b.time - a.time, 1e-9)
            out["time"].append(b.time)
            for k in ("done", "failed", "retried", "recovered"):
                out[k].append(max(0, getattr(b, k) - getattr(a, k)) / dt)
            out["queued"].append(b.queued)
            out["running"].append(b.running)
        return out

    def worker_rates(self, window: float = RATE_WINDOW) -> dict[str, tuple[float, float]]:
        """Closures and rows per second of each worker over the last ``window`` seconds
        (from the sample at or after its start to the newest one). O(workers): for the
        dashboard's reads, not per event."""
        if len(self.history) < 2:
            return {}
        last = self.history[-1]
        first = next((s for s in self.history if s.time >= last.time - window - 1e-6),
                     self.history[0])
        if first is last:
            first = self.history[-2]
        t0, dt = first.time, max(last.time - first.time, 1e-9)
        out = {}
        for address, w in self.workers.items():
            # its counts at t0: those at its first mark since (no change in between), or
            # now if it did not change since t0
            c0, r0 = w.closures, w.rows
            for t, c, r in w.marks:
                if t >= t0 - 1e-6:
                    c0, r0 = c, r
                    break
            out[address] = ((w.closures - c0) / dt, (w.rows - r0) / dt)
        return out


def snapshot(co: Any, group: dict | None = None) -> dict[str, Any]:
    """Everything the dashboard shows about one coordinator, JSON-able.

    ``group`` is the group's description (generation, members, backend, ...).
    """
    stats: CoordinatorStats = co.stats
    stats.fold(co.members)
    status = dict(co.status())
    status.setdefault("lease_expiries", 0)
    rates = stats.worker_rates()
    members = co.members
    # the busiest TOP_WORKERS workers (by closures, then rows per second), live or not
    live = {m.address for m in members.members.values()}
    top = heapq.nlargest(TOP_WORKERS, set(stats.workers) | live,
                         key=lambda a: (*rates.get(a, (0.0, 0.0)), a))
    workers = []
    for address in sorted(top):
        w = stats.workers.get(address, WorkerCounters())
        session = members.session_of(address)
        m = members.members[session] if session is not None else None
        cps, rps = rates.get(address, (0.0, 0.0))
        workers.append({
            "address": address, "index": m.index if m else None,
            "device": m.device if m else None, "alive": m is not None,
            "closures": w.closures, "failed": w.failed, "rows": w.rows,
            "closures_per_second": cps, "rows_per_second": rps,
        })
    group = dict(group or {})
    group["formations"] = stats.formations
    group["reformations"] = max(0, stats.formations - 1)
    group["losses"] = stats.losses
    ck = stats.checkpoint
    group["checkpoints"] = stats.checkpoints
    group["checkpoint"] = None if ck is None else {
        **asdict(ck), "age_seconds": max(0.0, stats.clock() - ck.time)}
    totals = {"workers": len(live), "closures": sum(w.closures for w in stats.workers.values()),
              "rows": sum(w.rows for w in stats.workers.values()), "shown": len(workers)}
    return {
        "name": co.name,
        "status": status,
        "workers": workers,
        "worker_totals": totals,
        "datasets": co.dataset_progress(),
        "dataset_rows_acknowledged": dict(stats.dataset_rows),
        "group": group,
        "events": [asdict(e) for e in stats.events],
        "history": stats.series(),
        # the gang's per-rank phases and stragglers (SPEC §5.1)
        "ranks": co.rank_report(limit=TOP_RANKS),
        # asynchronously trained models: versions, staleness, per-worker rounds (§2.8)
        "async_models": co.async_reports(),
        # batch-inference jobs: units, rows, rows/s, per worker (SPEC §7)
        "inference": co.inference_report(),
    }


def snapshots(plugin: Any) -> dict[str, dict]:
    """``snapshot`` of every coordinator on the plugin, by name."""
    return {name: snapshot(co, co.group_info())
            for name, co in sorted(plugin.coordinators.items())}

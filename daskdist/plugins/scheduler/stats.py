"""Scheduler-side statistics for the dashboard: per worker, per dataset, group events, history.

Pure bookkeeping (no Dask, Bokeh or torch import). :class:`CoordinatorState` owns one
:class:`CoordinatorStats` and calls it, on the scheduler's event loop, where results are
applied (``on_results``), the lease table acknowledges rows (``on_rows``) and sessions
end (``on_session_end``); the group driver calls
``on_formation``. ``sample`` appends one point of history (the observe module's sampler
calls it every ``daskdist.dashboard.sample-interval``); :func:`snapshot` turns a
coordinator into the JSON-able dict that ``/daskdist/status.json``, the plain page, the
Bokeh documents and the Prometheus collector all read. Nothing here changes the
coordinator's state.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

RATE_WINDOW = 5.0  # seconds over which the per-worker rates are measured


@dataclass
class WorkerCounters:
    """What one worker address finished (cumulative over its sessions)."""

    closures: int = 0  # closures accepted as done
    failed: int = 0  # closures that raised there
    rows: int = 0  # dynamic-policy rows acknowledged with its results


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


@dataclass
class Sample:
    """One point of history: the coordinator's counters and each worker's totals."""

    time: float
    done: int
    failed: int
    retried: int
    recovered: int
    queued: int
    running: int
    workers: dict[str, tuple[int, int]] = field(default_factory=dict)  # addr: (closures, rows)


class CoordinatorStats:
    """Counters the coordinator's status does not keep, and a bounded history."""

    def __init__(self, history: int = 600, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.workers: dict[str, WorkerCounters] = {}
        self.dataset_rows: dict[str, int] = {}  # rows acknowledged per dataset, all epochs
        self.events: deque[GroupEvent] = deque(maxlen=200)
        self.history: deque[Sample] = deque(maxlen=max(2, int(history)))
        self.losses = 0  # group members lost
        self.formations = 0  # successful formations (the first and every re-formation)
        self.checkpoint: CheckpointRecord | None = None  # the newest one written
        self.checkpoints = 0  # checkpoints written (reported)

    # -- hooks (scheduler event loop) -----------------------------------------------------
    def _worker(self, co: Any, session: str) -> WorkerCounters:
        member = co.members.members.get(session)
        address = member.address if member is not None else session
        return self.workers.setdefault(address, WorkerCounters())

    def on_results(self, co: Any, session: str, accepted: bool, ok: bool) -> None:
        """A closure's result from ``session`` (not ``accepted``: a fenced duplicate)."""
        if not accepted:
            return
        w = self._worker(co, session)
        if ok:
            w.closures += 1
        else:
            w.failed += 1

    def on_rows(self, co: Any, session: str, dataset_id: str, rows: int) -> None:
        """The lease table acknowledged ``rows`` of ``dataset_id`` leased to ``session``
        (a closure's result or a gang commit: every acknowledgement comes here)."""
        self._worker(co, session).rows += rows
        self.dataset_rows[dataset_id] = self.dataset_rows.get(dataset_id, 0) + rows

    def on_session_end(self, co: Any, session: str) -> None:
        """Before ``session`` leaves: a loss event when it was a member of the group."""
        group = co.gangs.group
        if session in group.sessions:
            member = co.members.members.get(session)
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

    def sample(self, status: dict) -> Sample:
        s = Sample(self.clock(), status["done"], status["failed"], status["retried"],
                   status["recovered"], status["queued"], status["running"],
                   {a: (w.closures, w.rows) for a, w in self.workers.items()})
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
        """Closures and rows per second of each worker over the last ``window`` seconds."""
        if len(self.history) < 2:
            return {}
        last = self.history[-1]
        first = next((s for s in self.history if s.time >= last.time - window - 1e-6),
                     self.history[0])
        if first is last:
            first = self.history[-2]
        dt = max(last.time - first.time, 1e-9)
        out = {}
        for address, (closures, rows) in last.workers.items():
            c0, r0 = first.workers.get(address, (0, 0))
            out[address] = ((closures - c0) / dt, (rows - r0) / dt)
        return out


def datasets(co: Any) -> list[dict]:
    """The newest epoch of every dynamic dataset in the coordinator's lease table
    (a completed epoch too, although its table is dropped)."""
    return [co.leases.progress(d, e) for d, e in sorted(co.leases.newest_epochs().items())]


def snapshot(co: Any, group: dict | None = None) -> dict[str, Any]:
    """Everything the dashboard shows about one coordinator, JSON-able.

    ``group`` is the group driver's ``info()`` (generation, members, backend, ...).
    """
    stats: CoordinatorStats = co.stats
    status = dict(co.status())
    status.setdefault("lease_expiries", 0)
    rates = stats.worker_rates()
    members = {m.address: m for m in co.members.members.values()}
    workers = []
    for address in sorted(set(stats.workers) | set(members)):
        w = stats.workers.get(address, WorkerCounters())
        m = members.get(address)
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
    return {
        "name": co.name,
        "status": status,
        "workers": workers,
        "datasets": datasets(co),
        "dataset_rows_acknowledged": dict(stats.dataset_rows),
        "group": group,
        "events": [asdict(e) for e in stats.events],
        "history": stats.series(),
    }

"""A batch-inference job's attempts and commits (pure): Hadoop's v1 output committer,
restated over the lease table's row ranges.

A job's closures run on the coordinator's members. Each takes a *unit* (a lease of
whole input units: row groups, a partition), runs the model over it, stages the output
under its *attempt* (the closure's id and attempt number) and asks to commit it.
:class:`JobState` decides:

- **first committer wins**: a commit is refused while the job is not running, once
  the attempt's session ended (fenced: its worker was lost or its lease lapsed), or
  when any of its rows is committed already (a duplicate run); otherwise the unit is
  *decided* (the scheduler acknowledges its rows in the lease table in the same step,
  all or nothing) and its attempt publishes it;
- **published or orphaned**: the attempt that won publishes its staged output and
  ends well (*published*); one that fails, or whose session ends, first leaves its
  unit *orphaned*, and the job's finalization publishes it (publishing is idempotent);
  a lost or refused attempt's staging is never committed;
- **resume**: a job starts with the rows its output's ledger holds (earlier runs): they
  are never committed (nor leased) again;
- **the end**: once every row is committed and no attempt is still publishing, the job
  finalizes (manifest and ``_SUCCESS``), then completes. It fails (the input's units
  failed for good, a finalization that kept failing) or is cancelled instead: by a
  client, or once every owner that started it or attached to it is gone (the
  coordinator's owners' rule: a closed one at once, one whose client left after the
  client's grace, a keep-alive one after its keep-alive timeout with nobody attaching).

It also counts how many of the job's closures to keep queued (:meth:`JobState.top_up`)
and what progress reports: units, rows, rows per second, per worker.

Imports nothing from Dask, torch, pyarrow or the rest of the package but the row
intervals.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from daskdist.core.intervals import Interval, RowSet, normalize, size_of

__all__ = ["CANCELLED", "COMPLETE", "FAILED", "FINAL", "FINALIZING", "RUNNING", "JobState",
           "Unit", "unit_file"]

RUNNING, FINALIZING = "running", "finalizing"
COMPLETE, FAILED, CANCELLED = "complete", "failed", "cancelled"
FINAL = frozenset({COMPLETE, FAILED, CANCELLED})

# a decided unit's publication
PUBLISHING, PUBLISHED, ORPHANED = "publishing", "published", "orphaned"

MAX_ERRORS = 8  # the newest unit errors a job keeps for its progress


def unit_file(first: int) -> str:
    """The committed file of the unit whose first row id is ``first`` (its name sorts in
    row order; no two units share a first row)."""
    return f"part-{first:016x}.parquet"


@dataclass
class Unit:
    """A decided unit: what its ledger record keeps, and who publishes it."""

    first: int  # its first row id: its name (unit_file)
    rows: list[Interval]
    attempt: str
    session: str
    staged: str  # where its attempt staged the output
    out_rows: int
    lengths: list[tuple[int, int]]  # (partition, rows) learned by reading it
    state: str = PUBLISHING

    @property
    def file(self) -> str:
        return unit_file(self.first)

    def record(self) -> dict:
        """The unit as its ledger record (JSON-able)."""
        return {"first": self.first, "file": self.file, "rows": [list(r) for r in self.rows],
                "staged": self.staged, "out_rows": self.out_rows, "attempt": self.attempt,
                "lengths": [list(p) for p in self.lengths]}


@dataclass
class WorkerCounts:
    """What one worker session committed."""

    address: str = ""
    units: int = 0
    rows: int = 0
    failures: int = 0
    first: float | None = None  # when its first unit was committed
    last: float | None = None


@dataclass
class JobState:
    """One job's commits, its life and its closures (module doc).

    ``committed``: the rows its output's ledger holds (earlier runs), ``units`` and
    ``out_rows`` of those; ``max_failures``: finalizations (and closures in a row) that
    may fail before the job does; ``clock``: seconds, for rates."""

    name: str
    committed: Iterable[Sequence[int]] = ()
    units: int = 0
    out_rows: int = 0
    max_failures: int = 3
    clock: Callable[[], float] = time.monotonic
    state: str = RUNNING
    error: str | None = None
    decided: dict[str, Unit] = field(default_factory=dict)  # this run's, by attempt
    sessions: dict[str, WorkerCounts] = field(default_factory=dict)
    errors: deque = field(default_factory=lambda: deque(maxlen=MAX_ERRORS))
    outstanding: int = 0  # the job's unit closures queued or running
    finalize_failures: int = 0
    failed_in_a_row: int = 0  # job closures that raised since the last commit
    version: int = 0  # bumped at every change a waiter may care about
    # the coordinator's owners that started the job or attached to it: it runs while one
    # of them is left
    owners: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.rows = RowSet(normalize(self.committed))
        self.resumed = (self.units, self.rows.size, self.out_rows)
        self.ended: set[str] = set()
        self.started = self.clock()
        self.finished: float | None = None

    # -- commits -------------------------------------------------------------------------
    def refusal(self, session: str, rows: Sequence[Sequence[int]]) -> str | None:
        """Why a commit of ``rows`` by ``session`` is refused (``None``: it may commit)."""
        if self.state != RUNNING:
            return f"job {self.name!r} is {self.state}"
        if session in self.ended:
            return f"session {session} ended (fenced)"
        rows = normalize(rows)
        if not rows:
            return "a unit without rows"
        if any(self.rows.intersect(a, b) for a, b in rows):
            return "rows committed already (a duplicate run)"
        return None

    def commit(self, session: str, attempt: str, rows: Sequence[Sequence[int]], staged: str,
               out_rows: int, lengths: Iterable[Sequence[int]] = (),
               address: str = "") -> Unit:
        """Decide the unit (its rows acknowledged in the lease table by the caller, in
        the same step); :meth:`refusal` must have said yes. Its attempt publishes it."""
        rows = normalize(rows)
        why = self.refusal(session, rows)
        if why is not None:
            raise ValueError(f"commit refused: {why}")
        for a, b in rows:
            self.rows.add(a, b)
        unit = Unit(rows[0][0], rows, attempt, session, staged, int(out_rows),
                    [(int(p), int(n)) for p, n in lengths])
        self.decided[attempt] = unit
        self.failed_in_a_row = 0
        self.units += 1
        self.out_rows += unit.out_rows
        counts = self._counts(session, address)
        counts.units += 1
        counts.rows += size_of(rows)
        now = self.clock()
        counts.first = now if counts.first is None else counts.first
        counts.last = now
        self.version += 1
        return unit

    def unit_failed(self, session: str, unit: str, message: str, address: str = "") -> None:
        """A unit's read or predict failed on ``session`` (its rows went back, the
        failure counted by the lease table): kept for progress."""
        self._counts(session, address).failures += 1
        self.errors.append((unit, message))
        self.version += 1

    def closure_failed(self, why: str) -> bool:
        """A job closure raised (not a unit's failure: those it catches): its engine
        could not be built (the model's factory raised), or its output could not be
        written. ``max_failures`` in a row with no commit between fail the job with
        ``why``, rather than retrying forever. Whether it failed."""
        self.failed_in_a_row += 1
        if self.state == RUNNING and self.failed_in_a_row >= self.max_failures:
            self.fail(f"its closures failed {self.failed_in_a_row} times in a row: {why}")
            return True
        self.version += 1
        return False

    def attempt_ended(self, attempt: str, ok: bool) -> None:
        """The closure of ``attempt`` ended: a unit it won is published when it ended
        well, orphaned when it did not (the finalization publishes it)."""
        unit = self.decided.get(attempt)
        if unit is not None and unit.state == PUBLISHING:
            unit.state = PUBLISHED if ok else ORPHANED
            self.version += 1

    def session_ended(self, session: str) -> None:
        """``session`` is gone: its later commits are refused, and what it won and had
        not published is orphaned."""
        self.ended.add(session)
        for unit in self.decided.values():
            if unit.session == session and unit.state == PUBLISHING:
                unit.state = ORPHANED
        self.version += 1

    def orphans(self) -> list[Unit]:
        """Decided units whose attempt did not publish them."""
        return [u for u in self.decided.values() if u.state == ORPHANED]

    def publishing(self) -> int:
        """Decided units whose attempt may still be publishing them."""
        return sum(u.state == PUBLISHING for u in self.decided.values())

    # -- the job's life --------------------------------------------------------------------
    def ready_to_finalize(self, rows_complete: bool) -> bool:
        """Every row committed (the lease table's word) and no attempt still publishing."""
        return self.state == RUNNING and rows_complete and not self.publishing()

    def begin_finalize(self) -> None:
        if self.state != RUNNING:
            raise ValueError(f"job {self.name!r} is {self.state}; only a running job finalizes")
        self.state = FINALIZING
        self.version += 1

    def finalized(self, ok: bool, why: str = "") -> bool:
        """The finalization ended: the job completes, or, after ``max_failures``
        failures, fails with ``why``. Whether to finalize again."""
        if self.state != FINALIZING:
            return False
        if ok:
            for unit in self.decided.values():
                unit.state = PUBLISHED
            self._end(COMPLETE)
            return False
        self.finalize_failures += 1
        if self.finalize_failures >= self.max_failures:
            self.fail(f"finalizing the output failed {self.finalize_failures} times: {why}")
            return False
        self.version += 1
        return True

    def fail(self, why: str) -> None:
        if self.state not in FINAL:
            self.error = why
            self._end(FAILED)

    def cancel(self, why: str | None = None) -> None:
        if self.state not in FINAL:
            self.error = why
            self._end(CANCELLED)

    def owner_gone(self, owner: str) -> bool:
        """``owner`` of the coordinator was dropped (closed, or its client gone past
        its grace or keep-alive timeout): once no owner holding the job is left, the
        job is cancelled, saying so. Whether it was."""
        if owner not in self.owners:
            return False
        self.owners.discard(owner)
        if self.owners or self.state in FINAL:
            return False
        self.cancel(f"batch-inference job {self.name!r} cancelled: every owner holding it "
                    "closed, or its client stayed away past client-grace (keep-alive-timeout "
                    "for a keep_alive one); the same map_batches call resumes it")
        return True

    def _end(self, state: str) -> None:
        self.state = state
        self.finished = self.clock()
        self.version += 1

    # -- closures ---------------------------------------------------------------------------
    def top_up(self, target: int, leaseable: bool, committed: bool = False) -> int:
        """How many closures to queue now: up to ``target`` outstanding while rows are
        free to lease (``leaseable``). Without free rows, the rows left are leased to
        members (in progress, or read ahead): the queue routes the job's closures to
        them, and one replaces a closure that committed (``committed``: the next unit
        may be one its member read ahead), or the last one out, so that a unit read
        ahead always meets a closure. None once not running."""
        if self.state != RUNNING:
            return 0
        if leaseable:
            return max(0, int(target) - self.outstanding)
        return int((committed or self.outstanding == 0) and self.outstanding < max(1, int(target)))

    # -- progress ---------------------------------------------------------------------------
    def rates(self) -> tuple[float, float]:
        """(rows, units) a second, this run, over its commits so far."""
        units, rows, _ = self.resumed
        elapsed = max(1e-9, (self.finished or self.clock()) - self.started)
        return (self.rows.size - rows) / elapsed, (self.units - units) / elapsed

    def per_worker(self) -> list[dict]:
        """Per worker session: its address, units and rows committed, failures, rows/s
        (over the time between its first and last commit and now)."""
        now = self.finished or self.clock()
        out = []
        for session, c in sorted(self.sessions.items()):
            span = max(1e-9, now - (c.first if c.first is not None else now))
            out.append({"session": session, "address": c.address, "units": c.units,
                        "rows": c.rows, "failures": c.failures,
                        "rows_per_second": c.rows / span if c.units else 0.0})
        return out

    def _counts(self, session: str, address: str) -> WorkerCounts:
        counts = self.sessions.get(session)
        if counts is None:
            counts = self.sessions[session] = WorkerCounts(address)
        elif address and not counts.address:
            counts.address = address
        return counts

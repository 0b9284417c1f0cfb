"""ClosureQueue: the coordinator's closure state machine, pure and synchronous.

TensorFlow's ``_CoordinatedClosureQueue`` (put / get / put_back / mark_failed / wait /
cancel) restated as a single-threaded state machine that the scheduler plugin drives
from its event loop. It imports nothing from Dask (from the package only the pure
``protocol`` module: closure states and error kinds), so every
transition is unit-tested directly. Payloads are opaque bytes; sessions are opaque
strings naming one worker plugin's life on one worker.

A closure's life (SPEC §2.5a)::

    PENDING -> RUNNING -> READY | FAILED
    RUNNING -> PENDING            (its session was lost; attempt + 1)
    RUNNING -> FAILED             (lost ``max_worker_failures`` times: WORKER_LOST)
    PENDING -> CANCELLED          (an error was raised to its owner, or its owner left)

Every closure reaches exactly one final state, once; a finish for a closure that is not
running on the reporting session (a duplicate run, an expired session) is refused.

Errors belong to their owner (SPEC §2.5b): each owner (one client-side Coordinator) has
its own first unraised error, and raising it holds and cancels only that owner's work.
Only an unplanned loss of a closure that had started counts toward
``max_worker_failures`` (SPEC §2.4): workers report which of their closures started
(:meth:`ClosureQueue.observe`).

Two parts hold what the queue looks up apart from its closures: :class:`Victims`, the
sessions holding prefetched closures (whom an idle session steals from), and
:class:`SetAside`, the closures set aside for the sessions holding their dataset's rows
at an epoch's tail.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from daskdist.core.protocol import (
    CANCELLED,
    FAILED,
    PENDING,
    READY,
    RUNNING,
    USER_ERROR,
    WORKER_LOST,
    Outcome,
)


@dataclass(slots=True, eq=False)
class Closure:
    """One scheduled function call and its bookkeeping (never its result)."""

    cid: str
    owner: str
    payload: Any
    retries: int = 0
    state: str = PENDING
    attempt: int = 0  # executions started so far
    worker_failures: int = 0
    session: str | None = None
    pinned: str | None = None  # only this session may run it (gang members)
    tag: str | None = None  # the dynamic dataset whose per-worker iterator it reads
    # what its session last reported: it had received it (``seen``) and started it
    seen: bool = False
    started: bool = False


@dataclass
class QueueCounters:
    """Cumulative counts for ``Coordinator.status()``."""

    scheduled: int = 0
    done: int = 0
    failed: int = 0
    cancelled: int = 0
    retried: int = 0
    recovered: int = 0  # closures put back because their worker was lost
    refused: int = 0  # finishes refused by fencing (duplicates, expired sessions)


class Victims:
    """The sessions holding prefetched closures, most first: a heap of the sessions whose
    prefetch grew, its stale entries (a session's count fell since) dropped or re-filed
    as they surface, so the next steal's victim costs O(log n) amortized."""

    def __init__(self, prefetched: Callable[[str], int]) -> None:
        self.prefetched = prefetched  # a session's prefetched closures now
        self.heap: list[tuple[int, str]] = []

    def grew(self, session: str) -> None:
        """``session``'s prefetch grew: it may be the next victim."""
        n = self.prefetched(session)
        if n > 0:
            heapq.heappush(self.heap, (-n, session))

    def victim(self, thief: str) -> tuple[str, int] | None:
        """The session (other than ``thief``) holding the most prefetched closures and
        how many to take back from it (half, rounded up); ``None`` if none has any."""
        heap = self.heap
        thief_entry = None
        found = None
        while heap:
            neg, session = heap[0]
            n = self.prefetched(session)
            if n != -neg:  # stale: re-file at its current count (or drop it)
                heapq.heappop(heap)
                if n > 0:
                    heapq.heappush(heap, (-n, session))
                continue
            if session == thief:
                thief_entry = heapq.heappop(heap)
                continue
            found = (session, (n + 1) // 2)
            break
        if thief_entry is not None:
            heapq.heappush(heap, thief_entry)
        return found


@dataclass
class SetAside:
    """Queued closures set aside for the sessions holding their dataset's rows (the
    epoch's tail): their ids by dataset tag, oldest first, and how many (stale entries
    included: they are skipped as they come up)."""

    by_tag: dict[str, deque[str]] = field(default_factory=dict)
    count: int = 0

    def add(self, tag: str, cid: str) -> None:
        self.by_tag.setdefault(tag, deque()).append(cid)
        self.count += 1

    def pop(self, tag: str) -> str | None:
        """The oldest id set aside for ``tag``; ``None`` (and the tag dropped) if none."""
        cids = self.by_tag.get(tag)
        if not cids:
            self.by_tag.pop(tag, None)
            return None
        self.count -= 1
        return cids.popleft()

    def put_back(self, tag: str, cids: list[str]) -> None:
        """Ids popped and not taken go back to the head of ``tag``'s, in order; a tag
        left with none is dropped."""
        if cids:
            self.by_tag.setdefault(tag, deque()).extendleft(reversed(cids))
            self.count += len(cids)
        elif not self.by_tag.get(tag, True):
            del self.by_tag[tag]

    def refile(self, keep: Callable[[deque[str]], deque[str]]) -> None:
        """Each tag's ids become ``keep(ids)``; a tag left with none is dropped."""
        for tag in list(self.by_tag):
            kept = self.by_tag[tag] = keep(self.by_tag[tag])
            if not kept:
                del self.by_tag[tag]
        self.count = sum(len(d) for d in self.by_tag.values())


@dataclass
class ClosureQueue:
    """Queued and running closures, the first unraised error, and fencing by session."""

    max_worker_failures: int = 3
    closures: dict[str, Closure] = field(default_factory=dict)
    counters: QueueCounters = field(default_factory=QueueCounters)
    _queue: deque[str] = field(default_factory=deque)
    # session -> its leased cids in dispatch order (a worker runs them first-in first-out)
    _running: dict[str, dict[str, None]] = field(default_factory=dict)
    _slots: dict[str, int] = field(default_factory=dict)  # session -> threads running closures
    _pinned: dict[str, deque[str]] = field(default_factory=dict)  # session -> pinned cids
    _sessions: set[str] = field(default_factory=set)
    _draining: set[str] = field(default_factory=set)
    errors: dict[str, Outcome] = field(default_factory=dict)  # owner -> first unraised
    held: set[str] = field(default_factory=set)  # owners whose closures are not dispatched
    # running counts, so that no event scans every closure or session
    queued: int = 0  # PENDING closures in the queue (not pinned)
    _unfinished: dict[str, int] = field(default_factory=dict)  # owner -> closures not final
    _own: dict[str, int] = field(default_factory=dict)  # session -> leased, not pinned
    # ``router(tag, session)``: whether ``session`` should run a closure tagged ``tag``
    # now (False: the tag's dataset has no free rows left and other sessions hold its
    # leased rows); such closures are set aside for the sessions it says yes to
    router: Callable[[str, str], bool] | None = None
    _aside: SetAside = field(default_factory=SetAside)  # the closures it set aside

    def __post_init__(self) -> None:
        self._victims = Victims(self.prefetched)  # the next steal's victim

    # -- sessions -------------------------------------------------------------------
    def add_session(self, session: str, slots: int = 1) -> None:
        """A worker plugin session may now take closures; it runs ``slots`` at a time."""
        self._sessions.add(session)
        self._running.setdefault(session, {})
        self._own.setdefault(session, 0)
        self._slots[session] = max(1, slots)

    def drain_session(self, session: str, draining: bool = True) -> None:
        """The session's worker is retiring: it gets no new closures (until undrained)."""
        if session in self._sessions and draining:
            self._draining.add(session)
        else:
            self._draining.discard(session)

    def remove_session(self, session: str, expected: bool = False) -> list[Outcome]:
        """The session ended: put its closures back at the head of the queue, in order.

        ``expected`` (the worker retired, closed gracefully, its plugin re-registered):
        nothing counts toward ``max_worker_failures``. An unplanned loss
        (``expected=False``: killed, crashed, cut off, fenced) counts for the closures
        that had started, as the worker last reported (:meth:`observe`); for closures it
        had no time to report, the oldest that its free threads would have started; and
        for any that killed workers before (a worker may die starting one right after
        finishing another it had no time to report). Other prefetched closures (the
        worker said it had not started them) count nothing. A closure lost
        ``max_worker_failures`` times fails with ``WORKER_LOST``.
        Closures pinned to the session (gang members), running or not, fail with
        ``WORKER_LOST`` at once: the gang logic decides what happens next.
        """
        self._sessions.discard(session)
        self._draining.discard(session)
        leased = list(self._running.pop(session, {}))
        slots = self._slots.pop(session, 1)
        self._own.pop(session, None)
        outcomes: list[Outcome] = []
        back: list[Closure] = []
        pinned = [cid for cid in leased if self.closures[cid].pinned is not None]
        pinned += [cid for cid in self._pinned.pop(session, ()) if cid in self.closures]
        for cid in pinned:
            c = self.closures[cid]
            c.session = None
            outcomes.append(self._finish(c, FAILED, None, WORKER_LOST))
        cids = [cid for cid in leased if cid in self.closures]
        free = max(0, slots - sum(1 for cid in cids if self.closures[cid].started))
        for cid in cids:
            c = self.closures[cid]
            c.session = None
            if c.started or c.worker_failures > 0:
                # started; or it killed workers before, so it is suspect wherever it
                # stands: a worker may start it right after finishing a closure, and die
                # before it can say so (the finished one looks started, this one not)
                ran = True
            elif c.seen:
                ran = False  # prefetched: the worker said it had not started it
            else:  # not reported yet: the worker's free threads may have started it
                ran = free > 0
                free -= 1
            c.seen = c.started = False
            if not ran:
                c.attempt -= 1  # never executed: not an attempt
            if expected or not ran:
                c.state = PENDING
                back.append(c)
                continue
            c.worker_failures += 1
            if c.worker_failures >= self.max_worker_failures:
                outcomes.append(self._finish(c, FAILED, None, WORKER_LOST))
            else:
                c.state = PENDING
                back.append(c)
        self.counters.recovered += len(back)
        self.queued += len(back)
        back.sort(key=lambda c: _order(c.cid))
        for c in reversed(back):
            self._queue.appendleft(c.cid)
        return outcomes

    def observe(self, session: str, held: Iterable[str], started: Iterable[str],
                final: bool = False) -> None:
        """What the session says of its closures: every one it has received and not yet
        had acknowledged (``held``), and those of them that started.

        A received closure not started is known to wait (``seen``) only behind busy
        threads: the oldest ones a free thread takes next may start any moment after
        the message left, so they stay unknown (see :meth:`remove_session`). A
        ``final`` word (the session is stopping: nothing more starts) is exact: every
        closure leased to it and not in ``started`` never ran."""
        running = self._running.get(session)
        if not running:
            return
        if final:
            started = set(started)
            for cid in running:
                c = self.closures[cid]
                c.started, c.seen = cid in started, cid not in started
            return
        held = set(held)
        for cid in started:
            if cid in running:
                self.closures[cid].started = True
        free = self._slots.get(session, 1) - sum(
            1 for cid in running if self.closures[cid].started)
        for cid in running:
            c = self.closures[cid]
            if c.started or cid not in held or c.pinned is not None:
                continue
            if free > 0:
                free -= 1  # a free thread may take it any moment
            else:
                c.seen = True

    def takes_work(self, session: str) -> bool:
        """Whether ``session`` may be given queued closures now (live, not draining)."""
        return session in self._sessions and session not in self._draining

    @property
    def sessions(self) -> frozenset[str]:
        return frozenset(self._sessions)

    # -- put / dispatch -------------------------------------------------------------
    def put(self, cid: str, owner: str, payload: Any, retries: int = 0,
            pinned: str | None = None, tag: str | None = None) -> bool:
        """Queue a closure at the tail. A cid seen before is ignored (resends are safe).
        ``tag``: the dynamic dataset it reads (see :attr:`router`)."""
        if cid in self.closures:
            return False
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.closures[cid] = Closure(cid, owner, payload, retries, pinned=pinned, tag=tag)
        self._unfinished[owner] = self._unfinished.get(owner, 0) + 1
        if pinned is None:
            self._queue.append(cid)
            self.queued += 1
            self.counters.scheduled += 1
        else:
            self._pinned.setdefault(pinned, deque()).append(cid)
        return True

    def dispatch(self, session: str, n: int) -> list[Closure]:
        """Lease to ``session`` its pinned closures and up to ``n`` queued ones (head first).

        Pinned closures (gang members) go out even when ``n`` is 0 or the session is
        draining: every member of a gang must run for any of them to finish. Closures
        of ``held`` owners (raising an error) stay queued. A tagged closure the
        :attr:`router` does not give this session is set aside (O(1), once) for the
        sessions it does: they take those first, being older than the queue's head.
        """
        if session not in self._sessions:
            return []
        out: list[Closure] = []
        running = self._running[session]
        pinned = self._pinned.get(session)
        while pinned:
            out.append(self._lease(self.closures[pinned.popleft()], session, running))
        if n <= 0 or session in self._draining:
            return out
        budget = n
        if self._aside.by_tag:  # O(tags with closures set aside): datasets in their tail
            for tag in list(self._aside.by_tag):
                if budget and self.router(tag, session):  # type: ignore[misc]
                    budget = self._take(tag, session, running, budget, out)
        q = self._queue
        router = self.router
        skipped: list[str] = []  # of held owners (only what came back while they raise)
        while q and budget:
            cid = q.popleft()
            c = self.closures.get(cid)
            if c is None or c.state != PENDING:
                continue  # stale entry (cancelled, or re-queued elsewhere)
            if c.owner in self.held:
                skipped.append(cid)
                continue
            if c.tag is not None and router is not None and not router(c.tag, session):
                self._aside.add(c.tag, cid)
                continue
            out.append(self._lease(c, session, running))
            budget -= 1
        q.extendleft(reversed(skipped))
        taken = n - budget
        if taken:
            self.queued -= taken
            self._own[session] += taken
            self._victims.grew(session)
        return out

    def set_aside(self, tag: str) -> int:
        """How many closures are set aside for ``tag``'s holders (stale ones included)."""
        return len(self._aside.by_tag.get(tag, ()))

    def _take(self, tag: str, session: str, running: dict[str, None], budget: int,
              out: list[Closure]) -> int:
        """Lease closures set aside for ``tag`` to ``session``, oldest first; the budget
        left."""
        aside, skipped = self._aside, []
        while budget and (cid := aside.pop(tag)) is not None:
            c = self.closures.get(cid)
            if c is None or c.state != PENDING:
                continue
            if c.owner in self.held:
                skipped.append(cid)
                continue
            out.append(self._lease(c, session, running))
            budget -= 1
        aside.put_back(tag, skipped)
        return budget

    @staticmethod
    def _lease(c: Closure, session: str, running: dict[str, None]) -> Closure:
        c.state = RUNNING
        c.session = session
        c.attempt += 1
        c.seen = c.started = False
        running[c.cid] = None
        return c

    def prefetched(self, session: str) -> int:
        """Closures leased to ``session`` beyond its threads (unstarted, as far as the
        scheduler can tell: a worker runs its leases in order). O(1)."""
        return max(0, self._own.get(session, 0) - self._slots.get(session, 1))

    def steal_victim(self, thief: str) -> tuple[str, int] | None:
        """The session (other than ``thief``) holding the most prefetched closures and
        how many to take back from it (half, rounded up); ``None`` if none has any.
        O(log n) amortized (:class:`Victims`)."""
        return self._victims.victim(thief)

    # -- results --------------------------------------------------------------------
    def finish(self, session: str, cid: str, ok: bool, value: Any = None,
               kind: str = USER_ERROR) -> Outcome | None:
        """A session reports a closure's end. ``None`` if refused or retried.

        Refused (fencing): the closure is unknown, not RUNNING, or running on another
        session. A user error with retries left puts the closure back at the tail.
        """
        c = self.closures.get(cid)
        if c is None or c.state != RUNNING or c.session != session:
            self.counters.refused += 1
            return None
        del self._running[session][cid]
        if c.pinned is None:
            self._own[session] -= 1
        c.session = None
        c.seen = c.started = False
        if ok:
            return self._finish(c, READY, value, None)
        if kind == USER_ERROR and c.retries > 0:
            c.retries -= 1
            c.state = PENDING
            self._queue.append(cid)
            self.queued += 1
            self.counters.retried += 1
            return None
        return self._finish(c, FAILED, value, kind)

    def holds(self, session: str, cid: str) -> bool:
        """Whether ``cid`` is running on ``session`` (a finish from it would be accepted)."""
        return cid in self._running.get(session, ())

    def put_back(self, session: str, cids: Iterable[str]) -> int:
        """Return closures leased to ``session`` that it never received (no failure counted)."""
        running = self._running.get(session, {})
        back = sorted((cid for cid in set(cids) if cid in running), key=_order)
        for cid in reversed(back):
            del running[cid]
            c = self.closures[cid]
            c.state = PENDING
            c.session = None
            c.attempt -= 1
            c.seen = c.started = False
            if c.pinned is None:
                self._queue.appendleft(cid)
                self.queued += 1
                self._own[session] -= 1
            else:
                self._pinned.setdefault(c.pinned, deque()).appendleft(cid)
        return len(back)

    def reconcile(self, session: str, held: Iterable[str]) -> int:
        """Put back closures leased to ``session`` that the session says it does not hold."""
        running = self._running.get(session)
        if not running:
            return 0
        return self.put_back(session, running.keys() - set(held))

    def _finish(self, c: Closure, state: str, value: Any, kind: str | None) -> Outcome:
        c.state = state
        out = Outcome(c.cid, state, value, kind, c.attempt, c.owner)
        if state == READY:
            self.counters.done += 1
        elif state == FAILED:
            if c.pinned is None:  # a gang member's failure is the gang's to judge
                self.counters.failed += 1
                self.errors.setdefault(c.owner, out)
        else:
            self.counters.cancelled += 1
        del self.closures[c.cid]  # final: the queue keeps nothing more of it
        left = self._unfinished[c.owner] - 1
        if left:
            self._unfinished[c.owner] = left
        else:
            del self._unfinished[c.owner]
        return out

    # -- errors and cancellation ---------------------------------------------------
    @property
    def inflight(self) -> int:
        """Closures leased to workers, plus gang members waiting for theirs (every
        closure not final that is not queued: O(1))."""
        return len(self.closures) - self.queued

    @property
    def backlog(self) -> int:
        """Queue entries, those set aside for their tag included (O(1); may count a few
        stale ones): for fair-share dispatch."""
        return len(self._queue) + self._aside.count

    def cancel_pending(self, owner: str | None = None) -> list[Outcome]:
        """Cancel every queued closure (of ``owner``, or all)."""
        out: list[Outcome] = []
        self._queue = self._cancel_in(self._queue, owner, out)
        self._aside.refile(lambda cids: self._cancel_in(cids, owner, out))
        return out

    def _cancel_in(self, cids: deque[str], owner: str | None,
                   out: list[Outcome]) -> deque[str]:
        keep: deque[str] = deque()
        for cid in cids:
            c = self.closures.get(cid)
            if c is None or c.state != PENDING:
                continue
            if owner is None or c.owner == owner:
                self.queued -= 1
                out.append(self._finish(c, CANCELLED, None, None))
            else:
                keep.append(cid)
        return keep

    def take_error(self, owner: str) -> Outcome | None:
        """Clear and return ``owner``'s first unraised error (call once none of its
        closures is in flight)."""
        return self.errors.pop(owner, None)

    def inflight_of(self, owner: str) -> int:
        """``owner``'s closures leased to workers (a raise of its error waits for them)."""
        return sum(1 for leased in self._running.values() for cid in leased
                   if self.closures[cid].owner == owner)

    def unfinished(self, owner: str | None = None) -> int:
        """Closures not yet final (of ``owner``, or all). O(1)."""
        if owner is None:
            return len(self.closures)
        return self._unfinished.get(owner, 0)

def _order(cid: str) -> tuple[int, str]:
    """Sort key that keeps a session's closures in submission order when put back."""
    head, _, tail = cid.rpartition("-")
    return (int(tail), head) if tail.isdigit() else (0, cid)

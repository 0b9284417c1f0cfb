"""ClosureBook: the closure queue's book on the scheduler, and its handlers.

One coordinator's closures from the client's ``daskdist_put`` to the worker's
``daskdist_exchange`` and back to the client's ``daskdist_results``: the pure
:class:`~daskdist.core.queue.ClosureQueue`, its results applied, holding an owner's
closures and raising its error (SPEC §2.3). Its two parts are in
:mod:`~daskdist.plugins.scheduler.polls`: the owners' outboxes, and the workers'
long-polls waiting for work (with steals for an idle worker, and the routing at an
epoch's tail). Its routes are in :data:`CLOSURE_ROUTES`; what it needs of the other
books it asks its coordinator (:class:`ClosureCoordinator`). Runs on the scheduler's
event loop; imports nothing from Dask.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Protocol

from daskdist.core import checks, protocol
from daskdist.core.lifetime.keepalive import KeptResults
from daskdist.core.protocol import (
    FAILED,
    OWNER,
    READY,
    SESSION,
    SESSION_ENDED,
    UNSTARTED,
    Dispatch,
    Outcome,
    Route,
)
from daskdist.core.queue import ClosureQueue
from daskdist.plugins.scheduler.inference.jobs import JOB_OWNER
from daskdist.plugins.scheduler.polls import (
    Outbox,
    Owners,
    PollCoordinator,
    WorkerPolls,
    wait_event,
)

logger = logging.getLogger(__name__)

GANG_OWNER = "__gang__"  # owner of gang member closures: routed to the group book


class ClosureCoordinator(PollCoordinator, Protocol):
    """What the closure book (and its workers' long-polls) asks its coordinator (the
    scheduler's ``CoordinatorState``): the coordinator's own state, and what the other
    books hold."""

    def broadcast(self, msg: dict, sessions: Iterable[str] | None = None,
                  addressed: bool = False) -> None: ...

    def member_finished(self, outcome: Outcome) -> None:
        """A gang member's closure ended (the group book judges the gang)."""

    def job_closure_finished(self, outcome: Outcome) -> None:
        """A batch-inference job's closure ended (the inference book drives its job)."""

    def settle_tokens(self, session: str, tokens: list, ack: bool) -> bool:
        """Acknowledge (``ack``) or release a closure's lease tokens; ``False`` when an
        acknowledgement was refused (the rows went back)."""

    def gang_owner(self) -> str | None:
        """The owner of the gang running now (``None``: none)."""

    def cancel_gangs(self, owner: str) -> list[Outcome]:
        """Cancel ``owner``'s pending gangs: their outcomes."""


async def _acquire(lock: asyncio.Lock, timeout: float | None) -> bool:
    """Acquire ``lock`` within ``timeout`` seconds (``None``: wait); whether it was."""
    if timeout is None:
        await lock.acquire()
        return True
    task = asyncio.ensure_future(lock.acquire())
    done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout))
    if task in done:
        return True
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return False
    lock.release()  # acquired just as it was cancelled
    return False


class ClosureBook:
    """Queued and running closures, their owners and workers' long-polls, raises."""

    def __init__(self, co: ClosureCoordinator, max_worker_failures: int,
                 finished: dict[str, list[int]]) -> None:
        self.co = co
        self.queue = ClosureQueue(max_worker_failures=max_worker_failures)
        self.owners = Owners(co.name)
        self.outboxes: dict[str, Outbox] = self.owners.boxes
        # the workers' long-polls; their steals, and the queue's router at an epoch's tail
        self.polls = WorkerPolls(co, self.queue)
        # session -> [done, failed, rows] since the dashboard's last sample: the stats'
        # dict, counted here so that nothing runs in the stats on a closure's path
        self.finished = finished
        self.changed = asyncio.Event()  # set on every finish / session end (raise waits on it)
        self.acks_refused = 0  # completed closures whose rows were not leased to them
        self.raise_locks: dict[str, asyncio.Lock] = {}  # owner -> one raise at a time
        self.dropped: set[str] = set()  # owners gone while closures of theirs were out

    # -- owners (client-side Coordinators) ---------------------------------------------
    def add_owner(self, owner: str, client: str | None, token: str,
                  kept: KeptResults | None = None) -> None:
        """A new owner (``kept``: a keep-alive owner's outcomes, kept until read)."""
        self.owners.add(owner, client, token, kept)

    def hand_over(self, owner: str, client: str | None) -> tuple[str, list[str]]:
        """``client`` acts as ``owner`` from now on (``Owners.hand_over``): its new
        secret, and the ids of the owner's closures not finished."""
        return (self.owners.hand_over(owner, client),
                [c.cid for c in self.queue.closures.values() if c.owner == owner])

    def owner_box(self, owner: str, token: str) -> Outbox:
        """The outbox of ``owner`` if ``token`` is its secret (``PermissionError``)."""
        return self.owners.box(owner, token)

    def drop_owner(self, owner: str) -> Outbox | None:
        """Cancel ``owner``'s queued closures and forget its error; hold its closures
        still out (workers give back the unstarted ones) until they are settled."""
        box = self.outboxes.pop(owner, None)
        self.queue.cancel_pending(owner)
        self.queue.errors.pop(owner, None)
        self.raise_locks.pop(owner, None)
        if self.queue.unfinished(owner):
            self.dropped.add(owner)
            self.hold_owner(owner, True)
        else:
            self.queue.held.discard(owner)
        self.changed.set()  # a raise of this owner's error stops waiting
        return box

    def settle_dropped(self, owners: set[str]) -> None:
        """Closures of dropped ``owners`` came back or ended: cancel the ones back in the
        queue, and stop holding an owner once none of its closures is left."""
        for owner in owners & self.dropped:
            self.queue.cancel_pending(owner)
            if not self.queue.unfinished(owner):
                self.dropped.discard(owner)
                self.hold_owner(owner, False)

    def deliver(self, outcomes: list[Outcome]) -> None:
        """Route final outcomes: gang members to the group book, batch-inference jobs'
        closures to the inference book, the rest to outboxes."""
        for o in outcomes:
            if o.owner == GANG_OWNER:
                self.co.member_finished(o)
            elif o.owner.startswith(JOB_OWNER):  # a batch-inference job's closure
                self.queue.take_error(o.owner)  # its error is its job's, no owner's to raise
                self.co.job_closure_finished(o)
            else:
                self.owners.push(o)

    def session_ended(self, session: str, expected: bool) -> None:
        """A session ended: its closures go back to the queue (or fail), its long-poll
        returns, and as many long-polls as closures came back wake."""
        q = self.queue
        backlog = q.backlog
        self.deliver(q.remove_session(session, expected))
        if self.dropped:
            self.settle_dropped(set(self.dropped))
        self.wake_sessions((session,))  # its own long-poll returns
        self.wake(max(0, q.backlog - backlog))  # its closures, back in the queue

    # -- waking long-polls ---------------------------------------------------------------
    def wake(self, n: int | None = None) -> None:
        """State changed (``n=None``: wake every long-poll, each re-checks), or ``n``
        closures became available: wake as many long-polls that may take them."""
        self.changed.set()
        self.polls.wake(n)

    def wake_sessions(self, sessions: Iterable[str]) -> None:
        """Wake the long-polls of ``sessions`` (closures pinned to them: gang members)."""
        self.changed.set()
        self.polls.wake_sessions(sessions)

    def wake_idle(self) -> None:
        """A session's state changed (paused, draining, back): the long-polls that take
        no work re-check, and queued closures wake as many that do."""
        self.polls.wake_idle()
        self.wake(self.queue.backlog)

    def close(self) -> None:
        self.wake()

    # -- holding an owner's closures, gangs ------------------------------------------------
    @property
    def hold(self) -> list[str]:
        """Owners whose prefetched closures workers must not start (an error of theirs is
        being raised): they give them back unstarted."""
        return sorted(self.queue.held)

    def hold_owner(self, owner: str, hold: bool) -> None:
        """Hold (or release) ``owner``'s closures: none is dispatched, and workers give
        back the prefetched ones."""
        if hold:
            self.queue.held.add(owner)
        else:
            self.queue.held.discard(owner)
        self.co.broadcast({"op": "daskdist-hold", "name": self.co.name, "owners": self.hold})
        if not hold:
            self.wake(self.queue.backlog)

    def put_gang(self, members: list[tuple[str, str, int]], payload: list) -> None:
        """A gang starts: its member closures (``(cid, session, rank)`` each) are queued,
        each pinned to its session, and their long-polls woken."""
        for member_cid, session, _rank in members:
            self.queue.put(member_cid, GANG_OWNER, payload, pinned=session)
        self.wake_sessions([session for _, session, _ in members])

    def put_job(self, cid: str, owner: str, payload: list, tag: str | None) -> None:
        """A batch-inference job's closure (``owner``: the job's own; ``tag``: the
        dataset it reads) is queued, and a long-poll woken."""
        if self.queue.put(cid, owner, payload, tag=tag):
            self.wake(1)

    def deliver_gang(self, g: Outcome) -> None:
        """A gang's outcome to its owner; a failure is that owner's error to raise."""
        if g.state == FAILED:
            self.queue.errors.setdefault(g.owner, g)
            self.queue.counters.failed += 1
        self.owners.push(g)

    def status(self) -> dict:
        """The closures' part of the coordinator's status."""
        q, c = self.queue, self.queue.counters
        return {"queued": q.queued, "running": q.inflight, "scheduled": c.scheduled,
                "done": c.done, "failed": c.failed, "retried": c.retried,
                "cancelled": c.cancelled, "recovered": c.recovered, "refused": c.refused,
                "steals": self.polls.steals, "acks_refused": self.acks_refused,
                "error_pending": bool(q.errors), "owners": len(self.outboxes)}

    # -- results ---------------------------------------------------------------------------
    def apply_results(self, session: str, results: list) -> None:
        """Apply a worker's results (each an :class:`Outcome`, or its wire form).

        A closure's result and its lease tokens are applied together: rows are
        acknowledged only when the closure completes, released when it fails, and a
        refused (fenced) result leaves the table to the session's own fate. A gang
        member's rows are acknowledged by its commits (``daskdist_gang_commit_part``):
        the tokens it ends with were never committed, so they are released, whatever
        its result.
        """
        co = self.co
        outcomes = []
        q = self.queue
        backlog = q.backlog
        unstarted = []
        done = failed = 0  # accepted results, for the dashboard's counts
        dropped = set()  # dropped owners whose closures came back or ended
        for r in map(Outcome._make, results):
            cid, kind, tokens = r.cid, r.kind, r.tokens
            c = q.closures.get(cid)
            if self.dropped and c is not None and c.owner in self.dropped:
                dropped.add(c.owner)
            if kind == UNSTARTED:
                unstarted.append(cid)
                continue
            ok = r.state == READY
            accepted = q.holds(session, cid)
            gang = c is not None and c.owner == GANG_OWNER
            o = q.finish(session, cid, ok, r.value, kind)
            if accepted:
                done += ok
                failed += not ok
            # failed, retried, a duplicate run or a gang member's: its rows go back
            if tokens and not co.settle_tokens(session, tokens, accepted and ok and not gang):
                # rows this session does not hold (a bug upstream, never expected): said,
                # and what it does hold is freed rather than kept leased
                self.acks_refused += 1
                logger.warning("daskdist[%s]: closure %s completed but the lease table "
                               "refused its rows; they go back to the pool", co.name, cid)
            if o is not None:
                outcomes.append(o)
        if done or failed:  # the dashboard's count (folded in at its samples)
            counts = self.finished.get(session)
            if counts is None:
                counts = self.finished[session] = [0, 0, 0]
            counts[0] += done
            counts[1] += failed
        if unstarted:
            q.put_back(session, unstarted)
        if dropped:
            self.settle_dropped(dropped)
        self.deliver(outcomes)
        if results:
            self.changed.set()
            if q.backlog > backlog:
                self.wake(q.backlog - backlog)  # retried or unstarted closures went back

    # -- raising an error to its owner (SPEC §2.3, §2.5b) -----------------------------------
    async def raise_error(self, owner: str, timeout: float | None = None) -> dict:
        """Raise ``owner``'s first unraised error: hold its closures, cancel its queue
        (and pending gangs), wait for its closures in flight, take the error.

        Its closures are held meanwhile (workers give prefetched ones back), so when this
        returns none of them is executing; other owners' work goes on.
        Returns ``{"error": (cid, payload, kind) or None, "cancelled": [(owner, cid)]}``
        (``None``: no error, or another caller took it first), or ``{"timeout": True}``
        when its closures in flight did not finish within ``timeout`` seconds.
        """
        if owner not in self.queue.errors:
            return {"error": None, "cancelled": []}
        deadline = None if timeout is None else time.monotonic() + timeout
        # Two raises of one owner must not interleave: the second would release the hold
        # while the first waits, or cancel closures queued after the first took the error.
        lock = self.raise_locks.setdefault(owner, asyncio.Lock())
        if not await _acquire(lock, timeout):
            return {"timeout": True}
        try:
            return await self._raise_locked(owner, deadline)
        finally:
            lock.release()

    def _owner_busy(self, owner: str) -> bool:
        return bool(self.queue.inflight_of(owner)) or self.co.gang_owner() == owner

    async def _raise_locked(self, owner: str, deadline: float | None) -> dict:
        q = self.queue
        if owner not in q.errors:  # another raise took it while we waited for the lock
            return {"error": None, "cancelled": []}
        self.hold_owner(owner, True)
        cancelled: list[Outcome] = []
        try:
            while True:
                cancelled += self._cancel_owner(owner)  # what came back meanwhile too
                if (self.co.closed or owner not in self.outboxes
                        or not self._owner_busy(owner)):
                    break  # done, or the owner closed meanwhile (its raise ends too)
                self.changed.clear()
                if not self._owner_busy(owner):
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return {"timeout": True}
                if not await wait_event(self.changed, left):
                    return {"timeout": True}
            err = q.take_error(owner)
        finally:
            if owner not in self.dropped:  # a closed owner's closures stay held
                self.hold_owner(owner, False)
        error = None if err is None else (err.cid, err.value, err.kind)
        return {"error": error, "cancelled": [(o.owner, o.cid) for o in cancelled]}

    def _cancel_owner(self, owner: str) -> list[Outcome]:
        """Cancel ``owner``'s queued closures and pending gangs; their outcomes."""
        cancelled = self.queue.cancel_pending(owner)
        self.deliver(cancelled)
        for out in self.co.cancel_gangs(owner):
            self.owners.push(out)
            cancelled.append(out)
        return cancelled

    # -- client handlers ---------------------------------------------------------------
    def put(self, owner: str, token: str, closures: list) -> None:
        """Queue ``closures`` (each a :class:`Submission`) for ``owner`` (one-way).

        Checked as a whole before anything is queued (:func:`protocol.submissions`)."""
        op = "daskdist_put"
        if checks.text(owner, f"{op}: owner") not in self.outboxes:
            # sent just before its owner closed (and its closures were cancelled)
            logger.debug("daskdist[%s]: closures of closed owner %s dropped", self.co.name,
                         owner)
            return
        self.owner_box(owner, checks.text(token, f"{op}: token"))
        q = self.queue
        n = 0
        for sub in protocol.submissions(op, owner, closures):
            n += q.put(sub.cid, owner, sub.payload, sub.retries, tag=sub.dataset or None)
        self.wake(n)

    async def results(self, owner: str, token: str, ack: int,
                      timeout: float | None = None) -> dict:
        """Long-poll: outcomes for ``owner`` from sequence number ``ack`` on. Waits while
        there are none, even with an error of the owner's unread (it arrived as an
        outcome): an idle client costs the scheduler nothing."""
        op = "daskdist_results"
        if checks.text(owner, f"{op}: owner") not in self.outboxes:
            return {"detached": True}
        box = self.owner_box(owner, checks.text(token, f"{op}: token"))
        ack = checks.integer(ack, f"{op}: ack", 0, 2**62)
        timeout = checks.optional(checks.number, timeout, f"{op}: timeout", 0.0, 3600.0)
        if timeout is None:
            timeout = self.co.members.poll_base  # scheduler.poll-interval
        if not await self.owners.poll(owner, box, ack, timeout):
            return {"detached": True}
        return {
            "first": box.first_seq,
            "items": list(box.items),
            "error": owner in self.queue.errors,
            "workers": len(self.co.members),
        }

    async def raise_owner_error(self, owner: str, token: str,
                                timeout: float | None = None) -> dict:
        """Raise ``owner``'s first unraised error: wait for its in-flight closures, cancel
        its queue (:meth:`raise_error`)."""
        timeout = checks.optional(checks.number, timeout, "daskdist_raise: timeout", 0.0,
                                  float(2**31))
        return await self.raise_error(owner, timeout)

    def closure_state(self, cid: str) -> str | None:
        """PENDING or RUNNING for a closure not yet final; ``None`` once final or unknown."""
        c = self.queue.closures.get(checks.text(cid, "daskdist_closure_state: cid"))
        return None if c is None else c.state

    # -- worker handlers ---------------------------------------------------------------
    def report(self, session: str, results: list, held: list | None = None,
               started: list | None = None) -> dict:
        """A worker's results while its exchange waits for work."""
        op = "daskdist_report"
        outcomes = protocol.outcomes(op, results)
        held, started = protocol.observed(op, held, started)
        self.apply_results(session, outcomes)
        if held is not None:
            self.queue.observe(session, held, started)
        return {**self.co.members.counters(), "hold": self.hold}

    def renew(self, session: str, held: list | None = None,
              started: list | None = None) -> dict:
        """A worker session's lease renewal (every ``liveness.renew-interval``), with
        what it holds and which of those started."""
        held, started = protocol.observed("daskdist_renew", held, started)
        if held is not None:
            self.queue.observe(session, held, started)
        return {"ok": True}

    async def exchange(self, comm, session: str, results: list, held: list | None,
                       want: int, block: bool, started: list | None = None) -> dict:
        """A worker reports results and asks for up to ``want`` closures, in one call.

        ``held`` lists every closure the worker has received and not yet had
        acknowledged; closures leased to the session but missing from it were lost on
        the way (a reply nobody read) and go back to the queue. ``started`` says which
        of them started (only those count if the worker is lost). With ``block``, wait
        up to ``daskdist.scheduler.poll-interval`` for work.
        """
        op = "daskdist_exchange"
        outcomes = protocol.outcomes(op, results)
        held, started = protocol.observed(op, held, started)
        want = checks.integer(want, f"{op}: want", 0, checks.MAX_ITEMS)
        block = checks.flag(block, f"{op}: block")
        co = self.co
        if co.closed:
            return {"closed": True}
        q = self.queue
        if outcomes:
            self.apply_results(session, outcomes)
        if held is not None:
            back = q.reconcile(session, held)
            if back:
                self.wake(back)
            q.observe(session, held, started)

        def fair(want: int) -> int:
            # a fair share of the backlog, so one worker's prefetch does not starve others
            share = -(-q.backlog // max(1, len(co.members)))
            return min(want, max(1, share))

        # A busy worker prefetches nothing while another waits idle for work (SPEC §2.4).
        polls = self.polls
        closures = q.dispatch(session, fair(want) if block or not polls.waiters else 0)
        routed = polls.wake_holders()
        if not closures and block and want > 0:
            if not routed:  # closures set aside for the holders: theirs, not to steal
                polls.steal_for(session)
            closures = await polls.wait_for_work(comm, session, lambda: fair(want))
        return {
            "closures": [Dispatch(c.cid, c.payload, c.attempt, c.pinned is not None, c.owner)
                         for c in closures],
            "num_workers": len(co.members),
            **co.members.counters(),
            "hold": self.hold,
            "renew": co.members.renew_interval(),
        }


# The closure book's routes (the plugin registers each on the named coordinator's book,
# protocol.book_handler): a message's name leads here, beside its method. A worker's
# session is checked (and its lease renewed) by the route; ``put`` and ``results`` answer
# an owner that closed themselves (a late put is dropped, a long-poll is told).
CLOSURE_ROUTES = {
    "daskdist_put": Route(ClosureBook.put, None),
    "daskdist_results": Route(ClosureBook.results, {"detached": True}),
    "daskdist_raise": Route(ClosureBook.raise_owner_error, caller=OWNER),
    "daskdist_closure_state": Route(ClosureBook.closure_state),
    "daskdist_exchange": Route(ClosureBook.exchange, {"closed": True}, SESSION),
    "daskdist_report": Route(ClosureBook.report, SESSION_ENDED, SESSION),
    "daskdist_renew": Route(ClosureBook.renew, SESSION_ENDED, SESSION),
}

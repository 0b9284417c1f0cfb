"""ClosureBook: the closure queue's book on the scheduler, and its handlers.

One coordinator's closures from the client's ``daskdist_put`` to the worker's
``daskdist_exchange`` and back to the client's ``daskdist_results``: the pure
:class:`~daskdist.core.queue.ClosureQueue`, the owners' outboxes (client long-polls),
the workers' long-polls waiting for work, steals for an idle worker, and raising an
owner's error (SPEC §2.3). Its routes are in :data:`CLOSURE_ROUTES`. Runs on the
scheduler's event loop; imports nothing from Dask.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daskdist.core import protocol
from daskdist.core.protocol import (
    CANCELLED,
    FAILED,
    OWNER,
    READY,
    SESSION,
    SESSION_ENDED,
    UNSTARTED,
    Dispatch,
    Outcome,
    Route,
    Submission,
)
from daskdist.core.queue import ClosureQueue
from daskdist.plugins.scheduler.inference import JOB_OWNER

if TYPE_CHECKING:
    from daskdist.plugins.scheduler.state import CoordinatorState

logger = logging.getLogger(__name__)

GANG_OWNER = "__gang__"  # owner of gang member closures: routed to the group book


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait for ``event`` at most ``timeout`` seconds; whether it is set.

    Long-poll wake-ups are on the closure round trip's path: ``asyncio.timeout`` wakes
    the waiter directly, where ``wait_for`` would add a task (and a loop iteration).
    """
    if event.is_set():
        return True
    try:
        if hasattr(asyncio, "timeout"):  # Python 3.11+
            async with asyncio.timeout(timeout):
                await event.wait()
        else:  # pragma: no cover - Python 3.10
            await asyncio.wait_for(event.wait(), timeout)
    except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
        return False
    return True


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


@dataclass
class Outbox:
    """Outcomes waiting for one client-side Coordinator (an *owner*); kept until it
    acknowledges them. ``token`` is the owner's secret: only the client it was given to
    can act as that owner (SPEC §2.5b)."""

    client: str | None
    token: str = ""
    first_seq: int = 0
    items: list = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, item: Outcome) -> None:
        self.items.append(item)
        self.event.set()

    def ack(self, seq: int) -> None:
        """Forget everything before ``seq`` (the client has it)."""
        drop = seq - self.first_seq
        if drop > 0:
            del self.items[:drop]
            self.first_seq = seq
        if not self.items:
            self.event.clear()


class ClosureBook:
    """Queued and running closures, owners' outboxes, workers' long-polls, raises."""

    def __init__(self, co: CoordinatorState, max_worker_failures: int) -> None:
        self.co = co
        self.queue = ClosureQueue(max_worker_failures=max_worker_failures)
        self.queue.router = self._route  # the epoch's tail: closures to the rows' holders
        self.routed: set[str] = set()  # datasets whose closures were just set aside
        self.outboxes: dict[str, Outbox] = {}
        # long-polls of workers that may take work, oldest first: a queued closure wakes
        # one; ``woken``: those woken for a closure and not yet back (not woken twice)
        self.waiters: OrderedDict[asyncio.Event, None] = OrderedDict()
        self.woken: set[asyncio.Event] = set()
        # long-polls of sessions that take no work now (draining, paused): only a change
        # of state wakes them
        self.idle_waiters: set[asyncio.Event] = set()
        self.parked: dict[str, asyncio.Event] = {}  # session -> its long-poll's event
        self.changed = asyncio.Event()  # set on every finish / session end (raise waits on it)
        self.steals = 0  # requests to a busy worker to give back unstarted closures
        self.acks_refused = 0  # completed closures whose rows were not leased to them
        self.raise_locks: dict[str, asyncio.Lock] = {}  # owner -> one raise at a time
        self.dropped: set[str] = set()  # owners gone while closures of theirs were out

    # -- owners (client-side Coordinators) ---------------------------------------------
    def add_owner(self, owner: str, client: str | None, token: str) -> None:
        self.outboxes[owner] = Outbox(client, token)

    def owner_box(self, owner: str, token: str) -> Outbox:
        """The outbox of ``owner`` if ``token`` is its secret; ``PermissionError`` if not
        (a client acts only as the owner it attached as)."""
        box = self.outboxes.get(owner)
        if box is None:
            raise PermissionError(f"coordinator {self.co.name!r} has no owner {owner!r} "
                                  "(it closed, or its client was cut off longer than "
                                  "daskdist.coordinator.client-grace)")
        if not secrets.compare_digest(box.token, token):
            raise PermissionError(f"the caller is not owner {owner!r} of coordinator "
                                  f"{self.co.name!r}")
        return box

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
                self.co.group_book.member_finished(o)
                continue
            if o.owner.startswith(JOB_OWNER):  # a batch-inference job's closure
                self.co.infer_book.closure_finished(o)
                continue
            box = self.outboxes.get(o.owner)
            if box is not None:
                box.push(o)

    # -- the epoch's tail: closures reading a dataset go to the holders of its rows --------
    def _route(self, dataset: str, session: str) -> bool:
        """The queue's router: whether ``session`` should run a closure reading
        ``dataset`` now (the lease table's word: not when the dataset's free rows are
        gone and other sessions hold its leased rows)."""
        if self.co.leases.takes(dataset, session):
            return True
        self.routed.add(dataset)
        return False

    def _wake_holders(self) -> None:
        """Closures were set aside for the sessions holding their dataset's rows: wake
        those of them waiting in a long-poll (the first few holders looked at, O(1);
        a busy holder takes them at its next exchange)."""
        datasets, self.routed = self.routed, set()
        for dataset in datasets:
            for session in itertools.islice(self.co.leases.holders(dataset), 4):
                event = self.parked.get(session)
                if event is not None:
                    event.set()

    # -- waking long-polls ---------------------------------------------------------------
    def wake(self, n: int | None = None) -> None:
        """State changed (``n=None``: wake every long-poll, each re-checks), or ``n``
        closures became available: wake the ``n`` longest-waiting long-polls that may
        take them, O(n) whatever the number of idle workers."""
        self.changed.set()
        if n is None:
            for event in self.waiters:
                event.set()
            for event in self.idle_waiters:
                event.set()
            return
        woken = self.woken
        for event in self.waiters:
            if n <= 0:
                break
            if event not in woken:
                event.set()
                woken.add(event)
                n -= 1

    def wake_sessions(self, sessions) -> None:
        """Wake the long-polls of ``sessions`` (closures pinned to them: gang members)."""
        self.changed.set()
        for session in sessions:
            event = self.parked.get(session)
            if event is not None:
                event.set()

    def wake_idle(self) -> None:
        """A session's state changed (paused, draining, back): the long-polls that take
        no work re-check, and queued closures wake as many that do."""
        for event in self.idle_waiters:
            event.set()
        self.wake(self.queue.backlog)

    def close(self) -> None:
        self.wake()

    # -- holding an owner's closures ------------------------------------------------------
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
        leases = co.leases
        outcomes = []
        q = self.queue
        backlog = q.backlog
        unstarted = []
        finished = co.stats.finished
        dropped = set()  # dropped owners whose closures came back or ended
        for r in map(Outcome._make, results):
            cid, value, kind, tokens = r.cid, r.value, r.kind, r.tokens
            c = q.closures.get(cid)
            if self.dropped and c is not None and c.owner in self.dropped:
                dropped.add(c.owner)
            if kind == UNSTARTED:
                unstarted.append(cid)
                continue
            ok = r.state == READY
            accepted = q.holds(session, cid)
            gang = c is not None and c.owner == GANG_OWNER
            o = q.finish(session, cid, ok, value, kind)
            if accepted:  # the dashboard's count (folded in at its samples)
                counts = finished.get(session)
                if counts is None:
                    counts = finished[session] = [0, 0, 0]
                counts[not ok] += 1
            if tokens:
                if accepted and ok and not gang:
                    if not leases.ack_tokens(session, tokens):
                        # rows this session does not hold (a bug upstream, never expected):
                        # say so, and free what it does hold rather than keep it leased
                        self.acks_refused += 1
                        logger.warning("daskdist[%s]: closure %s completed but the lease "
                                       "table refused its rows; they go back to the pool",
                                       co.name, cid)
                        leases.release_tokens(session, tokens)
                else:  # failed, retried, or a duplicate run: its rows go back to the pool
                    leases.release_tokens(session, tokens)
            if o is not None:
                outcomes.append(o)
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
        running = self.co.gangs.running
        return bool(self.queue.inflight_of(owner)) or (running is not None
                                                       and running.owner == owner)

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
        for gang in self.co.gangs.cancel_pending(owner):
            out = Outcome(gang.cid, CANCELLED, None, None, gang.attempt, gang.owner)
            box = self.outboxes.get(gang.owner)
            if box is not None:
                box.push(out)
            cancelled.append(out)
        return cancelled

    def deliver_gang(self, g: Outcome) -> None:
        """A gang's outcome to its owner; a failure is that owner's error to raise."""
        if g.state == FAILED:
            self.queue.errors.setdefault(g.owner, g)
            self.queue.counters.failed += 1
        box = self.outboxes.get(g.owner)
        if box is not None:
            box.push(g)

    # -- client handlers ---------------------------------------------------------------
    def put(self, owner: str, token: str, closures: list) -> None:
        """Queue ``closures`` (each a :class:`Submission`) for ``owner`` (one-way).

        Checked as a whole before anything is queued: each closure id must be the
        owner's (``owner-...``), so no client can queue under another's ids."""
        op = "daskdist_put"
        if protocol.text(owner, f"{op}: owner") not in self.outboxes:
            # sent just before its owner closed (and its closures were cancelled)
            logger.debug("daskdist[%s]: closures of closed owner %s dropped", self.co.name,
                         owner)
            return
        self.owner_box(owner, protocol.text(token, f"{op}: token"))
        prefix = f"{owner}-"
        subs = []
        for i, item in enumerate(protocol.items(closures, f"{op}: closures")):
            if protocol.submission_ok(item, prefix):
                subs.append(Submission(*item))  # without its dataset: ""
                continue
            if isinstance(item, (list, tuple)) and len(item) == 3:
                item = (*item, "")
            sub = Submission._make(protocol.record(item, f"{op}: closures[{i}]",
                                                 len(Submission._fields)))
            if not protocol.text(sub.cid, f"{op}: closures[{i}].cid").startswith(prefix):
                raise PermissionError(f"{op}: closure id {sub.cid!r} is not one of owner "
                                      f"{owner!r}'s")
            protocol.payload(sub.payload, f"{op}: closures[{i}].payload")
            protocol.integer(sub.retries, f"{op}: closures[{i}].retries", 0, protocol.MAX_RETRIES)
            protocol.text(sub.dataset, f"{op}: closures[{i}].dataset", empty=True)
            subs.append(sub)
        q = self.queue
        n = 0
        for sub in subs:
            n += q.put(sub.cid, owner, sub.payload, sub.retries, tag=sub.dataset or None)
        self.wake(n)

    async def results(self, owner: str, token: str, ack: int,
                      timeout: float | None = None) -> dict:
        """Long-poll: outcomes for ``owner`` from sequence number ``ack`` on. Waits while
        there are none, even with an error of the owner's unread (it arrived as an
        outcome): an idle client costs the scheduler nothing."""
        op = "daskdist_results"
        if protocol.text(owner, f"{op}: owner") not in self.outboxes:
            return {"detached": True}
        box = self.owner_box(owner, protocol.text(token, f"{op}: token"))
        box.ack(protocol.integer(ack, f"{op}: ack", 0, 2**62))
        timeout = protocol.optional(protocol.number, timeout, f"{op}: timeout", 0.0, 3600.0)
        if not box.items:
            if timeout is None:
                timeout = self.co.members.poll_base  # scheduler.poll-interval
            await wait_event(box.event, timeout)
        if self.outboxes.get(owner) is not box:
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
        timeout = protocol.optional(protocol.number, timeout, "daskdist_raise: timeout", 0.0,
                                  float(2**31))
        return await self.raise_error(owner, timeout)

    def closure_state(self, cid: str) -> str | None:
        """PENDING or RUNNING for a closure not yet final; ``None`` once final or unknown."""
        c = self.queue.closures.get(protocol.text(cid, "daskdist_closure_state: cid"))
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

    def _steal_for(self, thief: str) -> None:
        """An idle session found no work: ask the session holding the most prefetched,
        unstarted closures to give half of them back (they return as ``UNSTARTED``
        results, go to the head of the queue and wake the idle session's long-poll)."""
        victim = self.queue.steal_victim(thief)
        if victim is None:
            return
        session, n = victim
        member = self.co.members.members.get(session)
        if member is not None:
            self.steals += 1
            self.co.send(member.address, {"op": "daskdist-steal", "name": self.co.name,
                                          "n": n})

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
        want = protocol.integer(want, f"{op}: want", 0, protocol.MAX_ITEMS)
        block = protocol.flag(block, f"{op}: block")
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
        closures = q.dispatch(session, fair(want) if block or not self.waiters else 0)
        routed = bool(self.routed)
        if routed:
            self._wake_holders()
        if not closures and block and want > 0:
            if not routed:  # closures set aside for the holders: theirs, not to steal
                self._steal_for(session)
            deadline = time.monotonic() + co.members.poll_interval()
            event = asyncio.Event()
            self.parked[session] = event
            try:
                while True:
                    if comm.closed() or co.closed or session not in co.members:
                        break
                    closures = q.dispatch(session, fair(want))
                    if self.routed:
                        self._wake_holders()
                    if closures:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    event.clear()
                    self.woken.discard(event)
                    if q.takes_work(session):
                        self.idle_waiters.discard(event)
                        self.waiters[event] = None
                    else:
                        self.waiters.pop(event, None)
                        self.idle_waiters.add(event)
                    if not await wait_event(event, left):
                        break
            finally:
                self.waiters.pop(event, None)
                self.idle_waiters.discard(event)
                self.woken.discard(event)
                if self.parked.get(session) is event:
                    del self.parked[session]
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

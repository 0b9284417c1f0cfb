"""CoordinatorState: one named coordinator's state on the scheduler, and its delivery.

Glues the pure state machines (closure queue, membership, lease table, gang book) to
the scheduler's event loop: outboxes that client long-polls read, events that worker
long-polls wait on, and routing of outcomes (gang members to the gang book, lease
tokens to the lease table). Talks to workers only through the ``send`` callable the
plugin provides (a message on the worker's stream), so it imports nothing from Dask.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from daskdist.core.commits import CommitBook
from daskdist.core.gang import GangBook
from daskdist.core.leases import LeaseTable
from daskdist.core.liveness import LivenessTable
from daskdist.core.membership import Membership
from daskdist.core.protocol import CANCELLED, FAILED, READY, UNSTARTED, Outcome
from daskdist.core.queue import ClosureQueue
from daskdist.plugins.scheduler.stats import CoordinatorStats

logger = logging.getLogger(__name__)

GANG_OWNER = "__gang__"  # owner of gang member closures: routed to the gang book


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


class CoordinatorState:
    """One named coordinator: queue, members, leases, gangs, outboxes and waiters."""

    def __init__(self, name: str, max_worker_failures: int = 3,
                 send: Callable[[str, dict], None] | None = None,
                 lease_timeout: float = 30.0):
        self.name = name
        self.liveness = LivenessTable(lease_timeout)  # session leases (SPEC §2.4)
        self.queue = ClosureQueue(max_worker_failures=max_worker_failures)
        self.members = Membership()
        self.leases = LeaseTable(  # every acknowledgement is counted for the dashboard
            on_ack=lambda session, dataset_id, rows: self.stats.on_rows(
                self, session, dataset_id, rows))
        self.gangs = GangBook(max_losses=max_worker_failures)
        self.commits = CommitBook()  # commits that acknowledged gang members' rows
        self.commit_events: dict[str, asyncio.Event] = {}  # open commits' waiters
        self.resources: dict[str, bytes] = {}
        self.resource_owners: dict[str, str] = {}  # rid -> the owner that registered it
        self.outboxes: dict[str, Outbox] = {}
        self.waiters: set[asyncio.Event] = set()  # long-polls of workers waiting for work
        self.changed = asyncio.Event()  # set on every finish / session end (raise waits on it)
        self.gangs_changed = asyncio.Event()  # the gang pump waits on it
        self.send = send or (lambda address, msg: None)
        self.workers_lost = 0  # removals Dask did not expect
        self.resources_released = 0
        self.steals = 0  # requests to a busy worker to give back unstarted closures
        self.acks_refused = 0  # completed closures whose rows were not leased to them
        self.raise_locks: dict[str, asyncio.Lock] = {}  # owner -> one raise at a time
        self.dropped: set[str] = set()  # owners gone while closures of theirs were out
        self.closed = False  # the last owner left: the plugin tears this coordinator down
        self.stats = CoordinatorStats()  # dashboard counters and history (plugins/stats.py)

    # -- delivery -------------------------------------------------------------------
    def deliver(self, outcomes: list[Outcome]) -> None:
        """Route final outcomes: gang members to the gang book, the rest to outboxes."""
        for o in outcomes:
            if o.owner == GANG_OWNER:
                g = self.gangs.member_finished(o.cid, o.state == READY, o.value, o.kind)
                if g is not None:
                    self.deliver_gang(g)
                self.gangs_changed.set()
                continue
            box = self.outboxes.get(o.owner)
            if box is not None:
                box.push(o)

    def deliver_gang(self, g: Outcome) -> None:
        """A gang's outcome to its owner; a failure is that owner's error to raise."""
        if g.state == FAILED:
            self.queue.errors.setdefault(g.owner, g)
            self.queue.counters.failed += 1
        box = self.outboxes.get(g.owner)
        if box is not None:
            box.push(g)

    # -- owners (client-side Coordinators) ---------------------------------------------
    def add_owner(self, owner: str, client: str | None, token: str) -> None:
        self.outboxes[owner] = Outbox(client, token)

    def owner_box(self, owner: str, token: str) -> Outbox:
        """The outbox of ``owner`` if ``token`` is its secret; ``PermissionError`` if not
        (a client acts only as the owner it attached as)."""
        box = self.outboxes.get(owner)
        if box is None:
            raise PermissionError(f"coordinator {self.name!r} has no owner {owner!r} "
                                  "(it closed, or its client was cut off longer than "
                                  "daskdist.coordinator.client-grace)")
        if not secrets.compare_digest(box.token, token):
            raise PermissionError(f"the caller is not owner {owner!r} of coordinator "
                                  f"{self.name!r}")
        return box

    def drop_owner(self, owner: str) -> list[Outcome]:
        """An owner closed (or its client is gone): cancel its queued closures and pending
        gangs, release its per-worker resources on every worker and forget its error.
        Returns the outcomes it had not yet read (its finished closures among them);
        a long-poll of it returns at once. Closures already running finish on their
        workers, their results dropped; workers give back the ones they had not started
        (held, like an owner whose error is raised), and those are cancelled."""
        box = self.outboxes.pop(owner, None)
        self.queue.cancel_pending(owner)
        self.gangs.cancel_pending(owner)
        self.queue.errors.pop(owner, None)
        self.raise_locks.pop(owner, None)
        self.release_resources([rid for rid, o in self.resource_owners.items() if o == owner])
        if self.queue.unfinished(owner):
            self.dropped.add(owner)
            self.hold_owner(owner, True)
        else:
            self.queue.held.discard(owner)
        self.changed.set()  # a raise of this owner's error stops waiting
        if box is None:
            return []
        box.event.set()
        return list(box.items)

    def _settle_dropped(self, owners: set[str]) -> None:
        """Closures of dropped ``owners`` came back or ended: cancel the ones back in the
        queue, and stop holding an owner once none of its closures is left."""
        for owner in owners & self.dropped:
            self.queue.cancel_pending(owner)
            if not self.queue.unfinished(owner):
                self.dropped.discard(owner)
                self.hold_owner(owner, False)

    def add_resource(self, owner: str, rid: str, payload: bytes) -> None:
        self.resources[rid] = payload
        self.resource_owners[rid] = owner

    def release_resources(self, rids: list[str]) -> None:
        """Forget per-worker resources here and on every worker (their objects and
        iterators are closed there)."""
        rids = [rid for rid in rids if self.resources.pop(rid, None) is not None]
        for rid in rids:
            self.resource_owners.pop(rid, None)
        if rids:
            self.resources_released += len(rids)
            self.broadcast({"op": "daskdist-release", "name": self.name, "rids": rids})

    def close(self) -> None:
        """No owner is left: end every wait on this coordinator (worker long-polls,
        raises, commits). The plugin drops it and unregisters its worker plugin."""
        self.closed = True
        self.changed.set()
        self.gangs_changed.set()
        for event in [*self.waiters, *self.commit_events.values()]:
            event.set()

    def wake(self) -> None:
        """Closures became available, or state changed: wake long-polls."""
        self.changed.set()
        for event in self.waiters:
            event.set()

    # -- workers ---------------------------------------------------------------------
    def broadcast(self, msg: dict, sessions=None) -> None:
        """Send ``msg`` on the stream of every member worker (or of ``sessions``)."""
        for m in list(self.members.members.values()):
            if sessions is None or m.session in sessions:
                self.send(m.address, msg)

    def membership_changed(self) -> None:
        self.broadcast({"op": "daskdist-membership", "name": self.name,
                        "version": self.members.version})
        self.gangs_changed.set()

    def start_session(self, session: str, address: str, slots: int, device: str, gpu: str,
                      retiring: Callable[[str], bool], now: float) -> dict[str, int]:
        """A worker plugin session joins: the lowest free worker index, a lease, ``slots``
        closure slots. An older session of the same worker ends first; a worker that
        ``retiring(address)`` says is leaving joins draining. The register reply."""
        old = self.members.session_of(address)
        if old is not None and old != session:
            self.end_session(old)
        member, _ = self.members.join(session, address, device, gpu)
        self.liveness.add(session, now)
        self.queue.add_session(session, slots)
        self.membership_changed()
        if retiring(address):
            self.members.drain(address)
            self.queue.drain_session(session)
        self.wake()
        return {
            "index": member.index,
            "num_workers": len(self.members),
            "version": self.members.version,
        }

    def stop_session(self, session: str, results: list | None = None) -> None:
        """A worker plugin session closes (teardown): its last results, then its end (an
        expected leave: not counted as lost)."""
        if results:
            self.apply_results(session, results)
        if session in self.members:
            self.end_session(session)

    def worker_status_changed(self, address: str, status: str | None) -> None:
        """Dask changed a worker's status: a retiring or memory-paused worker gets no new
        work; back to running, it does. A retiring group member leaves the group at the
        next commit and one back in service joins it (SPEC §4.1). A memory pause keeps
        the worker in its group (no re-formation on pause or unpause) and gives its
        prefetched closures back, unstarted, to run elsewhere (SPEC §2.4)."""
        session = self.members.session_of(address)
        if session is None:
            return
        member = self.members.members[session]
        retiring = status in ("closing_gracefully", "closing", "closed")
        paused = status == "paused"
        was_retiring, was_paused = member.draining, member.paused
        self.members.drain(address, retiring)
        member.paused = paused
        self.queue.drain_session(session, retiring or paused)
        if (was_retiring != retiring
                and (session in self.gangs.group.sessions) == retiring):
            self.members.version += 1
            self.membership_changed()
        if paused and not was_paused:
            self.send(address, {"op": "daskdist-steal", "name": self.name, "n": 2**31})
        if not (retiring or paused):
            self.wake()

    def end_session(self, session: str, expected: bool = True) -> None:
        """A worker session is gone: put its closures back, drop its index and leases.

        ``expected`` is Dask's word on a removed worker: retired or closed (True), or
        killed, crashed, cut off (False: counted as a lost worker).
        """
        self.stats.on_session_end(self, session, expected)
        self.members.leave(session)
        self.liveness.forget(session)
        self.workers_lost += not expected
        self.leases.drop_session(session)
        group = self.gangs.group
        for key in self.commits.abort_open():  # a member's part may never come
            event = self.commit_events.pop(key, None)
            if event is not None:
                event.set()
        if self.gangs.session_lost(session, expected):
            # surviving members: collective calls of this generation fail at once
            self.broadcast({"op": "daskdist-peer-lost", "name": self.name,
                            "generation": group.generation}, set(group.sessions))
        self.deliver(self.queue.remove_session(session, expected))
        if self.dropped:
            self._settle_dropped(set(self.dropped))
        self.membership_changed()
        self.wake()

    def renew(self, session: str, now: float) -> bool:
        """A message from ``session``: its lease runs on. ``False`` if it is not a member
        (ended or expired: the worker must register a new session)."""
        return session in self.members and self.liveness.renew(session, now)

    def expire_sessions(self, now: float) -> list[str]:
        """End every session silent for ``lease-timeout`` like a lost worker (fenced: its
        later messages are refused because it is no longer a member)."""
        expired = self.liveness.expire(now)
        for session in expired:
            if session in self.members:
                self.end_session(session, expected=False)
        return expired

    def apply_results(self, session: str, results: list) -> None:
        """Apply a worker's results (each an :class:`Outcome`, or its wire form).

        A closure's result and its lease tokens are applied together: rows are
        acknowledged only when the closure completes, released when it fails, and a
        refused (fenced) result leaves the table to the session's own fate. A gang
        member's rows are acknowledged by its commits (:meth:`gang_commit`): the tokens
        it ends with were never committed, so they are released, whatever its result.
        """
        outcomes = []
        q = self.queue
        backlog = q.backlog
        unstarted = []
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
            self.stats.on_results(self, session, accepted, ok)
            if tokens:
                if accepted and ok and not gang:
                    if not self.leases.ack_tokens(session, tokens):
                        # rows this session does not hold (a bug upstream, never expected):
                        # say so, and free what it does hold rather than keep it leased
                        self.acks_refused += 1
                        logger.warning("daskdist[%s]: closure %s completed but the lease "
                                       "table refused its rows; they go back to the pool",
                                       self.name, cid)
                        self.leases.release_tokens(session, tokens)
                else:  # failed, retried, or a duplicate run: its rows go back to the pool
                    self.leases.release_tokens(session, tokens)
            if o is not None:
                outcomes.append(o)
        if unstarted:
            q.put_back(session, unstarted)
        if dropped:
            self._settle_dropped(dropped)
        self.deliver(outcomes)
        if results:
            self.changed.set()
            if q.backlog > backlog:
                self.wake()  # retried or unstarted closures went back to the queue

    async def gang_commit_part(self, session: str, generation: int, key: str, rank: int,
                               world: int, tokens: list, timeout: float) -> bool:
        """Rank ``rank``'s part of a gang commit, sent by ``session``; the commit's outcome
        once every rank's part came (all or nothing: refused unless ``generation`` is the
        current group, ``session`` is its rank ``rank`` and every member's session is
        live), or ``False`` after ``timeout`` seconds."""
        group = self.gangs.group
        sessions = dict(enumerate(group.sessions)) if generation == group.generation else None
        if sessions is not None and sessions.get(rank) != session:
            sessions = None  # a part from an ended session, or another rank's: refused
        ok = self.commits.add_part(self.leases, key, rank, world, tokens, sessions,
                                   set(self.members.members))
        if ok is not None:
            event = self.commit_events.pop(key, None)
            if event is not None:
                event.set()
            return ok
        event = self.commit_events.setdefault(key, asyncio.Event())
        await wait_event(event, timeout)
        self.commit_events.pop(key, None)
        return self.commits.outcome(key)

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
        running = self.gangs.running
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
                if self.closed or owner not in self.outboxes or not self._owner_busy(owner):
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
        for gang in self.gangs.cancel_pending(owner):
            out = Outcome(gang.cid, CANCELLED, None, None, gang.attempt, gang.owner)
            box = self.outboxes.get(gang.owner)
            if box is not None:
                box.push(out)
            cancelled.append(out)
        return cancelled

    def active_sessions(self) -> tuple[str, ...]:
        """Sessions that may run closures, in worker-index (rank) order."""
        return tuple(m.session for m in self.members.by_index() if not m.draining)

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
        self.broadcast({"op": "daskdist-hold", "name": self.name, "owners": self.hold})
        if not hold:
            self.wake()

    def status(self) -> dict[str, Any]:
        c = self.queue.counters
        group = self.gangs.group
        return {
            "name": self.name,
            "queued": self.queue.queued,
            "running": self.queue.inflight,
            "scheduled": c.scheduled,
            "done": c.done,
            "failed": c.failed,
            "retried": c.retried,
            "cancelled": c.cancelled,
            "recovered": c.recovered,
            "refused": c.refused,
            "workers": len(self.members),
            "worker_joins": self.members.joins,
            "worker_leaves": self.members.leaves,
            "workers_lost": self.workers_lost,
            "lease_expiries": self.liveness.expiries,
            "steals": self.steals,
            "acks_refused": self.acks_refused,
            "resources": len(self.resources),
            "resources_released": self.resources_released,
            "error_pending": bool(self.queue.errors),
            "owners": len(self.outboxes),
            "membership_version": self.members.version,
            "group_generation": group.generation,
            "group_size": len(group.sessions),
            "gangs_pending": len(self.gangs.pending),
        }

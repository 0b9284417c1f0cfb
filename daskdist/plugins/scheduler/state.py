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

from daskdist.core import checks
from daskdist.core.commits import CommitBook
from daskdist.core.gang import INTERRUPTING, GangBook
from daskdist.core.leases import EpochFailed, LeaseTable, SessionExpired
from daskdist.core.ledgers import Ledgers
from daskdist.core.liveness import LivenessTable
from daskdist.core.membership import Membership
from daskdist.core.protocol import (
    CANCELLED,
    FAILED,
    READY,
    UNSTARTED,
    CommitKey,
    DatasetDef,
    EpochLedger,
    Outcome,
)
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
                self, session, dataset_id, rows),
            max_failures=max_worker_failures)
        self.gangs = GangBook(max_losses=max_worker_failures)
        self.commits = CommitBook()  # commits that acknowledged gang members' rows
        self.ledgers = Ledgers()  # the datasets each State trained (checkpoint ledgers)
        self.commit_events: dict[str, asyncio.Event] = {}  # open commits' waiters
        self.resources: dict[str, bytes] = {}
        self.resource_owners: dict[str, str] = {}  # rid -> the owner that registered it
        self.outboxes: dict[str, Outbox] = {}
        self.waiters: set[asyncio.Event] = set()  # long-polls of workers waiting for work
        self.changed = asyncio.Event()  # set on every finish / session end (raise waits on it)
        self.gangs_changed = asyncio.Event()  # the gang pump waits on it
        self.send = send or (lambda address, msg: None)
        self.workers_lost = 0  # removals Dask did not expect
        self.departing: set[str] = set()  # retired group members finishing their step
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
                healthy = not self.gangs.group.broken
                g = self.gangs.member_finished(o.cid, o.state == READY, o.value, o.kind)
                if healthy and self.gangs.group.broken and o.kind not in INTERRUPTING:
                    # a user error failed the gang: the peers stop waiting for that rank
                    # (an interruption needs no word: every rank raises it, or the
                    # scheduler told them of the loss)
                    self.tell_members()
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
        self.leases.drop_owner(owner)  # its datasets' lease tables go with it
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
        self.forget_datasets(rids)  # a dataset's identity is its resource id
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

    def tell_members(self) -> None:
        """The group broke (a member left, or a member's closure failed): its members'
        collective calls of this generation raise ``CollectiveError`` at once, saying why
        (``GroupRecord.why``), instead of waiting for the group's timeout."""
        group = self.gangs.group
        self.broadcast({"op": "daskdist-peer-lost", "name": self.name,
                        "generation": group.generation, "reason": group.why},
                       set(group.sessions))

    def membership_changed(self) -> None:
        """Tell every member the new counters, addressed to its session (a worker's
        counters are per session: a new coordinator of this name starts afresh)."""
        for m in list(self.members.members.values()):
            self.send(m.address, {"op": "daskdist-membership", "name": self.name,
                                  "session": m.session, "version": self.members.version,
                                  "joins": self.members.joins})
        self.gangs.membership_changed()
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
            "joins": self.members.joins,
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
            if not retiring:  # back in service: it joins the group (it needs the state)
                self.members.joins += 1
            self.membership_changed()
        if retiring and not was_retiring:  # its gang members leave at their next commit
            self.send(address, {"op": "daskdist-leaving", "name": self.name})
        if paused and not was_paused:
            self.send(address, {"op": "daskdist-steal", "name": self.name, "n": 2**31})
        if not (retiring or paused):
            self.wake()

    def worker_removed(self, session: str, expected: bool) -> None:
        """Dask removed the worker of ``session``. A retired group member stays a member
        until its plugin's teardown unregisters it: its gang member leaves at its next
        commit (a last holder checkpoints there), which needs the scheduler, at most
        ``daskdist.preemption.grace``; its lease bounds the wait. Otherwise it ends now."""
        member = self.members.members.get(session)
        if (expected and member is not None and member.draining
                and session in self.gangs.group.sessions):
            self.departing.add(session)
            return
        self.end_session(session, expected)

    def end_session(self, session: str, expected: bool = True) -> None:
        """A worker session is gone: put its closures back, drop its index and leases.

        ``expected`` is Dask's word on a removed worker: retired or closed (True), or
        killed, crashed, cut off (False: counted as a lost worker).
        """
        self.stats.on_session_end(self, session)
        self.departing.discard(session)
        self.members.leave(session)
        self.liveness.forget(session)
        self.workers_lost += not expected
        self.leases.drop_session(session)
        if self.gangs.session_lost(session, expected):
            # a member's part may never come: its generation's open commits are refused,
            # and the surviving members' collective calls fail at once
            self._commits_decided(self.commits.abort_open())
            self.tell_members()
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
                self.end_session(session, expected=session in self.departing)
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

    async def gang_commit_part(self, session: str, key: CommitKey, rank: int, world: int,
                               tokens: list, timeout: float) -> bool:
        """Rank ``rank``'s part of a gang commit, sent by ``session``; the commit's outcome
        once every rank's part came (all or nothing: refused unless ``key``'s generation
        is the current group, ``session`` is its rank ``rank`` and every member's session
        is live). A commit whose parts did not all come within ``timeout`` seconds (the
        group's timeout) expires: refused, for good."""
        group = self.gangs.group
        sessions = (dict(enumerate(group.sessions)) if key.generation == group.generation
                    else None)
        if sessions is not None and sessions.get(rank) != session:
            sessions = None  # a part from an ended session, or another rank's: refused
        if sessions is not None:
            try:
                self.ledgers.note(key.state, tokens)  # datasets trained under the State
            except ValueError:
                pass  # a malformed token: the commit refuses it below
        ok = self.commits.add_part(self.leases, key, rank, world, tokens, sessions,
                                   set(self.members.members))
        if ok is not None:
            self._commits_decided([key])
            return ok
        event = self.commit_events.setdefault(key, asyncio.Event())
        await wait_event(event, timeout)
        return self.commit_outcome(key)

    def commit_outcome(self, key: CommitKey) -> bool:
        """Whether commit ``key`` was applied; an undecided one is refused now (a rank
        asks when its reply was lost or late: every rank must get the same answer)."""
        ok = self.commits.expire(key)
        self._commits_decided([key])
        return ok

    def state_commits(self, state: str, committed: bool = False) -> int:
        """How many commits of State ``state`` happened (``committed``: one more, a plain
        commit its rank reports once), so ``sync()`` can tell a lost state from a fresh
        start."""
        if committed:
            self.commits.note_committed(state)
        return self.commits.committed(state)

    def _commits_decided(self, keys: list[CommitKey]) -> None:
        """Wake the parts still waiting for these commits' outcomes."""
        for key in keys:
            event = self.commit_events.pop(key, None)
            if event is not None:
                event.set()

    # -- dynamic datasets: the lease handlers (registered by the plugin as they are) -------
    # Worker calls name their session and are refused once it ended (``{"expired":
    # True}``); client calls name their owner. Arguments are checked first: a bad one is
    # a TypeError / ValueError naming it, raised to the caller, and changes nothing.

    def dataset_define(self, dataset: Any, owner: str | None = None, token: str | None = None,
                       session: str | None = None) -> dict:
        """Define a dynamic dataset's units once (:class:`DatasetDef`), from its owner's
        client (``distribute_dataset``; ``runs=None`` registers a per-worker dataset)
        or a worker's loader (``session``); a differing definition is refused."""
        if not isinstance(dataset, (list, tuple)) or len(dataset) != len(DatasetDef._fields):
            raise TypeError(f"dataset must be a DatasetDef {DatasetDef._fields}, got "
                            f"{type(dataset).__name__}")
        d = DatasetDef._make(dataset)
        dataset_id = checks.text(d.dataset_id, "dataset_id")
        label = checks.text(d.label, "label", empty=True)
        runs = checks.optional(checks.pairs, d.runs, "runs", checks.MAX_RUNS)
        seed = checks.integer(d.seed, "seed", -(1 << 63), (1 << 63) - 1)
        if runs is not None and sum(r * n for r, n in runs) > checks.MAX_ROWS:
            raise ValueError(f"dataset {dataset_id!r} has more than {checks.MAX_ROWS} rows")
        if session is not None:
            if checks.text(session, "session") not in self.members:
                return {"expired": True}
            owner = ""
        else:
            self.owner_box(checks.text(owner, "owner"), checks.text(token, "token"))
        if runs is None:
            self.leases.register(dataset_id, label, owner, seed)
        else:
            self.leases.define(dataset_id, runs, label, owner, seed)
            self.ledgers.defined(dataset_id, self.leases)
        return {}

    def lease_acquire(self, session: str, dataset_id: str, epoch: int, rows: int,
                      least: int = 1) -> dict:
        """Lease ``rows`` rows of an epoch to ``session`` (fewer, not under ``least``,
        near the epoch's end): ``{"lease": intervals or None}``, ``{"expired": True}``
        for an ended session, ``{"failed": why}`` when the epoch cannot complete."""
        session = checks.text(session, "session")
        dataset_id = checks.text(dataset_id, "dataset_id")
        epoch = checks.integer(epoch, "epoch", 0, checks.MAX_EPOCH)
        rows = checks.integer(rows, "rows", 1, checks.MAX_ROWS)
        least = checks.integer(least, "least", 1, checks.MAX_ROWS)
        if not self.renew(session, time.monotonic()):
            return {"expired": True}
        try:
            lease = self.leases.acquire(session, dataset_id, epoch, rows,
                                        parts=max(1, len(self.members)), least=least)
        except SessionExpired:
            return {"expired": True}
        except EpochFailed as e:
            return {"failed": str(e)}
        return {"lease": lease}

    def lease_progress(self, dataset_id: str, epoch: int) -> dict:
        """An epoch's counts (read-only: never defines a table)."""
        return self.leases.progress(checks.text(dataset_id, "dataset_id"),
                                    checks.integer(epoch, "epoch", 0, checks.MAX_EPOCH))

    def lease_release(self, session: str, dataset_id: str, epoch: int, ranges: Any,
                      failure: Any = None) -> int:
        """Rows a session gives back (``failure``: ``[file, message]`` of a failed read);
        refused (0) from a session that ended. Rows freed."""
        session = checks.text(session, "session")
        dataset_id = checks.text(dataset_id, "dataset_id")
        epoch = checks.integer(epoch, "epoch", 0, checks.MAX_EPOCH)
        ranges = checks.pairs(ranges, "ranges", checks.MAX_RANGES)
        if failure is not None:
            if not isinstance(failure, (list, tuple)) or len(failure) != 2:
                raise TypeError(f"failure must be [file, message], got {failure!r:.80}")
            failure = (checks.text(failure[0], "failure file", 4096),
                       checks.text(failure[1], "failure message", 16384))
        if session not in self.members:
            return 0
        return self.leases.release(session, dataset_id, epoch, ranges, failure)

    def dataset_state(self, dataset_id: str, epoch: int) -> tuple:
        """The epoch's acknowledged rows (an :class:`EpochLedger`), for resuming."""
        dataset_id = checks.text(dataset_id, "dataset_id")
        epoch = checks.integer(epoch, "epoch", 0, checks.MAX_EPOCH)
        p = self.leases.progress(dataset_id, epoch)
        return tuple(EpochLedger(dataset_id, epoch,  # total: its row ids (a collection's
                                 # of unknown lengths: STRIDE per partition)
                                 self.leases.acknowledged(dataset_id, epoch),
                                 p.get("ids", p["total"])))

    def dataset_start(self, owner: str, token: str, ledger: Any) -> dict:
        """Start an epoch with the rows of ``ledger`` (an :class:`EpochLedger`) already
        acknowledged; refused once the epoch has started. Its progress."""
        self.owner_box(checks.text(owner, "owner"), checks.text(token, "token"))
        if not isinstance(ledger, (list, tuple)) or len(ledger) != len(EpochLedger._fields):
            raise TypeError(f"ledger must be an EpochLedger {EpochLedger._fields}")
        led = EpochLedger._make(ledger)
        dataset_id = checks.text(led.dataset_id, "dataset_id")
        epoch = checks.integer(led.epoch, "epoch", 0, checks.MAX_EPOCH)
        acked = checks.pairs(led.acknowledged, "acknowledged", checks.MAX_RANGES)
        p = self.leases.progress(dataset_id, epoch)
        total = p.get("ids", p["total"])
        if checks.integer(led.total, "total", 0, checks.MAX_ROWS) != total:
            raise ValueError(f"the ledger is of {led.total} rows; dataset {dataset_id!r} "
                             f"has {total}")
        self.leases.start_epoch(dataset_id, epoch, acked)
        return self.leases.progress(dataset_id, epoch)

    # -- durable commits: checkpoint ledgers (SPEC §4.3) ----------------------------------
    def _live(self, session: Any) -> str:
        session = checks.text(session, "session")
        if session not in self.members:
            raise ValueError(f"session {session!r} of coordinator {self.name!r} ended")
        return session

    def dataset_ledger(self, session: str, state: str) -> dict:
        """The ledger of State ``state``'s dynamic datasets now, by name (a checkpoint
        written at the State's current commit keeps it)."""
        self._live(session)
        return self.ledgers.export(checks.text(state, "state", 1024), self.leases)

    def restore_ledger(self, session: str, state: str, ledger: Any) -> list:
        """State ``state`` resumed from a checkpoint: its datasets' epochs go on from
        ``ledger`` (a name not defined yet waits for its dataset). The ids restored."""
        self._live(session)
        if not isinstance(ledger, dict) or len(ledger) > 1024:
            raise TypeError(f"ledger must be a dict of at most 1024 datasets, got "
                            f"{type(ledger).__name__}")
        return self.ledgers.restore(checks.text(state, "state", 1024), ledger, self.leases)

    def checkpoint_written(self, session: str, state: str, url: str, commits: int,
                           seconds: float, nbytes: int) -> None:
        """A State's writer reports a complete checkpoint (dashboard and metrics)."""
        if checks.text(session, "session") in self.members:
            self.stats.on_checkpoint(checks.text(state, "state", 1024),
                                     checks.text(url, "url", 4096),
                                     checks.integer(commits, "commits", 0, checks.MAX_ROWS),
                                     float(seconds),
                                     checks.integer(nbytes, "nbytes", 0, checks.MAX_ROWS))

    def forget_datasets(self, dataset_ids: list[str]) -> None:
        """Their handles were dropped: their lease tables and completed epochs go."""
        for dataset_id in dataset_ids:
            self.leases.forget(dataset_id)

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


# Handlers that are CoordinatorState's methods as they are (the plugin registers each
# as ``method(state_of(name), **kwargs)``): a message's name leads here, beside its method.
STATE_HANDLERS = {
    "daskdist_dataset_define": CoordinatorState.dataset_define,
    "daskdist_dataset_state": CoordinatorState.dataset_state,
    "daskdist_dataset_start": CoordinatorState.dataset_start,
    "daskdist_lease_acquire": CoordinatorState.lease_acquire,
    "daskdist_lease_progress": CoordinatorState.lease_progress,
    "daskdist_lease_release": CoordinatorState.lease_release,
    "daskdist_dataset_ledger": CoordinatorState.dataset_ledger,
    "daskdist_restore_ledger": CoordinatorState.restore_ledger,
    "daskdist_checkpoint_written": CoordinatorState.checkpoint_written,
}

"""CoordinatorState: one named coordinator on the scheduler, driving its books.

The coordinator's worker sessions (membership, session leases and their life: join,
drain, pause, removal, expiry), its per-worker resources and its status; the rest is
in its books, each with its own handlers (the pattern of Dask's
``active_memory_manager.py``: a thin extension driving small policy objects):

- :class:`~daskdist.plugins.scheduler.closures.ClosureBook`: the closure queue, the
  owners' outboxes, workers' long-polls, raising an owner's error;
- :class:`~daskdist.plugins.scheduler.gangs.GroupBook`: gangs, the collective group's
  generations, elastic commits;
- :class:`~daskdist.plugins.scheduler.datasets.LeaseBook`: dynamic datasets' leases
  and checkpoint ledgers;
- :class:`~daskdist.observe.book.RankBook`: what gang members measure (per-rank
  phases, stragglers, hangs and stacks);
- :class:`~daskdist.plugins.scheduler.inference.InferBook`: batch-inference jobs
  (``map_batches``), which ask the coordinator through its named methods below;
- :class:`~daskdist.plugins.scheduler.stats.CoordinatorStats`: the dashboard's counters.

Talks to workers only through the ``send`` callable the plugin provides (a message on
the worker's stream), so it imports nothing from Dask.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from daskdist import config
from daskdist.core import protocol
from daskdist.core.membership import LivenessTable, Membership
from daskdist.core.protocol import OWNER, RETIRING, SESSION, DatasetDef, Route
from daskdist.observe.book import RankBook
from daskdist.plugins.scheduler.closures import ClosureBook
from daskdist.plugins.scheduler.datasets import LeaseBook
from daskdist.plugins.scheduler.gangs import GroupBook
from daskdist.plugins.scheduler.inference import InferBook
from daskdist.plugins.scheduler.stats import CoordinatorStats

logger = logging.getLogger(__name__)


class CoordinatorState:
    """One named coordinator: its sessions, resources and books."""

    def __init__(self, name: str, max_worker_failures: int = 3,
                 send: Callable[[str, dict], None] | None = None,
                 lease_timeout: float = 30.0, locality: Any = None):
        self.name = name
        self.send = send or (lambda address, msg: None)
        # where persisted partitions lie (plugins/scheduler/locality.py; the
        # plugin's, None when the state is driven without a scheduler)
        self.locality = locality
        # sessions, their indices and leases (SPEC §2.4); the settings read on every
        # exchange, read once (parsing a duration is not free)
        self.members = Membership(leases=LivenessTable(lease_timeout),
                                  poll_base=config.seconds("scheduler.poll-interval"),
                                  renew_base=config.seconds("liveness.renew-interval"))
        self.stats = CoordinatorStats()  # dashboard counters and history (stats.py)
        self.closure_book = ClosureBook(self, max_worker_failures)
        self.group_book = GroupBook(self, max_worker_failures, relay_fanout=protocol.integer(
            config.integer("collective.relay-fanout"), "daskdist.collective.relay-fanout",
            1, 2**16))
        self.lease_book = LeaseBook(self, max_worker_failures)
        self.rank_book = RankBook(self)  # per-rank phases, stragglers, hangs (SPEC §5.1)
        self.infer_book = InferBook(self, max_worker_failures)  # batch inference (SPEC §7)
        # the books' pure state machines, by the names the rest of the package uses
        self.queue = self.closure_book.queue
        self.outboxes = self.closure_book.outboxes
        self.gangs = self.group_book.gangs
        self.commits = self.group_book.commits
        self.leases = self.lease_book.leases
        self.ledgers = self.lease_book.ledgers
        self.resources: dict[str, bytes] = {}
        self.resource_owners: dict[str, str] = {}  # rid -> the owner that registered it
        self.workers_lost = 0  # removals Dask did not expect
        self.resources_released = 0
        self._membership_flush: asyncio.TimerHandle | None = None
        self.told_version = 0  # the membership version the group's members last heard
        self.closed = False  # the last owner left: the plugin tears this coordinator down
        # Coordinator(resources=..., members=...): the Dask resources a worker must
        # declare to be a member, and "gpu" when it must have a GPU by the Dask
        # convention (the first Coordinator of the name decides; None: every worker)
        self.member_resources: dict | None = None
        self.member_kind: str | None = None
        # the workers that are not members (their plugin said so on their own stream):
        # they compute a collection's partitions for the members
        self.helpers: set[str] = set()

    # -- owners (client-side Coordinators) ---------------------------------------------
    def drop_owner(self, owner: str) -> list:
        """An owner closed (or its client is gone): cancel its queued closures and pending
        gangs, release its per-worker resources on every worker and forget its error.
        Returns the outcomes it had not yet read (its finished closures among them);
        a long-poll of it returns at once. Closures already running finish on their
        workers, their results dropped; workers give back the ones they had not started
        (held, like an owner whose error is raised), and those are cancelled."""
        self.gangs.cancel_pending(owner)
        self.release_resources([rid for rid, o in self.resource_owners.items() if o == owner])
        self.lease_book.forget_datasets(  # its datasets go with it
            [d for d, ds in self.leases.datasets.items() if ds.owner == owner])
        box = self.closure_book.drop_owner(owner)
        if box is None:
            return []
        box.event.set()
        return list(box.items)

    def add_resource(self, owner: str, rid: str, payload: bytes) -> None:
        self.resources[rid] = payload
        self.resource_owners[rid] = owner

    def release_resources(self, rids: list[str]) -> None:
        """Forget per-worker resources here and on every worker (their objects and
        iterators are closed there)."""
        rids = [rid for rid in rids if self.resources.pop(rid, None) is not None]
        for rid in rids:
            self.resource_owners.pop(rid, None)
        self.lease_book.forget_datasets(rids)  # a dataset's identity is its resource id
        if rids:
            self.resources_released += len(rids)
            self.broadcast({"op": "daskdist-release", "name": self.name, "rids": rids})

    def close(self) -> None:
        """No owner is left: end every wait on this coordinator (worker long-polls,
        raises, commits). The plugin drops it and unregisters its worker plugin."""
        self.closed = True
        if self._membership_flush is not None:
            self._membership_flush.cancel()
            self._membership_flush = None
        self.closure_book.close()
        self.group_book.close()
        self.rank_book.close()
        self.infer_book.close()

    # -- workers ---------------------------------------------------------------------
    def broadcast(self, msg: dict, sessions: Iterable[str] | None = None,
                  addressed: bool = False) -> None:
        """Send ``msg`` on the stream of every member worker (or of ``sessions``);
        ``addressed``: each copy names its member's session (membership counters are a
        session's: a worker drops those addressed to a session that ended)."""
        members = self.members.members
        if sessions is None:
            sessions = list(members)
        for session in sessions:
            m = members.get(session)
            if m is not None:
                self.send(m.address, {**msg, "session": session} if addressed else msg)

    def membership_changed(self) -> None:
        """A session joined or left, or a group member's status changed: the group's
        members hear the new membership version (what ``State.commit()`` compares) in
        one message per ``scheduler.membership-interval``, however many changes it
        holds; every other worker reads it from its next exchange's reply."""
        self.gangs.membership_changed()  # the running gang's run is not a repeat
        self.group_book.changed.set()
        if self._membership_flush is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (the state driven directly): at once
            self.flush()
            return
        self._membership_flush = loop.call_later(
            config.seconds("scheduler.membership-interval"), self.flush)

    def flush(self) -> None:
        """Send what :meth:`membership_changed` held back (the group's members only)."""
        handle, self._membership_flush = self._membership_flush, None
        if handle is not None:
            handle.cancel()
        if self.closed or self.told_version == self.members.version:
            return  # the members heard it with a peer loss
        group = self.gangs.group
        if self.group_book.told == group.generation:
            # they heard that their generation broke: the next formation's init carries
            # the counters (a further loss in it costs no message to every member)
            self.told_version = self.members.version
            return
        self.broadcast({"op": "daskdist-membership", "name": self.name, **self.members.counters()},
                       group.sessions, addressed=True)
        self.told_version = self.members.version

    def start_session(self, session: str, address: str, slots: int, device: str, gpu: str,
                      retiring: Callable[[str], bool], now: float) -> dict[str, Any]:
        """A worker plugin session joins: the lowest free worker index, a lease, ``slots``
        closure slots. An older session of the same worker ends first; a worker that
        ``retiring(address)`` says is leaving joins draining. With per-worker resources
        registered, it *warms* first: the reply names them (``warm``), it builds them
        and says it is ready (:meth:`session_ready`); until then it runs closures but is
        left out of the group, and the group's members, unaware of it, train on. The
        register reply."""
        old = self.members.session_of(address)
        if old is not None and old != session:
            self.end_session(old)
        warm = [rid for rid in self.resources if not rid.startswith("iterator-")]
        member, _ = self.members.join(session, address, device, gpu, now=now,
                                      warming=bool(warm))
        self.queue.add_session(session, slots)
        if not warm:
            self.membership_changed()
        if retiring(address):
            self.members.drain(address)
            self.queue.drain_session(session)
        self.closure_book.changed.set()  # create() waits for its workers on it
        return {
            "index": member.index,
            "num_workers": len(self.members),
            **self.members.counters(),
            "renew": self.members.renew_interval(),
            "warm": warm,
            "observe": self.rank_book.window,  # its gang members' window (0: not measured)
        }

    def session_ready(self, session: str) -> None:
        """A warming session built its per-worker resources: it joins the group at the
        members' next commit (one-way)."""
        if self.members.ready(session):
            self.membership_changed()

    def stop_session(self, session: str, results: list | None = None) -> None:
        """A worker plugin session closes (teardown): its last results, then its end (an
        expected leave: not counted as lost)."""
        if results:
            self.closure_book.apply_results(session, results)
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
        retiring = status in RETIRING
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
        self.closure_book.wake_sessions((session,))  # its long-poll re-checks where it waits
        self.closure_book.wake_idle()

    def worker_removed(self, session: str, expected: bool) -> None:
        """Dask removed the worker of ``session``. A retired group member stays a member
        until its plugin's teardown unregisters it: its gang member leaves at its next
        commit (a last holder checkpoints there), which needs the scheduler, at most
        ``daskdist.preemption.grace``; its lease bounds the wait. Otherwise it ends now."""
        member = self.members.members.get(session)
        if (expected and member is not None and member.draining
                and session in self.gangs.group.sessions):
            self.group_book.departing.add(session)
            return
        self.end_session(session, expected)

    def end_session(self, session: str, expected: bool = True) -> None:
        """A worker session is gone: put its closures back, drop its index and leases.

        ``expected`` is Dask's word on a removed worker: retired or closed (True), or
        killed, crashed, cut off (False: counted as a lost worker).
        """
        self.stats.on_session_end(self, session)
        # a retiring worker outside the group (it left at a commit, or never joined it)
        # changes nothing for the group's members: no second re-formation
        member = self.members.members.get(session)
        self.members.leave(session, counted=not (member is not None and member.draining
                                                 and session not in self.gangs.group.ranks))
        self.workers_lost += not expected
        self.leases.drop_session(session)
        self.rank_book.session_ended(session)
        self.group_book.session_lost(session, expected)  # a member's loss tells the rest
        self.membership_changed()  # (so this sends nothing more to them)
        book = self.closure_book
        backlog = self.queue.backlog
        book.deliver(self.queue.remove_session(session, expected))
        if book.dropped:
            book.settle_dropped(set(book.dropped))
        book.wake_sessions((session,))  # its own long-poll returns
        book.wake(max(0, self.queue.backlog - backlog))  # its closures, back in the queue
        self.infer_book.session_ended(session)  # its rows are free: jobs queue for them

    def expire_sessions(self, now: float) -> list[str]:
        """End every session silent for ``lease-timeout`` like a lost worker (fenced: its
        later messages are refused because it is no longer a member)."""
        expired = self.members.leases.expire(now)
        for session in expired:
            if session in self.members:
                self.end_session(session, expected=session in self.group_book.departing)
        return expired

    def fence_silent(self, sessions: Iterable[str], since: float) -> list[str]:
        """End (as lost, fenced) those of ``sessions`` that sent nothing after ``since``
        (time.monotonic()): a formation's members that answered nothing for its
        whole deadline. The ones ended."""
        out = [s for s in sessions if s in self.members
               and self.members.leases.last(s) is not None and self.members.leases.last(s) < since]
        for session in out:
            self.members.leases.expiries += 1
            logger.warning("daskdist[%s]: session %s answered nothing while the group "
                           "formed: ended (fenced)", self.name, session)
            self.end_session(session, expected=False)
        return out

    def active_sessions(self) -> tuple[str, ...]:
        """Sessions that may be in the group, in worker-index (rank) order (not leaving,
        not warming)."""
        return tuple(m.session for m in self.members.by_index()
                     if not m.draining and not m.warming)

    # -- per-worker resources: routes ---------------------------------------------------------
    def resource_add(self, owner: str, token: str, rid: str, payload: bytes) -> None:
        """Register a per-worker resource's spec (one-way)."""
        op = "daskdist_add_resource"
        protocol.text(rid, f"{op}: rid")
        if not isinstance(payload, bytes):
            raise TypeError(f"{op}: payload must be bytes, got {type(payload).__name__}")
        if self.resource_owners.get(rid, owner) != owner:
            raise PermissionError(f"{op}: resource {rid!r} is another owner's")
        self.add_resource(owner, rid, payload)

    def resource_get(self, session: str, rid: str) -> bytes | None:
        """A worker session's per-worker resource spec (``None``: released or unknown)."""
        return self.resources.get(protocol.text(rid, "daskdist_get_resource: rid"))

    def resource_release(self, owner: str, token: str, rids: list) -> None:
        """The client dropped these per-worker resources: forget them here and on every
        worker (one-way; the client sends it once no closure can still use them)."""
        rids = protocol.texts(rids, "daskdist_release_resources: rids")
        self.release_resources([rid for rid in rids if self.resource_owners.get(rid) == owner])

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
            "warming": self.members.warming,  # of them, still building their resources
            "worker_joins": self.members.joins,
            "worker_leaves": self.members.leaves,
            "workers_lost": self.workers_lost,
            "lease_expiries": self.members.leases.expiries,
            "steals": self.closure_book.steals,
            "acks_refused": self.closure_book.acks_refused,
            "resources": len(self.resources),
            "resources_released": self.resources_released,
            "error_pending": bool(self.queue.errors),
            "owners": len(self.outboxes),
            "membership_version": self.members.version,
            "group_generation": group.generation,
            "group_size": len(group.sessions),
            "gangs_pending": len(self.gangs.pending),
            "inference": self.infer_book.summary(),  # batch-inference jobs, by name
        }

    # -- what the books ask of their coordinator (their Protocols) ----------------------------
    def define_dataset(self, dataset: DatasetDef, owner: str) -> None:
        """Define a dynamic dataset's units for ``owner`` (as its client would)."""
        self.lease_book.dataset_define(tuple(dataset), owner=owner)

    def forget_datasets(self, dataset_ids: list[str]) -> None:
        """Forget dynamic datasets (their lease tables, locality and counters)."""
        self.lease_book.forget_datasets(dataset_ids)

    def queue_closure(self, cid: str, owner: str, payload: Any, tag: str | None) -> None:
        """Queue a closure of a book's own ``owner`` (``tag``: the dataset it reads) and
        wake a worker waiting for work."""
        if self.queue.put(cid, owner, payload, tag=tag):
            self.closure_book.wake(1)

    def cancel_closures(self, owner: str) -> None:
        """Cancel ``owner``'s queued closures (a book's: nobody waits for their outcomes)."""
        self.queue.cancel_pending(owner)

    def take_error(self, owner: str) -> None:
        """Forget ``owner``'s unraised error (a book's owner: the book keeps its own)."""
        self.queue.take_error(owner)

    def member_count(self) -> int:
        return len(self.members)

    def address_of(self, session: str) -> str:
        member = self.members.members.get(session)
        return member.address if member is not None else ""


# The coordinator's own routes (per-worker resources), registered by the plugin with the
# books' (protocol.book_handler); the "book" is the coordinator itself.
STATE_ROUTES = {
    "daskdist_add_resource": Route(CoordinatorState.resource_add, caller=OWNER),
    "daskdist_get_resource": Route(CoordinatorState.resource_get, caller=SESSION, ended=None),
    "daskdist_release_resources": Route(CoordinatorState.resource_release, caller=OWNER),
    "daskdist_session_ready": Route(CoordinatorState.session_ready, None, SESSION, None),
}

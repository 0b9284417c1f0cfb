"""CoordinatorState: one named coordinator on the scheduler, driving its books.

The coordinator's worker sessions (membership, session leases and their life: join,
drain, pause, removal, expiry) and its status; the rest is in its books, each with its
own handlers (the pattern of Dask's ``active_memory_manager.py``: a thin extension
driving small policy objects):

- :class:`~daskdist.plugins.scheduler.closures.ClosureBook`: the closure queue, the
  owners' outboxes, workers' long-polls, raising an owner's error;
- :class:`~daskdist.plugins.scheduler.gangs.GroupBook`: gangs, the collective group's
  generations (formed by its :class:`~daskdist.plugins.scheduler.groups.GroupDriver`),
  elastic commits;
- :class:`~daskdist.plugins.scheduler.datasets.LeaseBook`: dynamic datasets' leases
  and checkpoint ledgers;
- :class:`~daskdist.plugins.scheduler.resources.ResourceBook`: per-worker resources;
- :class:`~daskdist.observe.book.RankBook`: what gang members measure (per-rank
  phases, stragglers, hangs and stacks);
- :class:`~daskdist.plugins.scheduler.asynchronous.book.AsyncBook`: asynchronously
  trained models (who holds each, its versions, the rows its pushes wait with);
- :class:`~daskdist.plugins.scheduler.stats.CoordinatorStats`: the dashboard's counters;
- :class:`~daskdist.plugins.scheduler.lifetime.keepalive.KeepBook`: keep-alive owners
  (their unread values, their clients' absences, attaching);
- :class:`~daskdist.plugins.scheduler.lifetime.preemptions.PreemptBook`: workers'
  preemption deadlines;
- :class:`~daskdist.plugins.scheduler.inference.book.InferBook`: batch-inference jobs
  (``map_batches``).

The books never reach each other: each declares a ``Protocol`` of what it asks its
coordinator, and the coordinator routes every such call to the book that holds the
answer (:class:`BookSeams`, the half of the coordinator that joins its books). Talks
to workers only through the ``send`` callable the plugin provides (a message on the
worker's stream), and forms groups through the scheduler the plugin attaches, so it
imports nothing from Dask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from daskdist import config
from daskdist.core import checks
from daskdist.core.gang import GangBook
from daskdist.core.leases.ledgers import Ledgers
from daskdist.core.leases.table import LeaseTable, group_tokens
from daskdist.core.membership import LivenessTable, Membership
from daskdist.core.protocol import RETIRING, SESSION, DatasetDef, Outcome, Route
from daskdist.core.queue import ClosureQueue
from daskdist.observe.book import RankBook
from daskdist.plugins.scheduler.asynchronous.book import AsyncBook
from daskdist.plugins.scheduler.closures import ClosureBook
from daskdist.plugins.scheduler.datasets import LeaseBook
from daskdist.plugins.scheduler.gangs import GroupBook
from daskdist.plugins.scheduler.groups import GroupDriver
from daskdist.plugins.scheduler.inference.book import InferBook
from daskdist.plugins.scheduler.lifetime.keepalive import KeepBook
from daskdist.plugins.scheduler.lifetime.preemptions import PreemptBook
from daskdist.plugins.scheduler.locality import Locality
from daskdist.plugins.scheduler.polls import wait_event
from daskdist.plugins.scheduler.resources import ResourceBook
from daskdist.plugins.scheduler.stats import CoordinatorStats

logger = logging.getLogger(__name__)


class BookSeams:
    """What the books ask their coordinator, each call routed to the book that holds the
    answer: what each book's ``Protocol`` declares (``ClosureCoordinator``,
    ``GroupCoordinator``, ``LeaseCoordinator``, ``InferenceCoordinator``,
    ``AsyncCoordinator``, ...); the half of :class:`CoordinatorState` that joins its
    books."""

    closure_book: ClosureBook
    group_book: GroupBook
    lease_book: LeaseBook
    resource_book: ResourceBook
    infer_book: InferBook
    preempt_book: PreemptBook
    stats: CoordinatorStats
    queue: ClosureQueue  # the closure book's
    gangs: GangBook  # the group book's
    leases: LeaseTable  # the lease book's
    ledgers: Ledgers  # the lease book's

    def member_finished(self, outcome: Outcome) -> None:
        """A gang member's closure ended: the group book judges its gang."""
        self.group_book.member_finished(outcome)

    def deliver_gang(self, outcome: Outcome) -> None:
        """A gang's outcome to its owner (the closure book's outboxes)."""
        self.closure_book.deliver_gang(outcome)

    def put_gang(self, members: list[tuple[str, str, int]], payload: list) -> None:
        """A gang starts: its member closures, each pinned to its session, to the queue."""
        self.closure_book.put_gang(members, payload)

    def gang_owner(self) -> str | None:
        """The owner of the gang running now (``None``: none)."""
        return self.group_book.gang_owner()

    def cancel_gangs(self, owner: str) -> list[Outcome]:
        """Cancel ``owner``'s pending gangs: their outcomes."""
        return self.group_book.cancel_gangs(owner)

    def hold_owner(self, owner: str, hold: bool) -> None:
        """Hold (or release) ``owner``'s queued closures (the closure book)."""
        self.closure_book.hold_owner(owner, hold)

    def hand_over(self, owner: str, client: str | None) -> tuple[str, list[str], list[str]]:
        """``client`` acts as ``owner`` from now on (its outbox's): the new secret, and
        the ids of its closures and of its gangs not finished."""
        token, closures = self.closure_book.hand_over(owner, client)
        return token, closures, self.group_book.gangs_of(owner)

    def group_sessions(self) -> tuple[str, ...]:
        """The current group generation's sessions, in rank order."""
        return self.gangs.group.sessions

    def formation_noted(self, generation: int, ok: bool, seconds: float,
                        members: int) -> None:
        """A formation ended (the dashboard's events)."""
        self.stats.on_formation(generation, ok, seconds, members)

    def takes(self, dataset: str, session: str) -> bool:
        """Whether ``session`` should run a closure reading ``dataset`` now (the lease
        table's word at an epoch's tail)."""
        return self.leases.takes(dataset, session)

    def holders(self, dataset: str) -> Iterable[str]:
        """The sessions holding ``dataset``'s leased rows."""
        return self.leases.holders(dataset)

    def settle_tokens(self, session: str, tokens: list, ack: bool) -> bool:
        """A finished closure's lease tokens, acknowledged or released (the lease book)."""
        return self.lease_book.settle_tokens(session, tokens, ack)

    def ack_sessions(self, per_session: Mapping[str, Iterable[object]]) -> bool:
        """A commit's rows, per session, acknowledged all or none (the lease table)."""
        return self.leases.ack_sessions(per_session)

    def ack_tables(self, tables: Mapping[tuple[str, int],
                                         Sequence[tuple[str, Sequence]]]) -> bool:
        """A commit's rows, per epoch table, acknowledged all or none (the lease table)."""
        return self.leases.ack_tables(tables)

    def dataset_of(self, key: int) -> str | None:
        """The dataset a packed commit part's dataset key names."""
        return self.leases.dataset_of(key)

    def note_trained(self, state: str, tokens: Iterable[object]) -> None:
        """State ``state`` trained on the datasets these lease tokens name (its ledger)."""
        self.ledgers.note(state, tokens)

    def note_trained_tables(self, state: str, tables: Iterable[tuple[str, int]]) -> None:
        """State ``state`` trained on these (dataset, epoch) tables (its ledger)."""
        self.ledgers.note_tables(state, tables)

    def note_checkpoint(self, state: str, url: str, commits: int, seconds: float,
                        nbytes: int) -> None:
        """A State's writer completed a checkpoint (the dashboard's)."""
        self.stats.on_checkpoint(state, url, commits, seconds, nbytes)

    def forget_datasets(self, dataset_ids: list[str]) -> None:
        """These datasets' handles were dropped: their lease tables and row counts go."""
        self.stats.forget_datasets(self.lease_book.forget_datasets(dataset_ids))

    def resources_released(self, rids: list[str]) -> None:
        """Per-worker resources released (their handles dropped): the datasets they are
        go, and the asynchronous models whose replicas they were."""
        self.forget_datasets(rids)
        self.async_book.replicas_released(rids)

    def hand_rows(self, source: str, target: str, tokens: list) -> bool:
        """Lease tokens' rows move from ``source``'s lease to ``target``'s, all or none."""
        return self.leases.transfer_tokens(source, target, tokens)

    def rows_only_with(self, session: str, tokens: list) -> bool:
        """Whether the epochs of lease tokens have nothing left but ``session``'s rows
        (``False`` for none, or a malformed token)."""
        try:
            return self.leases.only_with(session, group_tokens(tokens))
        except ValueError:
            return False

    def rows_forgotten(self, tokens: list) -> bool:
        """Whether every dataset lease tokens name was forgotten (its handle dropped,
        its coordinator closed): their rows have no ledger left to count them in."""
        try:
            keys = group_tokens(tokens)
        except ValueError:
            return False
        return bool(keys) and all(ds not in self.leases.datasets for ds, _ in keys)

    def release_rows(self, session: str, tokens: list) -> int:
        """Lease tokens' rows leased to ``session`` go back: rows freed."""
        return self.leases.release_tokens(session, tokens)

    def export_ledger(self, state: str) -> dict:
        """The datasets' ledger of ``state`` (a State or a model) now, by name."""
        return self.ledgers.export(state, self.leases)

    def restore_ledger(self, state: str, ledger: dict) -> list:
        """``state`` resumed from a checkpoint's datasets' ledger: the ids restored."""
        return self.ledgers.restore(state, ledger, self.leases)

    def leaving(self, session: str) -> bool:
        """Whether ``session``'s worker has a preemption deadline within the horizon."""
        return self.preempt_book.leaving(session)

    def member_leaving(self, session: str) -> None:
        """``session``'s deadline came within the horizon: the asynchronous models it is
        the standby of get another (the preemption book)."""
        self.async_book.standby_leaving(session)

    def job_closure_finished(self, outcome: Outcome) -> None:
        """A batch-inference job's closure ended: the inference book drives its job."""
        self.infer_book.closure_finished(outcome)

    def put_job_closure(self, cid: str, owner: str, payload: list, tag: str | None) -> None:
        """A batch-inference job's closure to the queue (the closure book)."""
        self.closure_book.put_job(cid, owner, payload, tag)

    def cancel_closures(self, owner: str) -> None:
        """Cancel the queued closures of ``owner`` (a job's own: nobody reads their
        outcomes)."""
        self.queue.cancel_pending(owner)

    def define_dataset(self, dataset: DatasetDef, owner: str) -> None:
        """Define a dynamic dataset's units for ``owner`` (the lease book)."""
        self.lease_book.dataset_define(tuple(dataset), owner=owner)

    def resume_dataset(self, dataset_id: str, epoch: int, acknowledged: list,
                       lengths: list | None) -> None:
        """Start an epoch of a dataset from what a ledger holds (the lease book)."""
        self.lease_book.resume(dataset_id, epoch, acknowledged, lengths)

    def epoch_progress(self, dataset_id: str, epoch: int) -> dict:
        """An epoch's counts (the lease table's; read-only)."""
        return self.leases.progress(dataset_id, epoch)

    def ack_tokens(self, session: str, tokens: list) -> bool:
        """The rows of a session's lease tokens acknowledged, all or none (the lease
        table)."""
        return self.leases.ack_tokens(session, tokens)

    def add_resource(self, owner: str, rid: str, payload: bytes) -> None:
        """A per-worker resource of ``owner`` (the resource book)."""
        self.resource_book.add(owner, rid, payload)

    def release_resources(self, rids: list[str]) -> None:
        """Release per-worker resources here and on every worker (the resource book)."""
        self.resource_book.release(rids)


class CoordinatorState(BookSeams):
    """One named coordinator: its sessions, and the books it routes between."""

    def __init__(self, name: str, max_worker_failures: int = 3,
                 send: Callable[[str, dict], None] | None = None,
                 lease_timeout: float = 30.0, locality: Locality | None = None,
                 expire: Callable[[str], None] | None = None):
        self.name = name
        self.send = send or (lambda address, msg: None)
        self.closed = False  # the last owner left: the plugin tears this coordinator down
        # sessions, their indices and leases (SPEC §2.4); the settings read on every
        # exchange, read once (parsing a duration is not free)
        self.members = Membership(leases=LivenessTable(lease_timeout),
                                  poll_base=config.seconds("scheduler.poll-interval"),
                                  renew_base=config.seconds("liveness.renew-interval"))
        self.stats = CoordinatorStats()  # dashboard counters and history (stats.py)
        # the books; the stats' counters are wired in here, so that counting a closure's
        # result or an acknowledged row runs nothing of the stats
        self.closure_book = ClosureBook(self, max_worker_failures, self.stats.finished)
        self.group_book = GroupBook(self, max_worker_failures, relay_fanout=checks.integer(
            config.integer("collective.relay-fanout"), "daskdist.collective.relay-fanout",
            1, 2**16))
        # ``locality``: where persisted partitions lie (the plugin's; None when the state
        # is driven without a scheduler)
        self.lease_book = LeaseBook(self, max_worker_failures, self.stats.on_rows, locality,
                                    on_open=self.closure_book.polls.reopened)
        self.resource_book = ResourceBook(self)
        self.rank_book = RankBook(self)  # per-rank phases, stragglers, hangs (SPEC §5.1)
        # keep-alive owners (SPEC §4.6), ``expire`` dropping one nobody attached to
        self.keep_book = KeepBook(self, expire or self.drop_owner)
        self.preempt_book = PreemptBook(self)  # workers' preemption deadlines (SPEC §4.6)
        self.async_book = AsyncBook(self)  # one model trained asynchronously (SPEC §2.8)
        self.infer_book = InferBook(self, max_worker_failures)  # batch inference (SPEC §7)
        # the books' pure state machines, by the names tests and the dashboard read
        self.queue = self.closure_book.queue
        self.outboxes = self.closure_book.outboxes
        self.gangs = self.group_book.gangs
        self.commits = self.group_book.commits
        self.leases = self.lease_book.leases
        self.ledgers = self.lease_book.ledgers
        self.resources = self.resource_book.specs
        self.workers_lost = 0  # removals Dask did not expect
        # Coordinator(resources=..., members=...): the Dask resources a worker must
        # declare to be a member, and "gpu" when it must have a GPU by the Dask
        # convention (the first Coordinator of the name decides; None: every worker)
        self.member_resources: dict | None = None
        self.member_kind: str | None = None
        # the workers that are not members (their plugin said so on their own stream):
        # they compute a collection's partitions for the members
        self.helpers: set[str] = set()

    def attach_scheduler(self, scheduler: Any, next_generation: Callable[[], int]
                         ) -> GroupDriver:
        """The scheduler this coordinator runs on: its RPC forms groups (the group
        book's driver, numbering generations by ``next_generation``) and collects
        stacks, its metrics show GPU use. The driver."""
        self.rank_book.scheduler = scheduler
        return self.group_book.attach_driver(scheduler.rpc, next_generation)

    # -- owners (client-side Coordinators) ---------------------------------------------
    def add_owner(self, owner: str, client: str | None, token: str,
                  keep_alive: bool = False) -> None:
        # keep_alive: its work outlives its client (the keep book keeps its outcomes)
        self.closure_book.add_owner(owner, client, token,
                                    self.keep_book.keep(owner) if keep_alive else None)

    def check_owner(self, owner: str, token: str) -> None:
        """``PermissionError`` unless ``token`` is the secret of ``owner`` (a client acts
        only as the owner it attached as)."""
        self.closure_book.owner_box(owner, token)

    def has_owners(self) -> bool:
        return bool(self.outboxes)

    def owners_of(self, client: str, kept: bool = True) -> list[str]:
        """The owners attached from ``client`` (``kept=False``: but the keep-alive ones)."""
        owners = self.closure_book.owners.of_client(client)
        return owners if kept else [o for o in owners if not self.keep_book.kept_alive(o)]

    def client_away(self, client: str, away: bool) -> None:
        """``client`` left (``away``) or came back: the keep book's owners of it wait."""
        self.keep_book.client_away(client, away)

    def drop_owner(self, owner: str) -> list:
        """An owner closed (or its client is gone): cancel its queued closures, pending
        gangs, asynchronous models and the batch-inference jobs only it held, release its
        per-worker resources on every worker and forget its error.
        Returns the outcomes it had not yet read (its finished closures among them);
        a long-poll of it returns at once. Closures already running finish on their
        workers, their results dropped; workers give back the ones they had not started
        (held, like an owner whose error is raised), and those are cancelled."""
        self.group_book.cancel_gangs(owner)
        self.keep_book.forget(owner)
        self.async_book.drop_owner(owner)  # its models' open rows go back first
        self.infer_book.owner_dropped(owner)  # the jobs no other owner holds: cancelled
        self.resource_book.release_owner(owner)
        self.forget_datasets(  # its datasets go with it
            [d for d, ds in self.leases.datasets.items() if ds.owner == owner])
        box = self.closure_book.drop_owner(owner)
        if box is None:
            return []
        box.event.set()
        return list(box.items)

    async def wait_changed(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the next session start or end, helper, or
        finished closure (a ``create`` waits for its workers); whether one came."""
        changed = self.closure_book.changed
        changed.clear()
        return await wait_event(changed, timeout)

    def close(self) -> None:
        """No owner is left: end every wait on this coordinator (worker long-polls,
        raises, commits). The plugin drops it and unregisters its worker plugin."""
        self.closed = True
        for book in (self.closure_book, self.group_book, self.rank_book, self.keep_book,
                     self.preempt_book, self.async_book, self.infer_book):
            book.close()

    # -- what the dashboard reads -------------------------------------------------------
    def dataset_progress(self) -> list[dict]:
        """The newest epoch of every dynamic dataset (a completed epoch too)."""
        leases = self.leases
        return [leases.progress(d, e) for d, e in sorted(leases.newest_epochs().items())]

    def rank_report(self, limit: int | None = None) -> dict:
        """The gang's per-rank report (SPEC §5.1; ``limit``: the slowest ranks only)."""
        return self.rank_book.report(limit=limit)

    def rank_totals(self) -> list[tuple[int, str, list[float], float, bool]]:
        """Every rank's totals so far (Prometheus)."""
        return self.rank_book.totals()

    def group_info(self) -> dict:
        """The collective group's description."""
        return self.group_book.described()

    def async_reports(self) -> list[dict]:
        """Every asynchronous model's report (SPEC §2.8)."""
        return self.async_book.reports()
    def inference_report(self) -> list[dict]:
        """Every batch-inference job's progress, newest last (SPEC §7)."""
        return self.infer_book.report()

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
        """A session joined or left, or a group member's status changed: the group book
        tells the group's members (one message per ``scheduler.membership-interval``)."""
        self.group_book.membership_changed()

    def flush(self) -> None:
        """Send the membership message the group book holds back, now."""
        self.group_book.flush()

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
        warm = self.resource_book.warm()
        member, _ = self.members.join(session, address, device, gpu, now=now,
                                      warming=bool(warm))
        self.queue.add_session(session, slots)
        self.async_book.member_joined()  # a model without a standby gets it
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

    def add_helper(self, worker: str) -> None:
        """``worker`` is not a member: it computes partitions for the members."""
        self.helpers.add(worker)
        self.closure_book.changed.set()  # a create waiting for the workers counts it

    def stop_session(self, session: str, results: list | None = None,
                     started: Iterable[str] | None = None) -> None:
        """A worker plugin session closes (teardown): which of its closures started
        (exactly: nothing more starts), its last results, then its end (an expected
        leave: not counted as lost)."""
        if started is not None and session in self.members:
            self.queue.observe(session, (), started, final=True)
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
        self.stats.on_session_end(self.members, session, self.gangs.group)
        # a retiring worker outside the group (it left at a commit, or never joined it)
        # changes nothing for the group's members: no second re-formation
        member = self.members.members.get(session)
        address = member.address if member is not None else ""
        self.members.leave(session, counted=not (member is not None and member.draining
                                                 and session not in self.gangs.group.ranks))
        self.workers_lost += not expected
        self.leases.drop_session(session)
        self.async_book.session_lost(session, address)  # a lost holder's model recovers
        self.rank_book.session_ended(session)
        self.group_book.session_lost(session, expected)  # a member's loss tells the rest
        self.membership_changed()  # (so this sends nothing more to them)
        self.closure_book.session_ended(session, expected)
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
        not warming, no preemption deadline within the horizon)."""
        leaving = self.preempt_book.leaving
        return tuple(m.session for m in self.members.by_index()
                     if not m.draining and not m.warming and not leaving(m.session))

    def status(self) -> dict[str, Any]:
        members = self.members
        return {
            "name": self.name,
            **self.closure_book.status(),
            "workers": len(members),
            "warming": members.warming,  # of them, still building their resources
            "worker_joins": members.joins,
            "worker_leaves": members.leaves,
            "workers_lost": self.workers_lost,
            "lease_expiries": members.leases.expiries,
            "resources": len(self.resources),
            "resources_released": self.resource_book.released,
            "membership_version": members.version,
            **self.group_book.status(),
            "preemptions": self.preempt_book.listing(),  # deadlines, soonest first
            "async_models": self.async_book.status(),  # each model's few counts
            "inference": self.infer_book.summary(),  # batch-inference jobs, by name
        }


# The coordinator's own route, registered by the plugin with the books'
# (protocol.book_handler); the "book" is the coordinator itself.
STATE_ROUTES = {
    "daskdist_session_ready": Route(CoordinatorState.session_ready, None, SESSION, None),
}

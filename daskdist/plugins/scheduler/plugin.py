"""CoordinatorPlugin: the scheduler side of daskdist.

A ``SchedulerPlugin`` that owns one :class:`ClosureQueue` and one :class:`Membership`
per coordinator name, registers RPC handlers on the scheduler (the pattern of
``distributed/semaphore.py``), and reacts to Dask's own ``remove_worker`` and
worker-status events, so preemption is handled the moment Dask notices it.

Clients put closures and long-poll for their outcomes; worker plugins long-poll for
closures, reporting results in the same call. Payloads stay opaque bytes here: this
module never imports torch, pyarrow or ``collective/`` (SPEC §1).

Load it with ``dask scheduler --preload daskdist.plugins.scheduler`` or let
``Coordinator`` register it from the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from daskdist import config
from daskdist.core.protocol import (
    PLUGIN_NAME,
    CommitKey,
    Dispatch,
    Submission,
    worker_plugin_name,
)
from daskdist.plugins import WORKER_PLUGIN, PluginRef
from daskdist.plugins.scheduler import observe
from daskdist.plugins.scheduler.groups import GroupDriver
from daskdist.plugins.scheduler.state import CoordinatorState, Outbox, wait_event

logger = logging.getLogger(__name__)


class CoordinatorPlugin(SchedulerPlugin):
    """Holds every named coordinator on this scheduler and serves their RPCs."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.coordinators: dict[str, CoordinatorState] = {}
        self.drivers: dict[str, GroupDriver] = {}
        self.generations = 0  # last collective-group generation handed out (any coordinator)
        self.scheduler = None
        # worker -> whether Dask expected its removal (retired, closed) or not (killed,
        # cut off); Dask logs the event just before it calls remove_worker
        self._expected: dict[str, bool] = {}
        self._liveness_task: asyncio.Task | None = None
        # client -> the pending drop of its owners (a cut connection may come back)
        self._orphaned: dict[str, asyncio.TimerHandle] = {}

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update(
            {
                "daskdist_create": self.create,
                "daskdist_attach": self.attach,
                "daskdist_detach": self.detach,
                "daskdist_put": self.put,
                "daskdist_results": self.results,
                "daskdist_raise": self.raise_error,
                "daskdist_add_resource": self.add_resource,
                "daskdist_get_resource": self.get_resource,
                "daskdist_release_resources": self.release_resources,
                "daskdist_register": self.register,
                "daskdist_unregister": self.unregister,
                "daskdist_exchange": self.exchange,
                "daskdist_renew": self.renew,
                "daskdist_report": self.report,
                "daskdist_status": self.status,
                "daskdist_closure_state": self.closure_state,
                "daskdist_schedule_gang": self.schedule_gang,
                "daskdist_group_form": self.group_form,
                "daskdist_group_info": self.group_info,
                # dynamic datasets: CoordinatorState's methods, as they are
                "daskdist_dataset_define": self._on_state(CoordinatorState.dataset_define),
                "daskdist_dataset_state": self._on_state(CoordinatorState.dataset_state),
                "daskdist_dataset_start": self._on_state(CoordinatorState.dataset_start),
                "daskdist_lease_acquire": self._on_state(CoordinatorState.lease_acquire),
                "daskdist_lease_progress": self._on_state(CoordinatorState.lease_progress),
                "daskdist_lease_release": self._on_state(CoordinatorState.lease_release),
                # elastic commits (SPEC §4.2)
                "daskdist_gang_commit_part": self.gang_commit_part,
                "daskdist_commit_outcome": self.commit_outcome,
                "daskdist_state_commits": self.state_commits,
                # durable commits (SPEC §4.3)
                "daskdist_dataset_ledger": self._on_state(CoordinatorState.dataset_ledger),
                "daskdist_restore_ledger": self._on_state(CoordinatorState.restore_ledger),
                "daskdist_checkpoint_written":
                    self._on_state(CoordinatorState.checkpoint_written),
            }
        )
        scheduler.extensions["daskdist"] = self
        observe.install(self, scheduler)
        self._liveness_task = asyncio.create_task(self._expire_loop())

    async def _expire_loop(self) -> None:
        """End sessions whose lease lapsed (SPEC §2.4); runs until ``close``.

        Checks a few times per ``lease-timeout`` (at most every 0.5 s), so a hung
        worker's closures are back in the queue within ``lease-timeout`` + 0.5 s.
        """
        last = time.monotonic()
        while True:
            timeouts = [co.liveness.timeout for co in self.coordinators.values()]
            timeout = min(timeouts, default=config.seconds("liveness.lease-timeout"))
            interval = max(0.05, min(0.5, timeout / 10))
            await asyncio.sleep(interval)
            now = time.monotonic()
            stall = now - last - interval
            last = now
            for co in list(self.coordinators.values()):
                if stall > 1.0:  # this loop was blocked: renewals may wait unread
                    co.liveness.extend(stall)
                for session in co.expire_sessions(now):
                    logger.warning("daskdist[%s]: session %s sent nothing for %.1f s: "
                                   "ended (its closures run elsewhere)", co.name, session,
                                   co.liveness.timeout)

    # -- Dask events ------------------------------------------------------------------
    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str, **kwargs) -> None:
        for co in self.coordinators.values():
            session = co.members.session_of(worker)
            if session is not None:
                logger.info("daskdist[%s]: worker %s left (%s)", co.name, worker, stimulus_id)
                co.end_session(session, expected=self._expected.get(worker, False))
        self._expected.pop(worker, None)

    def log_event(self, topic: str, msg: Any) -> None:
        if not isinstance(msg, dict):
            return
        action = msg.get("action")
        if action == "worker-status-change":
            for co in self.coordinators.values():
                co.worker_status_changed(topic, msg.get("status"))
        elif action == "remove-worker" and "worker" in msg:
            self._expected[msg["worker"]] = bool(msg.get("expected"))

    def remove_client(self, scheduler, client: str) -> None:
        """A client's connection closed: drop its owners after ``coordinator.client-grace``
        unless it reconnects first (Dask's client reconnects with the same id)."""
        if not any(box.client == client for co in self.coordinators.values()
                   for box in co.outboxes.values()):
            return
        old = self._orphaned.pop(client, None)
        if old is not None:
            old.cancel()
        grace = config.seconds("coordinator.client-grace")
        self._orphaned[client] = asyncio.get_running_loop().call_later(
            grace, self._drop_client, client)

    def add_client(self, scheduler, client: str) -> None:
        handle = self._orphaned.pop(client, None)
        if handle is not None:
            handle.cancel()  # it came back: its closures and results are still here

    def _drop_client(self, client: str) -> None:
        self._orphaned.pop(client, None)
        for co in self.coordinators.values():
            for owner, box in list(co.outboxes.items()):
                if box.client == client:
                    self._drop_owner(co, owner)

    # -- helpers ----------------------------------------------------------------------------
    def _on_state(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """A handler that calls ``method`` on the named coordinator's state."""
        def handler(name: str, **kwargs: Any) -> Any:
            return method(self._get(name), **kwargs)

        handler.__name__ = method.__name__
        return handler

    def _get(self, name: str) -> CoordinatorState:
        try:
            return self.coordinators[name]
        except KeyError:
            raise KeyError(f"no daskdist coordinator named {name!r} on this scheduler") from None

    def _drop_owner(self, co: CoordinatorState, owner: str) -> None:
        co.outboxes.pop(owner, None)
        co.queue.cancel_pending(owner)
        co.gangs.cancel_pending(owner)
        co.leases.drop_owner(owner)  # its datasets' lease tables go with it

    def _next_generation(self) -> int:
        self.generations += 1
        return self.generations

    def _send(self, address: str, msg: dict) -> None:
        """A message on a worker's stream (Dask removes the worker if that fails)."""
        if address in self.scheduler.stream_comms:
            self.scheduler.worker_send(address, msg)

    async def close(self) -> None:
        for driver in self.drivers.values():
            driver.stop()
        if self._liveness_task is not None:
            self._liveness_task.cancel()
            self._liveness_task = None
        for handle in self._orphaned.values():
            handle.cancel()
        self._orphaned.clear()

    def _worker_retiring(self, address: str) -> bool:
        ws = self.scheduler.workers.get(address)
        return ws is None or ws.status.name in ("closing_gracefully", "closing", "closed")

    # -- client handlers ---------------------------------------------------------------
    async def create(self, name: str, max_worker_failures: int | None = None,
                     torch_threads: int | None = None,
                     lease_timeout: float | None = None) -> dict:
        """Create the named coordinator if new, and make sure workers run its plugin."""
        co = self.coordinators.get(name)
        if co is None:
            if max_worker_failures is None:
                max_worker_failures = int(config.get("coordinator.max-worker-failures"))
            co = self.coordinators[name] = CoordinatorState(
                name, max_worker_failures, send=self._send,
                lease_timeout=lease_timeout or config.seconds("liveness.lease-timeout"))
            self.drivers[name] = GroupDriver(co, self.scheduler.rpc, self._next_generation)
        plugin_name = worker_plugin_name(name)
        if plugin_name not in self.scheduler.worker_plugins:
            replies = await self.scheduler.register_worker_plugin(
                comm=None,
                plugin=dumps(PluginRef(WORKER_PLUGIN, name=name, torch_threads=torch_threads)),
                name=plugin_name,
                idempotent=True,
            )
            failed = {w: r for w, r in (replies or {}).items()
                      if isinstance(r, dict) and r.get("status") != "OK"}
            if failed:
                # Unregister, so that the next attempt registers (and reports) again.
                await self.scheduler.unregister_worker_plugin(comm=None, name=plugin_name)
                worker, reply = next(iter(failed.items()))
                raise RuntimeError(
                    f"the daskdist worker plugin of coordinator {name!r} failed to set up "
                    f"on {len(failed)} of {len(replies)} workers; {worker}: "
                    f"{reply.get('exception_text') or reply}")
        return {"workers": len(co.members)}

    def attach(self, name: str, client: str | None = None) -> str:
        """A client-side Coordinator attaches: it gets an owner id and an outbox."""
        co = self._get(name)
        owner = uuid.uuid4().hex[:12]
        co.outboxes[owner] = Outbox(client)
        return owner

    def detach(self, name: str, owner: str) -> None:
        co = self.coordinators.get(name)
        if co is not None:
            self._drop_owner(co, owner)

    def put(self, name: str, owner: str, closures: list) -> None:
        """Queue ``closures`` (each a :class:`Submission`) for ``owner`` (one-way)."""
        co = self._get(name)
        q = co.queue
        for sub in map(Submission._make, closures):
            q.put(sub.cid, owner, sub.payload, sub.retries)
        co.wake()

    async def results(self, name: str, owner: str, ack: int, timeout: float | None = None):
        """Long-poll: outcomes for ``owner`` from sequence number ``ack`` on."""
        co = self._get(name)
        box = co.outboxes.get(owner)
        if box is None:
            return {"detached": True}
        box.ack(ack)
        if not box.items and co.queue.error is None:
            if timeout is None:
                timeout = config.seconds("scheduler.poll-interval")
            await wait_event(box.event, timeout)
        return {
            "first": box.first_seq,
            "items": list(box.items),
            "error": co.queue.error is not None,
            "workers": len(co.members),
        }

    async def raise_error(self, name: str, timeout: float | None = None) -> dict:
        """Raise the first unraised error: wait for in-flight closures, cancel the queue
        (:meth:`CoordinatorState.raise_error`)."""
        return await self._get(name).raise_error(timeout)

    # -- collective groups and gang closures -------------------------------------------------
    async def group_form(self, name: str, backend: str = "auto", timeout: float = 60.0,
                         rejoin_grace: float | None = None) -> dict:
        """(Re-)form the collective group on the current workers; its description."""
        co = self._get(name)
        co.gangs.configure(backend, timeout)
        if rejoin_grace is not None:
            self.drivers[name].rejoin_grace = rejoin_grace
        ok = await self.drivers[name].form()
        info = self.drivers[name].info()
        info["ok"] = ok
        return info

    def group_info(self, name: str) -> dict:
        return self.drivers[name].info()

    async def schedule_gang(self, name: str, owner: str, cid: str, payload: bytes) -> dict:
        """Queue a gang closure; forms the group first if there is none yet."""
        co = self._get(name)
        driver = self.drivers[name]
        if not co.gangs.group.sessions:
            await driver.form()
        co.gangs.submit(cid, owner, payload)
        co.gangs_changed.set()
        driver.start()
        return driver.info()

    # -- elastic commits: rows acknowledged at State.commit() (SPEC §4.2) -------------------
    async def gang_commit_part(self, name: str, session: str, key: list, rank: int,
                               world: int, tokens: list, timeout: float = 60.0) -> bool:
        """A gang rank's part of a commit, sent by ``session``; the commit is applied (all
        or nothing) once every rank's part came. Replies with the outcome."""
        return await self._get(name).gang_commit_part(str(session), CommitKey.parse(key),
                                                      int(rank), int(world), tokens,
                                                      float(timeout))

    def commit_outcome(self, name: str, session: str, key: list) -> bool:
        """Whether commit ``key`` was applied (a rank that missed the outcome asks). Not
        read-only by design: a commit still open is refused now, so every rank, and any
        part still on its way, gets the same definite answer."""
        co = self._get(name)
        if session not in co.members:
            raise ValueError(f"session {session!r} of coordinator {name!r} ended")
        return co.commit_outcome(CommitKey.parse(key))

    def state_commits(self, name: str, session: str, state: str,
                      committed: bool = False) -> int:
        """How many commits of elastic State ``state`` happened (``committed``: count one
        more, a plain commit a rank reports once)."""
        co = self._get(name)
        if session not in co.members:
            raise ValueError(f"session {session!r} of coordinator {name!r} ended")
        return co.state_commits(str(state), bool(committed))

    def add_resource(self, name: str, rid: str, payload: bytes) -> None:
        self._get(name).resources[rid] = payload

    def get_resource(self, name: str, rid: str) -> bytes | None:
        return self._get(name).resources.get(rid)

    def release_resources(self, name: str, rids: list) -> None:
        """The client dropped these per-worker resources: forget them here and on every
        worker (one-way; the client sends it once no closure can still use them)."""
        co = self.coordinators.get(name)
        if co is None:
            return
        for rid in rids:
            co.resources.pop(rid, None)
        co.forget_datasets(rids)  # a dataset's identity is its resource id
        co.resources_released += len(rids)
        co.broadcast({"op": "daskdist-release", "name": name, "rids": list(rids)})

    def closure_state(self, name: str, cid: str) -> str | None:
        """PENDING or RUNNING for a closure not yet final; ``None`` once final or unknown."""
        c = self._get(name).queue.closures.get(cid)
        return None if c is None else c.state

    def status(self, name: str | None = None) -> dict:
        if name is not None:
            return self._get(name).status()
        return {n: co.status() for n, co in self.coordinators.items()}

    # -- worker handlers ---------------------------------------------------------------
    def register(self, name: str, session: str, address: str, slots: int = 1,
                 device: str = "cpu", gpu: str = "", generation: int = 0) -> dict:
        """A worker plugin session joins: it gets the lowest free worker index.

        ``generation`` is the newest group generation the worker has seen (say, under a
        scheduler that has since restarted): later generations are numbered above it.
        """
        self.generations = max(self.generations, generation)
        return self._get(name).start_session(session, address, slots, device, gpu,
                                             self._worker_retiring, time.monotonic())

    def unregister(self, name: str, session: str, results: list | None = None) -> None:
        co = self.coordinators.get(name)
        if co is not None:
            co.stop_session(session, results)

    def report(self, name: str, session: str, results: list) -> dict:
        co = self._get(name)
        if not co.renew(session, time.monotonic()):
            return {"unknown_session": True}  # fenced: the loop's exchange re-registers
        co.apply_results(session, results)
        return {"version": co.members.version, "hold": co.hold}

    def renew(self, name: str, session: str) -> dict:
        """A worker session's lease renewal (every ``liveness.renew-interval``)."""
        co = self.coordinators.get(name)
        return {"ok": co is not None and co.renew(session, time.monotonic())}

    def _steal_for(self, co: CoordinatorState, thief: str) -> None:
        """An idle session found no work: ask the session holding the most prefetched,
        unstarted closures to give half of them back (they return as ``UNSTARTED``
        results, go to the head of the queue and wake the idle session's long-poll)."""
        victim = co.queue.steal_victim(thief)
        if victim is None:
            return
        session, n = victim
        member = co.members.members.get(session)
        if member is not None:
            co.steals += 1
            self._send(member.address, {"op": "daskdist-steal", "name": co.name, "n": n})

    async def exchange(
        self,
        comm,
        name: str,
        session: str,
        results: list,
        held: list | None,
        want: int,
        block: bool,
    ) -> dict:
        """A worker reports results and asks for up to ``want`` closures, in one call.

        ``held`` lists every closure the worker has received and not yet had
        acknowledged; closures leased to the session but missing from it were lost on
        the way (a reply nobody read) and go back to the queue. With ``block``, wait
        up to ``daskdist.scheduler.poll-interval`` for work.
        """
        co = self.coordinators.get(name)
        if co is None or not co.renew(session, time.monotonic()):
            return {"unknown_session": True}
        q = co.queue
        if results:
            co.apply_results(session, results)
        if held is not None:
            if q.reconcile(session, held):
                co.wake()

        def fair(want: int) -> int:
            # a fair share of the backlog, so one worker's prefetch does not starve others
            share = -(-q.backlog // max(1, len(co.members)))
            return min(want, max(1, share))

        # A busy worker prefetches nothing while another waits idle for work (SPEC §2.4).
        closures = q.dispatch(session, fair(want) if block or not co.waiters else 0)
        if not closures and block and want > 0:
            self._steal_for(co, session)
            deadline = time.monotonic() + config.seconds("scheduler.poll-interval")
            event = asyncio.Event()
            co.waiters.add(event)
            try:
                while True:
                    if comm.closed() or session not in co.members:
                        break
                    closures = q.dispatch(session, fair(want))
                    if closures:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    event.clear()
                    if not await wait_event(event, left):
                        break
            finally:
                co.waiters.discard(event)
        return {
            "closures": [Dispatch(c.cid, c.payload, c.attempt, c.pinned is not None)
                         for c in closures],
            "num_workers": len(co.members),
            "version": co.members.version,
            "hold": co.hold,
        }


def dask_setup(scheduler) -> None:
    """Preload entry point: ``dask scheduler --preload daskdist.plugins.scheduler``."""
    scheduler.add_plugin(CoordinatorPlugin(), name=PLUGIN_NAME, idempotent=True)


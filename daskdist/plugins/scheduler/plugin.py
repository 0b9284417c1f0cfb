"""CoordinatorPlugin: the scheduler side of daskdist.

A ``SchedulerPlugin`` that holds one :class:`CoordinatorState` per coordinator name
(its sessions, and its books: closures, gangs and commits, dynamic datasets, per-worker
resources, per-rank observation, keep-alive owners, preemption deadlines, asynchronous
models, batch-inference jobs), registers their RPC handlers on the scheduler (the pattern of
``distributed/semaphore.py``), and reacts to Dask's own ``remove_worker`` and
worker-status events, so preemption is handled the moment Dask notices it.

Clients put closures and long-poll for their outcomes; worker plugins long-poll for
closures, reporting results in the same call. Payloads stay opaque bytes here: this
module never imports torch, pyarrow or ``collective/`` (SPEC §1).

Load it with ``dask scheduler --preload daskdist.plugins.scheduler`` or let
``Coordinator`` register it from the client.

The scheduler checks who calls (SPEC §2.5b): each handler, here and in the books,
checks its arguments' types and sizes (:mod:`daskdist.core.checks`) before it touches
any state; a client acts only as an owner it created (each owner has a secret token,
given only in the reply to the ``daskdist_create`` call that attached it, or to the
``daskdist_attach`` that handed a keep-alive owner over); a worker acts
only with its own session (``daskdist_register`` asks the worker at the address it
names to confirm the session), and read-only handlers never create state. A named
coordinator lives while it has owners: when the last one closes (or its client is gone
for ``client-grace``; a keep-alive owner's, for ``keep-alive-timeout`` with nobody
attaching), its state, group driver and worker plugin go.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from daskdist import config
from daskdist.core import checks, protocol
from daskdist.core.protocol import PLUGIN_NAME, RETIRING
from daskdist.observe.book import RANK_ROUTES, RANK_STREAM_ROUTES
from daskdist.plugins.scheduler.asynchronous.book import ASYNC_ROUTES, ASYNC_STREAM_ROUTES
from daskdist.plugins.scheduler.closures import CLOSURE_ROUTES
from daskdist.plugins.scheduler.datasets import LEASE_ROUTES
from daskdist.plugins.scheduler.gangs import GROUP_ROUTES
from daskdist.plugins.scheduler.groups import GroupDriver
from daskdist.plugins.scheduler.inference.book import INFER_ROUTES
from daskdist.plugins.scheduler.lifetime.keepalive import KEEP_ROUTES
from daskdist.plugins.scheduler.lifetime.preemptions import PREEMPT_ROUTES
from daskdist.plugins.scheduler.locality import Locality
from daskdist.plugins.scheduler.names import Coordinators
from daskdist.plugins.scheduler.resources import RESOURCE_ROUTES
from daskdist.plugins.scheduler.state import STATE_ROUTES, CoordinatorState
from daskdist.plugins.scheduler.web import pages

# Every route of a named coordinator, by the attribute of CoordinatorState that holds its
# book ("": the coordinator itself) and the book's table (protocol.Route)
BOOK_ROUTES = {
    "": STATE_ROUTES,
    "closure_book": CLOSURE_ROUTES,
    "group_book": GROUP_ROUTES,
    "lease_book": LEASE_ROUTES,
    "resource_book": RESOURCE_ROUTES,
    "rank_book": RANK_ROUTES,
    "keep_book": KEEP_ROUTES,
    "preempt_book": PREEMPT_ROUTES,
    "async_book": ASYNC_ROUTES,
    "infer_book": INFER_ROUTES,
}
# ... and those of messages on a worker's own stream (one-way; Dask adds worker=)
BOOK_STREAM_ROUTES = {"rank_book": RANK_STREAM_ROUTES, "async_book": ASYNC_STREAM_ROUTES}
# The plugin's own routes (coordinators' lives, worker sessions, status): their methods
PLUGIN_ROUTES = {
    "daskdist_create": "create",
    "daskdist_detach": "detach",
    "daskdist_register": "register",
    "daskdist_unregister": "unregister",
    "daskdist_status": "status",
    "daskdist_members": "members",
}
PLUGIN_STREAM_ROUTES = {"daskdist-helper": "helper"}

logger = logging.getLogger(__name__)


class CoordinatorPlugin(SchedulerPlugin):
    """Holds every named coordinator on this scheduler and serves their RPCs."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        # the named coordinators and their lives (names.py)
        self.names = Coordinators(self._send, self._next_generation)
        self.coordinators: dict[str, CoordinatorState] = self.names.states
        self.drivers: dict[str, GroupDriver] = self.names.drivers
        self.generations = 0  # last collective-group generation handed out (any coordinator)
        self.scheduler = None
        # worker -> whether Dask expected its removal (retired, closed) or not (killed,
        # cut off); Dask logs the event just before it calls remove_worker
        self._expected: dict[str, bool] = {}
        self._liveness_task: asyncio.Task | None = None
        self._sampler: pages.Sampler | None = None  # dashboard history, until close
        self.locality: Locality | None = None  # persisted partitions' holders (at start)

    async def start(self, scheduler) -> None:
        self.scheduler = self.names.scheduler = scheduler
        self.locality = self.names.locality = Locality(scheduler)
        scheduler.handlers.update({op: getattr(self, attr) for op, attr in PLUGIN_ROUTES.items()})
        for book, table in BOOK_ROUTES.items():
            for op, route in table.items():
                scheduler.handlers[op] = protocol.book_handler(self.coordinators, book, op, route)
        # a worker's stream: a handler that raised would close it (Dask removes the worker)
        scheduler.stream_handlers.update({op: _never_raises(op, getattr(self, attr))
                                          for op, attr in PLUGIN_STREAM_ROUTES.items()})
        for book, table in BOOK_STREAM_ROUTES.items():
            for op, route in table.items():
                scheduler.stream_handlers[op] = _never_raises(
                    op, protocol.book_handler(self.coordinators, book, op, route))
        scheduler.extensions["daskdist"] = self
        self._sampler = pages.install(self, scheduler)
        self._liveness_task = asyncio.create_task(self._expire_loop())

    async def _expire_loop(self) -> None:
        """End sessions whose lease lapsed (SPEC §2.4); runs until ``close``.

        Checks a few times per ``lease-timeout`` (at most every 0.5 s), so a hung
        worker's closures are back in the queue within ``lease-timeout`` + 0.5 s.
        """
        last = time.monotonic()
        while True:
            timeouts = [co.members.leases.timeout for co in self.coordinators.values()]
            timeout = min(timeouts, default=config.seconds("liveness.lease-timeout"))
            interval = max(0.05, min(0.5, timeout / 10))
            await asyncio.sleep(interval)
            now = time.monotonic()
            stall = now - last - interval
            last = now
            for co in list(self.coordinators.values()):
                if stall > 1.0:  # this loop was blocked: renewals may wait unread
                    co.members.leases.extend(stall)
                for session in co.expire_sessions(now):
                    logger.warning("daskdist[%s]: session %s sent nothing for %.1f s: "
                                   "ended (its closures run elsewhere)", co.name, session,
                                   co.members.leases.timeout)

    # -- Dask events ------------------------------------------------------------------
    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str, **kwargs) -> None:
        for co in self.coordinators.values():
            co.helpers.discard(worker)
            session = co.members.session_of(worker)
            if session is not None:
                logger.info("daskdist[%s]: worker %s left (%s)", co.name, worker, stimulus_id)
                co.worker_removed(session, expected=self._expected.get(worker, False))
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
        """A client's connection closed: its owners go after ``client-grace`` unless it
        reconnects first."""
        self.names.client_left(client)

    def add_client(self, scheduler, client: str) -> None:
        self.names.client_back(client)

    # -- helpers ----------------------------------------------------------------------------

    def _get(self, name: Any) -> CoordinatorState:
        return self.names.get(name)

    def _owned(self, op: str, name: Any, owner: Any, token: Any) -> CoordinatorState:
        """The coordinator ``name`` if the caller is its owner ``owner`` (holds its token)."""
        co = self._get(name)
        co.check_owner(checks.text(owner, f"{op}: owner"), checks.text(token, f"{op}: token"))
        return co

    def _next_generation(self) -> int:
        self.generations += 1
        return self.generations

    def _send(self, address: str, msg: dict) -> None:
        """A message on a worker's stream (Dask removes the worker if that fails)."""
        if address in self.scheduler.stream_comms:
            self.scheduler.worker_send(address, msg)

    async def close(self) -> None:
        self.names.close()
        if self._sampler is not None:
            self._sampler.callback.stop()
            self._sampler = None
        if self._liveness_task is not None:
            self._liveness_task.cancel()
            self._liveness_task = None

    def _worker_retiring(self, address: str) -> bool:
        ws = self.scheduler.workers.get(address)
        return ws is None or ws.status.name in RETIRING

    # -- client handlers ---------------------------------------------------------------
    async def create(self, name: str, client: str | None = None,
                     max_worker_failures: int | None = None,
                     torch_threads: int | None = None,
                     lease_timeout: float | None = None,
                     resources: dict | None = None, members: str | None = None,
                     keep_alive: bool = False) -> dict:
        """Create the named coordinator if new (its settings: the first caller's), make
        sure workers run its plugin, and attach the caller as a new owner: its id and
        secret token (``{"workers", "owner", "token"}``). ``resources``: only workers
        declaring those Dask resources are members; ``members="gpu"``: only workers with
        a GPU by the Dask convention (a later caller asking for others is refused).
        ``keep_alive``: the owner's work outlives its client (the keep book)."""
        op = "daskdist_create"
        checks.text(name, f"{op}: name")
        client = checks.optional(checks.text, client, f"{op}: client")
        max_worker_failures = checks.optional(checks.max_worker_failures, max_worker_failures,
                                              f"{op}: max_worker_failures")
        torch_threads = checks.optional(checks.integer, torch_threads, f"{op}: torch_threads",
                                        -(2**31), 2**31)
        lease_timeout = checks.optional(checks.lease_timeout, lease_timeout,
                                        f"{op}: lease_timeout")
        resources = checks.optional(checks.resources, resources, f"{op}: resources")
        members = checks.optional(checks.members, members, f"{op}: members")
        keep_alive = checks.flag(keep_alive, f"{op}: keep_alive")
        return await self.names.create(name, client, max_worker_failures, torch_threads,
                                       lease_timeout, resources=resources, members=members,
                                       keep_alive=keep_alive)

    async def detach(self, name: str, owner: str, token: str) -> dict:
        """The owner closes: its queued closures are cancelled, its per-worker resources
        released on every worker; ``{"items": outcomes it had not read}``. The last
        owner's detach closes the coordinator, and returns once its worker plugin is
        gone from the workers (or after 5 s, the teardown going on)."""
        co = self.coordinators.get(checks.text(name, "daskdist_detach: name"))
        if co is None:
            return {"items": []}
        co = self._owned("daskdist_detach", name, owner, token)
        items = self.names.drop_owner(co, owner)
        await self.names.torn_down(co.name, 5.0)
        return {"items": items}

    def status(self, name: str | None = None) -> dict:
        if name is not None:
            return self._get(name).status()
        return {n: co.status() for n, co in self.coordinators.items()}

    def members(self, name: str) -> dict:
        """Who works for coordinator ``name``: ``{"members": [...], "helpers": [...]}``,
        each member ``{"address", "index", "device", "gpu"}`` as its worker reported
        them, by index; helpers are the workers that are not members (sorted)."""
        co = self._get(name)
        return {"members": [{"address": m.address, "index": m.index, "device": m.device,
                             "gpu": m.gpu} for m in co.members.by_index()],
                "helpers": sorted(co.helpers)}

    # -- worker handlers ---------------------------------------------------------------
    def helper(self, name: Any, worker: str) -> None:
        """The worker whose stream this came on is not a member of coordinator ``name``
        (``resources=`` or ``members=``): it computes partitions for the members."""
        co = self.coordinators.get(name) if isinstance(name, str) else None
        if co is None or co.closed or worker not in self.scheduler.workers:
            return
        if co.members.session_of(worker) is None:
            co.add_helper(worker)
    async def register(self, name: str, session: str, address: str, slots: int = 1,
                       device: str = "cpu", gpu: str = "", generation: int = 0) -> dict:
        """A worker plugin session joins: it gets the lowest free worker index.

        Only the worker at ``address`` can register a session for it: the scheduler
        asks that worker (at its own address) to confirm the session first.
        ``generation`` is the newest group generation the worker has seen (say, under a
        scheduler that has since restarted): later generations are numbered above it.
        """
        op = "daskdist_register"
        co = self.coordinators.get(checks.text(name, f"{op}: name"))
        if co is None or co.closed:  # closed: its plugin is being removed from workers
            return {"closed": True}
        checks.text(session, f"{op}: session")
        checks.text(address, f"{op}: address")
        slots = checks.integer(slots, f"{op}: slots", 1, 1_000_000)
        checks.text(device, f"{op}: device")
        checks.text(gpu, f"{op}: gpu", empty=True)
        generation = checks.integer(generation, f"{op}: generation", 0, 2**53)
        if address not in self.scheduler.workers:
            raise PermissionError(f"{op}: {address!r} is not a worker of this scheduler")
        member = co.members.members.get(session)
        if member is not None and member.address != address:
            raise PermissionError(f"{op}: session {session!r} belongs to another worker")
        confirmed = await self.scheduler.rpc(address).daskdist_confirm_session(
            name=name, session=session)
        if confirmed is not True:
            raise PermissionError(f"{op}: worker {address} did not confirm session "
                                  f"{session!r}: only a worker registers its own sessions")
        if co.closed:  # closed while the worker confirmed
            return {"closed": True}
        self.generations = max(self.generations, generation)
        reply = co.start_session(session, address, slots, device, gpu,
                                 self._worker_retiring, time.monotonic())
        ws = self.scheduler.workers.get(address)
        if ws is not None and ws.status.name == "paused":
            co.worker_status_changed(address, "paused")
        return reply

    def unregister(self, name: str, session: str, results: list | None = None,
                   started: list | None = None) -> None:
        """A worker session stops (its plugin is torn down): its last results, and which
        of its closures started (exactly: nothing more starts); then its end."""
        op = "daskdist_unregister"
        co = self.coordinators.get(checks.text(name, f"{op}: name"))
        checks.text(session, f"{op}: session")
        outcomes = protocol.outcomes(op, results or [])
        _, started = protocol.observed(op, None, started)
        if co is not None and session in co.members:
            co.stop_session(session, outcomes, started)



def _never_raises(op: str, handler: Any) -> Any:
    """A stream handler that logs what it cannot take: an exception in a stream handler
    would close the worker's stream (and Dask would remove the worker)."""
    def on_message(**kwargs: Any) -> None:
        try:
            handler(**kwargs)
        except Exception as e:  # noqa: BLE001 - see above
            logger.warning("daskdist: %s from %s dropped: %r", op, kwargs.get("worker"), e)

    on_message.__name__ = handler.__name__
    return on_message


def dask_setup(scheduler) -> None:
    """Preload entry point: ``dask scheduler --preload daskdist.plugins.scheduler``."""
    scheduler.add_plugin(CoordinatorPlugin(), name=PLUGIN_NAME, idempotent=True)


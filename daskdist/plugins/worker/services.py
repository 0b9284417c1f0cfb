"""A worker session's scheduler services (:class:`SessionServices`) and its life:
registering, renewing and ending it (:class:`Session`, :class:`SessionLifecycle`).

TensorFlow hands a closure its ``coordinator_context``; daskdist hands each closure
(through :func:`daskdist.session.scope.session_services`) and each per-worker resource built
for a session (``InputContext.services``) the services of the session it belongs to:
lease acquire, progress and release for the ``"dynamic"`` policy, commit parts and
commit outcomes for elastic state. Every call names that session, so once the session
ended (the scheduler fenced it, or the plugin was torn down) its calls are refused, here
at once and by the scheduler for any already on the way. Data and collective code
never import the worker plugin: they only see this object.

Threads: :class:`SessionServices` calls come from closure and producer threads, never
the worker's event loop; each blocks its thread until the scheduler replies (or the
comm fails). A session's life (:class:`SessionLifecycle`, the closure runner's half
that registers, renews and ends sessions) runs on the event loop; an ended session's
resources close in a thread of their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from distributed.comm.core import CommClosedError
from distributed.utils import sync

from daskdist import config
from daskdist.context import InputContext, WorkerContext
from daskdist.core.leases.table import group_tokens
from daskdist.core.protocol import (
    RETIRING,
    CommitKey,
    DatasetDef,
    is_session_ended,
)
from daskdist.errors import CollectiveError, InputError
from daskdist.session.counters import forget_membership, set_membership
from daskdist.session.resources import ResourceRegistry

logger = logging.getLogger(__name__)

Interval = tuple[int, int]
_RAISE = object()  # SessionServices._call's default: an ended session raises
_NO_LEASE: dict = {"lease": None}  # what a lease call gets from an ended session


class SessionServices:
    """The scheduler services of one worker session (any thread but the event loop).

    Every wait for the scheduler ends: a reply, a comm failure, or
    ``daskdist.worker.rpc-timeout`` (a ``TimeoutError`` naming the call), so a closure or
    a loader's producer never waits on a scheduler that stopped answering."""

    def __init__(self, worker: Any, name: str, session: str) -> None:
        self.worker = worker
        self.name = name
        self.session = session
        self.ended = False
        self.timeout = config.seconds("worker.rpc-timeout")
        self._helpers: tuple[float, list[str]] | None = None  # (when asked, addresses)

    def end(self) -> None:
        """The session ended: every later call is refused without asking the scheduler."""
        self.ended = True

    def _call(self, op: str, ended: Any = _RAISE, **kwargs: Any) -> Any:
        """Call handler ``op`` for this session and wait (at most ``timeout``): its
        reply, or ``ended`` (default: raise ``CollectiveError``) if the session ended."""
        return self._reply(self._sync(op, session=self.session, **kwargs), ended)

    def _sync(self, op: str, **kwargs: Any) -> Any:
        try:
            return sync(self.worker.loop, getattr(self.worker.scheduler, op), name=self.name,
                        callback_timeout=self.timeout, **kwargs)
        except (asyncio.TimeoutError, TimeoutError) as e:
            raise self._timed_out(op) from e

    def _timed_out(self, op: str) -> TimeoutError:
        return TimeoutError(f"daskdist: {op} got no reply from the scheduler within "
                            f"{self.timeout:g} s (daskdist.worker.rpc-timeout)")

    def _reply(self, reply: Any, ended: Any = _RAISE) -> Any:
        """The one place a handler's :data:`SESSION_ENDED` reply is recognised: the
        session ended (every later call is refused here at once), and the caller gets
        ``ended`` (the call's "nothing", or ``CollectiveError`` raised)."""
        if not is_session_ended(reply):
            return reply
        self.end()
        if ended is _RAISE:
            raise self._ended_error()
        return ended

    def _ended_error(self) -> CollectiveError:
        # a membership change for elastic state: the gang runs again on a new group
        return CollectiveError(f"worker {self.worker.address} session {self.session[:8]} "
                               f"of coordinator {self.name!r} ended")

    def _async(self, parse: Any, op: str, ended: Any,
               **kwargs: Any) -> concurrent.futures.Future:
        """A scheduler call sent from any thread without waiting: a future of
        ``parse(reply)`` (``parse(ended)`` once the session ended; ``None`` at once for
        one known ended; ``TimeoutError`` after ``timeout``)."""
        out: concurrent.futures.Future = concurrent.futures.Future()
        if self.ended:
            out.set_result(None)
            return out
        coro = asyncio.wait_for(getattr(self.worker.scheduler, op)(
            name=self.name, session=self.session, **kwargs), self.timeout)
        reply = asyncio.run_coroutine_threadsafe(coro, self.worker.loop.asyncio_loop)

        def done(f: concurrent.futures.Future) -> None:
            try:
                out.set_result(parse(self._reply(f.result(), ended)))
            except (asyncio.TimeoutError, TimeoutError) as e:
                out.set_exception(self._timed_out(op))
                del e
            except BaseException as e:  # noqa: BLE001 - the caller's result() raises it
                out.set_exception(e)

        reply.add_done_callback(done)
        return out

    def call(self, op: str, ended: Any = None, **kwargs: Any) -> Any:
        """Call handler ``op`` of this coordinator as this session and wait (at most
        ``timeout``): its reply, or ``ended`` once the session ended. The way in for a
        feature whose routes are its own (batch inference's commits)."""
        if self.ended:
            return ended
        return self._call(op, ended=ended, **kwargs)

    def ready(self) -> None:
        """This session built its per-worker resources: it may join the group."""
        if not self.ended:
            self._call("daskdist_session_ready", ended=None)

    # -- the dynamic policy's lease service (data.dynamic.LeaseService) ------------------
    def define(self, dataset: DatasetDef) -> None:
        """Define a dataset's units (once per loader; ``ValueError`` if they differ from
        the definition the scheduler has)."""
        if not self.ended:
            self._call("daskdist_dataset_define", ended=None, dataset=tuple(dataset))

    def acquire(self, dataset_id: str, epoch: int, rows: int, least: int = 1,
                rate: float | None = None) -> list[Interval] | None:
        """Lease at least ``rows`` free rows (rounded up to whole units; a unit this
        worker holds first; ``rate``: the rows a second this loader consumes, which
        weighs its share); ``None`` when none is free now or the session ended (its
        loaders are being closed). ``InputError`` when the epoch failed."""
        return self.acquire_async(dataset_id, epoch, rows, least, rate).result()

    def acquire_async(self, dataset_id: str, epoch: int, rows: int, least: int = 1,
                      rate: float | None = None) -> concurrent.futures.Future:
        """:meth:`acquire` without waiting: a future of its result (a loader asks for its
        next lease while it reads the current one)."""
        return self._async(_lease, "daskdist_lease_acquire", _NO_LEASE,
                           dataset_id=dataset_id, epoch=int(epoch), rows=int(rows),
                           least=int(least), rate=None if rate is None else float(rate))

    def progress(self, dataset_id: str, epoch: int) -> dict:
        """An epoch's counts (read-only: any session may ask)."""
        return self._sync("daskdist_lease_progress", dataset_id=dataset_id, epoch=int(epoch))

    def release(self, dataset_id: str, epoch: int, ranges: list,
                failure: tuple[str, str] | None = None) -> int:
        """Give back rows leased to this session that no closure consumed (``failure``:
        ``(source, message)`` when they could not be read); rows freed."""
        if self.ended or not ranges:
            return 0
        return self._call("daskdist_lease_release", ended=0, dataset_id=dataset_id,
                          epoch=int(epoch), ranges=[(int(a), int(b)) for a, b in ranges],
                          failure=None if failure is None else list(failure))

    def release_tokens(self, tokens: list) -> int:
        """Give the rows of lease tokens back to the pool: only rows leased to this
        session move, acknowledged rows stay acknowledged. Rows freed."""
        return sum(self.release(ds, epoch, ranges)
                   for (ds, epoch), ranges in group_tokens(tokens).items())

    def report_length_async(self, dataset_id: str, epoch: int, unit: int,
                            length: int) -> concurrent.futures.Future:
        """A read unit's length (a computed partition's), without waiting: a future that
        raises ``InputError`` naming it when it differs from the length learned before
        (the epoch failed)."""
        return self._async(_length_reply, "daskdist_unit_length", {},
                           dataset_id=dataset_id, epoch=int(epoch), unit=int(unit),
                           length=int(length))

    def helpers(self) -> list[str]:
        """Workers that compute partitions for the members (not members themselves,
        under ``Coordinator(resources=...)``); asked at most every 5 s."""
        now = time.monotonic()
        if self._helpers is None or now - self._helpers[0] > 5.0:
            helpers = [] if self.ended else list(self._call("daskdist_dataset_helpers",
                                                            ended=[]))
            self._helpers = (now, helpers)
        return self._helpers[1]

    # -- elastic commits (collective.elastic) ----------------------------------------
    def send_commit_part(self, key: CommitKey, rank: int, world: int, tokens: list,
                         timeout: float) -> concurrent.futures.Future:
        """Send this rank's part of commit ``key`` without waiting: a future of the
        commit's outcome (``True``: applied)."""
        if self.ended:
            raise self._ended_error()
        coro = self.worker.scheduler.daskdist_gang_commit_part(
            name=self.name, session=self.session, key=list(key), rank=int(rank),
            world=int(world), tokens=list(tokens), timeout=float(timeout))
        return asyncio.run_coroutine_threadsafe(coro, self.worker.loop.asyncio_loop)

    def send_commit(self, key: CommitKey, world: int,
                    parts: list[list[int]]) -> concurrent.futures.Future:
        """Rank 0: send every rank's part of commit ``key`` in one message (``parts``:
        each rank's packed tokens, in rank order) without waiting: a future of the
        commit's outcome (``True``: applied)."""
        if self.ended:
            raise self._ended_error()
        coro = self.worker.scheduler.daskdist_gang_commit(
            name=self.name, session=self.session, key=list(key), world=int(world),
            parts=parts)
        return asyncio.run_coroutine_threadsafe(coro, self.worker.loop.asyncio_loop)

    def commit_outcome(self, key: CommitKey) -> bool:
        """Whether the scheduler applied commit ``key`` (deciding it, if still open)."""
        if self.ended:
            raise self._ended_error()
        return bool(self._call("daskdist_commit_outcome", key=list(key)))

    def state_commits(self, state: str, committed: bool = False) -> int:
        """How many commits of State ``state`` the scheduler knows of; ``committed``
        reports one more (a State's first plain commit on this rank)."""
        if self.ended:
            raise self._ended_error()
        return int(self._call("daskdist_state_commits", state=state, committed=committed))

    def report_preemption(self, deadline: float, reason: str) -> None:
        """This worker's preemption deadline (a gang member leaving on it: the group's
        next formation leaves this session out). Idempotent."""
        if not self.ended:
            self._call("daskdist_preemption", ended=None, deadline=float(deadline),
                       reason=str(reason))

    # -- durable commits (collective.checkpoint) ---------------------------------------
    @property
    def leaving(self) -> bool:
        """This worker is leaving: retiring, closing, or told to leave (a preemption
        notice). A State checkpoints the commit it leaves at when no member stays."""
        return self.worker.status.name in RETIRING

    def dataset_ledger(self, state: str) -> dict:
        """The ledger of State ``state``'s ``"dynamic"`` datasets as the scheduler holds
        it now, by dataset name: epoch, acknowledged rows, seed, rows and units."""
        if self.ended:
            raise self._ended_error()
        return self._call("daskdist_dataset_ledger", state=state)

    def restore_ledger(self, state: str, ledger: dict) -> None:
        """A State resumed from a checkpoint: its datasets' epochs go on from ``ledger``
        (rows it acknowledged stay acknowledged, every other row is delivered again)."""
        if self.ended:
            raise self._ended_error()
        self._call("daskdist_restore_ledger", state=state, ledger=ledger)

    def checkpoint_written(self, state: str, url: str, commits: int, seconds: float,
                           nbytes: int) -> None:
        """Report a complete checkpoint (the dashboard and metrics show the newest)."""
        if not self.ended:
            self._call("daskdist_checkpoint_written", ended=None, state=state, url=url,
                       commits=int(commits), seconds=float(seconds), nbytes=int(nbytes))


def _length_reply(reply: dict | None) -> None:
    """``InputError`` when a reported unit length differs from the learned one."""
    if reply and reply.get("failed"):
        raise InputError(reply["failed"])


def _lease(reply: dict | None) -> list[Interval] | None:
    """A lease reply's rows (``None``: none free now, or the session ended);
    ``InputError`` when the epoch failed."""
    if reply is None:
        return None
    if reply.get("failed") is not None:
        raise InputError(reply["failed"])
    lease = reply.get("lease")
    if not lease:
        return None
    return [(int(a), int(b)) for a, b in lease]


# -- a session's life (the closure runner's event loop) ------------------------------
def highest_generation() -> int:
    """The newest collective generation this process has seen (later ones must be
    higher), read through ``sys.modules``: importing ``daskdist.collective`` imports
    torch, and no collective code ran here if it is not imported."""
    bootstrap = sys.modules.get("daskdist.collective.bootstrap")
    return 0 if bootstrap is None else bootstrap.PROCESS.highest_generation()


class CoordinatorGone(Exception):
    """The coordinator's last owner closed: the scheduler is removing this plugin."""


class Session:
    """One registration of the runner with the scheduler: the session id, the scheduler
    services bound to it (``services.ended`` once it ended) and the per-worker
    resources built for it."""

    def __init__(self, sid: str, services: SessionServices, resources: ResourceRegistry):
        self.id = sid
        self.services = services
        self.resources = resources

    def warm(self, rids: list[str]) -> threading.Thread:
        """Build the per-worker resources ``rids`` now, in a thread of their own, then
        tell the scheduler this session is ready to join the group: a replacement's
        factories run while the group's members train (a factory that fails raises in
        the closure that uses its resource, as it would have)."""
        def build() -> None:
            for rid in rids:
                if self.services.ended:
                    return
                try:
                    self.resources.get(rid)
                except Exception as e:  # noqa: BLE001 - raised again where it is used
                    logger.info("daskdist: building %s ahead failed: %r", rid, e)
            if not self.services.ended:
                try:
                    self.services.ready()
                except Exception as e:  # noqa: BLE001 - the session is being replaced
                    logger.info("daskdist: telling the scheduler this session is ready "
                                "failed: %r", e)

        t = threading.Thread(target=build, daemon=True, name=f"daskdist-warm-{self.id[:8]}")
        t.start()
        return t

    def end(self) -> threading.Thread:
        """Refuse the session's calls from now on, and close its resources in a thread
        of their own (a loader's producer may be in the middle of a read); the thread."""
        self.services.end()
        forget_membership(self.id)
        closer = threading.Thread(target=self.resources.close, daemon=True,
                                  name=f"daskdist-close-{self.id[:8]}")
        closer.start()
        return closer


class SessionLifecycle:
    """Registering, renewing and ending a closure runner's sessions (the worker's event
    loop): the base of :class:`~daskdist.plugins.worker.runner.ClosureRunner`, whose
    exchange loop and closure threads do the rest. A new session each time the runner
    registers (at setup, and after the scheduler fenced the old one)."""

    # the runner's state these read and set (ClosureRunner.__init__ makes them); they
    # call its _retiring, started, poke, call and _worker_context
    worker: Any
    name: str
    nthreads: int
    device: Any
    gpu: str
    session: Session | None
    registering: str | None  # the session the scheduler may ask us to confirm
    index: int
    num_workers: int
    renew_interval: float
    observe: float
    last_sent: float
    unacked: set[str]
    closers: list[threading.Thread]
    stopping: bool

    @property
    def resources(self) -> ResourceRegistry | None:
        """The current session's per-worker resources (``None`` between sessions)."""
        return self.session.resources if self.session is not None else None

    async def _register(self) -> None:
        """Register a new session; the old one (if any) ends and its resources close.

        Until the reply comes, ``registering`` names the session, so the scheduler's
        confirmation request finds it (and ``stop`` unregisters it if cancelled)."""
        sid = uuid.uuid4().hex
        self.registering = sid
        reply = await self.worker.scheduler.daskdist_register(
            name=self.name, session=sid, address=self.worker.address,
            slots=self.nthreads, device=str(self.device), gpu=self.gpu,
            generation=highest_generation(),
        )
        self.registering = None
        if reply is None:
            raise RuntimeError("the daskdist scheduler plugin is not registered")
        if reply.get("closed"):
            raise CoordinatorGone(self.name)
        self.index = reply["index"]
        self.num_workers = reply["num_workers"]
        self.renew_interval = reply.get("renew", self.renew_interval)
        self.observe = float(reply.get("observe") or 0.0)  # gang members' window (SPEC §5.1)
        self._end_session()
        set_membership(reply["version"], reply.get("joins"), session=sid)
        services = SessionServices(self.worker, self.name, sid)
        self.session = Session(sid, services, ResourceRegistry(
            functools.partial(self._fetch_spec, sid), self._contexts_for(services)))
        if reply.get("warm"):
            self.session.warm(list(reply["warm"]))

    def _end_session(self) -> None:
        """The current session is over (fenced, or the plugin is stopping)."""
        old, self.session = self.session, None
        if old is not None:
            self.closers = [t for t in self.closers if t.is_alive()]
            self.closers.append(old.end())

    async def _register_until_done(self) -> bool:
        """Register a session, retrying while the scheduler cannot be reached; ``False``
        when it refuses (the coordinator is gone: this plugin is about to be removed)."""
        backoff = 0.05
        while not self.stopping:
            if self._retiring():  # leaving: its closures went back with its session
                return False
            try:
                await self._register()
                return True
            except (OSError, CommClosedError) as e:
                logger.info("daskdist: registering with the scheduler failed (%r); "
                            "retrying", e)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            except CoordinatorGone:  # its last owner closed: this plugin is being removed
                return False
            except Exception as e:  # noqa: BLE001 - refused: say why, take no work
                self.registering = None
                logger.warning("daskdist[%s]: worker %s could not register: %r", self.name,
                               self.worker.address, e)
                return False
        return False

    async def _renew_loop(self) -> None:
        """Renew this session's lease (SPEC §2.4) every ``renew_interval``: the
        scheduler's word, growing with the cluster as Dask's heartbeats do
        (``liveness.renew-interval`` until it speaks); skipped when an exchange left
        since the last one (its arrival renewed the lease).

        Runs on the worker's event loop, not in a closure thread: closures release the
        GIL often enough for it to run (see ``tests/test_liveness.py``), so only a hung
        process or event loop lets the lease lapse. A refused renewal (the scheduler
        ended the session) wakes the exchange loop, which registers a new session.
        Each call is bounded so a dead connection cannot stall renewals for good.
        """
        while not self.stopping:
            interval = self.renew_interval
            await asyncio.sleep(interval)
            if self.session is None:
                continue  # registering: the registration itself starts the lease
            if time.monotonic() - self.last_sent < interval:
                continue  # an exchange left since: its arrival renewed the lease
            try:
                reply = await asyncio.wait_for(
                    self.worker.scheduler.daskdist_renew(
                        name=self.name, session=self.session.id, held=list(self.unacked),
                        started=self.started()),
                    max(5.0, 5 * interval))
            except (OSError, CommClosedError, asyncio.TimeoutError) as e:
                logger.info("daskdist: lease renewal failed (%r); retrying", e)
                continue
            if is_session_ended(reply):
                self.poke()  # the next exchange learns the session is gone

    def _contexts_for(self, services: SessionServices
                      ) -> Callable[[str], tuple[WorkerContext, InputContext]]:
        """What a session's per-worker factories receive (built when resource ``rid``
        is): a dataset's input context carries its identity, the resource id."""
        def contexts(rid: str) -> tuple[WorkerContext, InputContext]:
            wctx = self._worker_context()
            n = max(1, self.num_workers)
            ictx = InputContext(n, min(self.index, n - 1), n, worker=wctx, services=services,
                                dataset_id=rid)
            return wctx, ictx

        return contexts

    def _fetch_spec(self, session: str, rid: str) -> bytes | None:
        return self.call("daskdist_get_resource", session=session, rid=rid)

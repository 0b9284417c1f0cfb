"""CoordinatorWorkerPlugin: the worker side of daskdist.

A ``WorkerPlugin`` whose loop pulls closures from the scheduler plugin (reporting
finished results in the same call), keeps a small prefetch so RPC latency is hidden,
runs closures in its own threads (never on the worker's event loop), resolves
``PerWorkerValues`` to this worker's components, building missing per-worker
resources first. Everything it runs is tied to a *session*: a new session per plugin
setup, so closures handed to a session that ended are put back by the scheduler.

torch is imported lazily (device binding), so the scheduler can unpickle this plugin.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distributed.comm.addressing import get_address_host
from distributed.comm.core import CommClosedError
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol.pickle import dumps, loads
from distributed.utils import sync

from daskdist import config
from daskdist.context import (
    InputContext,
    WorkerContext,
    _set_current,
    _set_formation_version,
    _set_membership,
)
from daskdist.errors import CollectiveError, HostsUpdatedInterrupt, InputError
from daskdist.plugins.malloc import restore_dynamic_thresholds
from daskdist.plugins.protocol import (
    COLLECTIVE_ERROR,
    HOSTS_UPDATED,
    INPUT_ERROR,
    UNSTARTED,
    USER_ERROR,
    Dispatch,
    Result,
)
from daskdist.values import PerWorkerValues, dump_error, map_structure

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=100)
def _load_function(fn_bytes: bytes) -> Callable:
    """Unpickle a closure's function once per distinct payload (clients cache dumps)."""
    return loads(fn_bytes)


def worker_plugin_name(name: str) -> str:
    """The name the worker plugin of coordinator ``name`` is registered under."""
    return f"daskdist-worker-{name}"


def _runner(worker, name: str) -> ClosureRunner | None:
    plugin = worker.plugins.get(worker_plugin_name(name))
    return getattr(plugin, "runner", None)


def _error_kind(e: BaseException) -> str:
    if isinstance(e, InputError):
        return INPUT_ERROR
    if isinstance(e, HostsUpdatedInterrupt):
        return HOSTS_UPDATED
    if isinstance(e, CollectiveError):
        return COLLECTIVE_ERROR
    return USER_ERROR


class SchedulerLeases:
    """``InputContext.leases`` on a worker: the dynamic policy's lease RPCs, from any thread."""

    def __init__(self, runner: ClosureRunner):
        self.runner = runner

    def acquire(self, dataset_id: str, epoch: int,
                unit_rows: list[int]) -> tuple[int, list[tuple[int, int]]] | None:
        reply = self.runner.call("daskdist_lease_acquire", session=self.runner.session,
                                 dataset_id=dataset_id, epoch=int(epoch),
                                 unit_rows=[int(n) for n in unit_rows])
        lease = reply.get("lease")
        if lease is None:  # none free now, or this session expired (its work is fenced)
            return None
        return int(lease[0]), [(int(a), int(b)) for a, b in lease[1]]

    def progress(self, dataset_id: str, epoch: int, unit_rows: list[int] | None = None) -> dict:
        return self.runner.call("daskdist_lease_progress", dataset_id=dataset_id,
                                epoch=int(epoch),
                                unit_rows=None if unit_rows is None else list(unit_rows))

    def release(self, dataset_id: str, epoch: int, ranges: list) -> int:
        return self.runner.call("daskdist_lease_release", session=self.runner.session,
                                dataset_id=dataset_id, epoch=int(epoch),
                                ranges=[(int(a), int(b)) for a, b in ranges])


def _install_worker_handlers(worker) -> None:
    """Stream and RPC handlers shared by every coordinator's plugin on this worker."""
    def wake(name: str) -> None:
        runner = _runner(worker, name)
        if runner is not None:
            runner.poke()

    def peer_lost(name: str, generation: int) -> None:
        # through sys.modules, not an import: see _process_group_state
        collective = sys.modules.get("daskdist.collective")
        if collective is not None:  # no group was ever formed in this process otherwise
            collective.mark_peer_lost(generation)

    def membership(name: str, version: int) -> None:
        _set_membership(version, name=name)

    def hold(name: str, hold: bool) -> None:
        runner = _runner(worker, name)
        if runner is not None:
            runner.hold = hold

    def release(name: str, rids: list) -> None:
        runner = _runner(worker, name)
        if runner is not None:
            runner.resources.drop(rids)

    def steal(name: str, n: int) -> None:
        runner = _runner(worker, name)
        if runner is not None:
            runner.give_back(n)

    async def collective(action: str, name: str, **kw: Any) -> Any:
        from daskdist import collective as coll

        runner = _runner(worker, name)
        if action == "store":
            host = get_address_host(worker.address)
            return list(await asyncio.to_thread(coll.create_store, kw["generation"], host,
                                                kw["timeout"]))
        if action == "init":
            _set_formation_version(kw["generation"], kw.get("version"))
            await asyncio.to_thread(
                coll.init_member, kw["rank"], kw["world_size"], kw["host"], kw["port"],
                kw["backend"], kw["generation"], kw["timeout"],
                runner.device if runner is not None else None,
            )
            return {"rank": kw["rank"]}
        if action == "destroy":
            await asyncio.to_thread(coll.destroy_member)
            return None
        raise ValueError(f"unknown collective action {action!r}")

    worker.stream_handlers.update({
        "daskdist-wake": wake,
        "daskdist-peer-lost": peer_lost,
        "daskdist-membership": membership,
        "daskdist-hold": hold,
        "daskdist-steal": steal,
        "daskdist-release": release,
    })
    worker.handlers["daskdist_collective"] = collective


def _process_group_state() -> Any:
    """This process's collective-group state (``collective.runtime.PROCESS``), or
    ``None`` when no collective code ever ran here.

    Read through ``sys.modules``, never imported: importing ``daskdist.collective``
    imports torch, and this module is also imported (and this plugin unpickled) on the
    scheduler, which must not import torch (SPEC §1).
    """
    runtime = sys.modules.get("daskdist.collective.runtime")
    return None if runtime is None else runtime.PROCESS


def _highest_generation() -> int:
    """The newest collective generation this process has seen (later ones must be higher)."""
    state = _process_group_state()
    return 0 if state is None else state.highest_generation()


def _bind_device(torch_threads: int | None = None) -> tuple[Any, str]:
    """This worker's device and its GPU's UUID (``""`` without CUDA)."""
    import torch

    from daskdist.collective.device import bind_device, gpu_uuid

    restore_dynamic_thresholds()  # before torch allocates: see plugins/malloc.py
    if torch_threads:  # Dask starts workers with OMP_NUM_THREADS=1
        torch.set_num_threads(torch_threads)
    device = bind_device()
    return device, gpu_uuid(device)


class ResourceRegistry:
    """This worker's per-worker resources, built on first use from their factories."""

    def __init__(self, fetch_spec: Callable[[str], bytes | None],
                 contexts: Callable[[], tuple[WorkerContext, InputContext]]):
        self._fetch_spec = fetch_spec
        self._contexts = contexts
        self._objects: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}

    def get(self, rid: str) -> Any:
        try:
            return self._objects[rid]
        except KeyError:
            pass
        with self._lock:
            lock = self._building.setdefault(rid, threading.Lock())
        with lock:
            if rid not in self._objects:
                self._objects[rid] = self._build(rid)
            return self._objects[rid]

    def _build(self, rid: str) -> Any:
        payload = self._fetch_spec(rid)
        if payload is None:
            raise InputError(f"per-worker resource {rid} is not registered with the coordinator")
        kind, factory, parent = loads(payload)
        worker_ctx, input_ctx = self._contexts()
        try:
            if kind == "iterator":
                return (factory or iter)(self.get(parent))
            return factory(input_ctx if kind == "dataset" else worker_ctx)
        except InputError:
            raise
        except Exception as e:
            raise InputError(
                f"per-worker {kind} {rid} could not be built on worker "
                f"{worker_ctx.address}: {type(e).__name__}: {e}", e
            ) from e

    def resolve(self, structure: Any) -> Any:
        """Replace every per-worker reference in ``structure`` by this worker's component."""
        return map_structure(
            lambda v: self.get(v.rid) if isinstance(v, PerWorkerValues) and v.rid else v,
            structure,
        )

    def clear(self) -> None:
        self._objects.clear()

    def drop(self, rids: list[str]) -> None:
        """Forget released resources (a closure using one keeps its own reference)."""
        with self._lock:
            for rid in rids:
                self._objects.pop(rid, None)
                self._building.pop(rid, None)

    def __len__(self) -> int:
        return len(self._objects)


class ClosureRunner:
    """The pull loop of one session: exchange with the scheduler, run closures in threads."""

    def __init__(self, worker, name: str, prefetch: int | None = None):
        self.worker = worker
        self.name = name
        self.nthreads = max(1, worker.state.nthreads)
        if prefetch is None:
            prefetch = int(config.get("worker.prefetch"))
        self.capacity = self.nthreads + max(0, prefetch)
        self.executor = ThreadPoolExecutor(self.nthreads, thread_name_prefix=f"daskdist-{name}")
        # a slot of its own for gang members, so they start even when all threads are busy
        self.gang_executor = ThreadPoolExecutor(1, thread_name_prefix=f"daskdist-gang-{name}")
        self.session = ""
        self.index = -1
        self.num_workers = 0
        self.device: Any = None
        self.gpu = ""  # the device's GPU UUID: the scheduler tells shared GPUs apart by it
        self.held: set[str] = set()  # received, not yet acknowledged by the scheduler
        self.running = 0  # received, not yet finished here
        # Received closures not yet started, oldest first: ``nthreads`` drain loops in
        # the executor take them in order; ``give_back`` (event loop) takes from the
        # tail. Guarded by ``_lock`` (both sides).
        self._pending: deque[tuple] = deque()
        self._drains = 0  # drain loops running in the executor
        self._lock = threading.Lock()
        self.renewer: asyncio.Task | None = None
        self.done: list[tuple] = []  # finished, not yet sent
        self.wakeup = asyncio.Event()
        self.polling = False  # a blocking exchange is outstanding
        self.reporting = False
        self.stopping = False
        self.hold = False  # the scheduler is raising an error: give prefetched closures back
        self.poked = False  # the scheduler has pinned work for us: exchange now
        self.task: asyncio.Task | None = None
        self.resources = ResourceRegistry(self._fetch_spec, self._contexts)

    # -- life -----------------------------------------------------------------------
    async def start(self, torch_threads: int | None = None) -> None:
        self.device, self.gpu = await asyncio.to_thread(_bind_device, torch_threads)
        _install_worker_handlers(self.worker)
        await self._register()
        self.task = asyncio.create_task(self._loop())
        self.renewer = asyncio.create_task(self._renew_loop())

    async def _register(self) -> None:
        self.session = uuid.uuid4().hex
        reply = await self.worker.scheduler.daskdist_register(
            name=self.name, session=self.session, address=self.worker.address,
            slots=self.nthreads, device=str(self.device), gpu=self.gpu,
            generation=_highest_generation(),
        )
        if reply is None:
            raise RuntimeError("the daskdist scheduler plugin is not registered")
        self.index = reply["index"]
        self.num_workers = reply["num_workers"]
        _set_membership(reply["version"], name=self.name)
        self.resources.clear()

    async def stop(self) -> None:
        self.stopping = True
        if self.renewer is not None:
            self.renewer.cancel()
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        self._drop_pending()  # received, never started: the scheduler puts them back
        results, self.done = self.done, []
        try:
            await self.worker.scheduler.daskdist_unregister(
                name=self.name, session=self.session, results=results
            )
        except Exception as e:  # the scheduler is gone too: it will see the worker leave
            logger.debug("daskdist: unregister failed: %r", e)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.gang_executor.shutdown(wait=False, cancel_futures=True)

    def poke(self) -> None:
        self.poked = True
        self.wakeup.set()

    def call(self, op: str, **kwargs: Any) -> Any:
        """Call a scheduler handler from a worker thread (not the event loop)."""
        return sync(self.worker.loop, getattr(self.worker.scheduler, op), name=self.name,
                    **kwargs)

    async def _renew_loop(self) -> None:
        """Renew this session's lease every ``liveness.renew-interval`` (SPEC §2.4).

        Runs on the worker's event loop, not in a closure thread: closures release the
        GIL often enough for it to run (see ``tests/test_liveness.py``), so only a hung
        process or event loop lets the lease lapse. A refused renewal (the scheduler
        ended the session) wakes the exchange loop, which registers a new session.
        Each call is bounded so a dead connection cannot stall renewals for good.
        """
        interval = config.seconds("liveness.renew-interval")
        while not self.stopping:
            await asyncio.sleep(interval)
            try:
                reply = await asyncio.wait_for(
                    self.worker.scheduler.daskdist_renew(name=self.name, session=self.session),
                    max(5.0, 5 * interval))
            except (OSError, CommClosedError, asyncio.TimeoutError) as e:
                logger.info("daskdist: lease renewal failed (%r); retrying", e)
                continue
            if isinstance(reply, dict) and not reply.get("ok", True):
                self.poke()  # the next exchange learns the session is gone

    # -- the loop -----------------------------------------------------------------------
    def _retiring(self) -> bool:
        return self.worker.status.name in ("closing_gracefully", "closing", "closed")

    async def _loop(self) -> None:
        backoff = 0.05
        while not self.stopping:
            want = 0 if self._retiring() else self.capacity - self.running
            # Report results as soon as there are any (asking for more in the same call);
            # long-poll only when a thread is idle; otherwise wait for a result, so the
            # loop does not compete with running closures for the GIL.
            if not self.done and not self.poked and (want <= 0 or self.running >= self.nthreads):
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            results, self.done = self.done, []
            # With a thread idle, wait at the scheduler for work (results are applied
            # first, so reporting and asking again take one round trip); busy, do not.
            block = self.running < self.nthreads and want > 0 and not self.poked
            self.poked = False
            self.polling = block
            try:
                reply = await self.worker.scheduler.daskdist_exchange(
                    name=self.name, session=self.session, results=results,
                    held=list(self.held), want=want, block=block,
                )
            except (OSError, CommClosedError) as e:
                self.done[:0] = results  # not acknowledged: send again
                logger.info("daskdist: exchange with scheduler failed (%r); retrying", e)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            finally:
                self.polling = False
            backoff = 0.05
            if reply.get("unknown_session"):
                # The scheduler ended this session (it put our closures back): start anew.
                self.held.clear()
                self.done.clear()
                self._drop_pending()
                await self._register()
                continue
            for r in results:
                self.held.discard(r[0])
            self.num_workers = reply["num_workers"]
            self.hold = reply["hold"]
            _set_membership(reply["version"], name=self.name)
            session = self.session
            work = []
            for cid, payload, attempt, gang in map(Dispatch._make, reply["closures"]):
                self.held.add(cid)
                if gang:
                    self.gang_executor.submit(self._run, session, cid, payload, attempt, True)
                else:
                    work.append((session, cid, payload, attempt))
            if work:
                self.running += len(work)
                self._enqueue(work)

    def _enqueue(self, work: list[tuple]) -> None:
        """Queue received closures and start drain loops for idle threads (event loop)."""
        with self._lock:
            self._pending.extend(work)
            start = min(len(self._pending), self.nthreads - self._drains)
            self._drains += start
        for _ in range(start):
            self.executor.submit(self._drain)

    def _drain(self) -> None:
        """A closure thread: run pending closures in order until there are none."""
        while True:
            with self._lock:
                if not self._pending:
                    self._drains -= 1
                    return
                item = self._pending.popleft()
            self._run(*item)

    def give_back(self, n: int) -> int:
        """The scheduler asks for up to ``n`` unstarted closures back (an idle worker
        waits): the newest pending ones return as ``UNSTARTED`` results. Event loop."""
        with self._lock:
            take = [self._pending.pop() for _ in range(min(max(0, n), len(self._pending)))]
        if not take:
            return 0
        self.running -= len(take)
        self.done.extend(Result(cid, False, None, UNSTARTED, []) for session, cid, _, _ in take
                         if session == self.session)
        self.wakeup.set()
        if self.polling and not self.reporting:
            asyncio.ensure_future(self._report())
        return len(take)

    def _drop_pending(self) -> None:
        """The session ended: closures it received and did not start are not ours to run."""
        with self._lock:
            dropped = len(self._pending)
            self._pending.clear()
        self.running -= dropped

    def _on_done(self, session: str, result: Result, gang: bool) -> None:
        """Runs on the event loop when a closure finished in a thread."""
        if not gang:
            self.running -= 1  # a thread is free, whichever session it ran for
        if session != self.session:
            self.wakeup.set()
            return  # the session ended meanwhile; the scheduler would refuse the result
        self.done.append(result)
        self.wakeup.set()
        if self.polling and not self.reporting:
            asyncio.ensure_future(self._report())

    async def _report(self) -> None:
        """Send results while the loop is blocked waiting for work."""
        self.reporting = True
        try:
            while self.polling and self.done:
                results, self.done = self.done, []
                try:
                    reply = await self.worker.scheduler.daskdist_report(
                        name=self.name, session=self.session, results=results
                    )
                except (OSError, CommClosedError):
                    self.done[:0] = results
                    return
                if reply.get("unknown_session"):
                    self.poke()  # fenced: the loop's next exchange registers anew
                    return
                for r in results:
                    self.held.discard(r[0])
                self.hold = reply["hold"]
        finally:
            self.reporting = False

    # -- running a closure (worker thread) ------------------------------------------------
    def _worker_context(self, attempt: int = 1) -> WorkerContext:
        return WorkerContext(self.index, self.num_workers, self.device,
                             self.worker.address, attempt, self.name)

    def _contexts(self) -> tuple[WorkerContext, InputContext]:
        """What per-worker factories receive (built only when a resource is built)."""
        wctx = self._worker_context()
        n = max(1, self.num_workers)
        ictx = InputContext(n, min(self.index, n - 1), n, worker=wctx,
                            leases=SchedulerLeases(self))
        return wctx, ictx

    def _fetch_spec(self, rid: str) -> bytes | None:
        return self.call("daskdist_get_resource", rid=rid)

    def _run(self, session: str, cid: str, payload: bytes, attempt: int,
             gang: bool = False) -> None:
        if self.hold and not gang:  # an error is being raised: this counts as still queued
            self._finished(session, Result(cid, False, None, UNSTARTED, []), gang)
            return
        tokens: list = []
        _set_current(self._worker_context(attempt), tokens.append)
        try:
            fn_bytes, arg_bytes = payload
            fn = _load_function(fn_bytes)
            args, kwargs = ((), {}) if arg_bytes is None else loads(arg_bytes)
            if args or kwargs:
                args, kwargs = self.resources.resolve((args, kwargs))
            value = fn(*args, **kwargs)
            result = Result(cid, True, dumps(value), None, tokens)
        except BaseException as e:  # noqa: BLE001 - every user error goes back to the client
            result = Result(cid, False, dump_error(e), _error_kind(e), tokens)
        finally:
            _set_current(None, None)
        self._finished(session, result, gang)

    def _finished(self, session: str, result: Result, gang: bool = False) -> None:
        try:
            self.worker.loop.add_callback(self._on_done, session, result, gang)
        except RuntimeError:  # the worker's loop is closed: the worker is going away
            pass


class CoordinatorWorkerPlugin(WorkerPlugin):
    """Registered on every worker (present and future) by the scheduler plugin."""

    idempotent = True

    def __init__(self, name: str = "default", prefetch: int | None = None,
                 torch_threads: int | None = None):
        self.name = name
        self.prefetch = prefetch
        self.torch_threads = torch_threads
        self.runner: ClosureRunner | None = None

    async def setup(self, worker) -> None:
        self.runner = ClosureRunner(worker, self.name, self.prefetch)
        await self.runner.start(self.torch_threads)

    async def teardown(self, worker) -> None:
        if self.runner is not None:
            await self.runner.stop()
            self.runner = None

    def __getstate__(self):
        return {"name": self.name, "prefetch": self.prefetch,
                "torch_threads": self.torch_threads, "runner": None}

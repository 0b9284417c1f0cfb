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
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distributed.comm.core import CommClosedError
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol.pickle import dumps, loads
from distributed.utils import sync

from daskdist.context import InputContext, WorkerContext, _set_current, _set_membership
from daskdist.errors import InputError
from daskdist.plugins.queue import INPUT_ERROR, UNSTARTED, USER_ERROR
from daskdist.values import PerWorkerValues, dump_error, map_structure

logger = logging.getLogger(__name__)

DEFAULT_PREFETCH = 16


def bind_device() -> Any:
    """This worker's device: ``cuda:0`` (under its CUDA_VISIBLE_DEVICES) if any, else CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda:0")
    return torch.device("cpu")


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
                return iter(self.get(parent))
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


class ClosureRunner:
    """The pull loop of one session: exchange with the scheduler, run closures in threads."""

    def __init__(self, worker, name: str, prefetch: int = DEFAULT_PREFETCH):
        self.worker = worker
        self.name = name
        self.nthreads = max(1, worker.state.nthreads)
        self.capacity = self.nthreads + max(0, prefetch)
        self.executor = ThreadPoolExecutor(self.nthreads, thread_name_prefix=f"daskdist-{name}")
        self.session = ""
        self.index = -1
        self.num_workers = 0
        self.device: Any = None
        self.held: set[str] = set()  # received, not yet acknowledged by the scheduler
        self.running = 0  # received, not yet finished here
        self.done: list[tuple] = []  # finished, not yet sent
        self.wakeup = asyncio.Event()
        self.polling = False  # a blocking exchange is outstanding
        self.reporting = False
        self.stopping = False
        self.hold = False  # the scheduler is raising an error: give prefetched closures back
        self.task: asyncio.Task | None = None
        self.resources = ResourceRegistry(self._fetch_spec, self._contexts)

    # -- life -----------------------------------------------------------------------
    async def start(self) -> None:
        self.device = await asyncio.to_thread(bind_device)
        await self._register()
        self.task = asyncio.create_task(self._loop())

    async def _register(self) -> None:
        self.session = uuid.uuid4().hex
        reply = await self.worker.scheduler.daskdist_register(
            name=self.name, session=self.session, address=self.worker.address,
            slots=self.nthreads,
        )
        if reply is None:
            raise RuntimeError("the daskdist scheduler plugin is not registered")
        self.index = reply["index"]
        self.num_workers = reply["num_workers"]
        _set_membership(reply["version"])
        self.resources.clear()

    async def stop(self) -> None:
        self.stopping = True
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        results, self.done = self.done, []
        try:
            await self.worker.scheduler.daskdist_unregister(
                name=self.name, session=self.session, results=results
            )
        except Exception as e:  # the scheduler is gone too: it will see the worker leave
            logger.debug("daskdist: unregister failed: %r", e)
        self.executor.shutdown(wait=False, cancel_futures=True)

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
            if not self.done and (want <= 0 or self.running >= self.nthreads):
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            results, self.done = self.done, []
            block = not results
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
                await self._register()
                continue
            for r in results:
                self.held.discard(r[0])
            self.num_workers = reply["num_workers"]
            self.hold = reply["hold"]
            _set_membership(reply["version"])
            session = self.session
            for cid, payload, attempt in reply["closures"]:
                self.held.add(cid)
                self.running += 1
                self.executor.submit(self._run, session, cid, payload, attempt)

    def _on_done(self, session: str, result: tuple) -> None:
        """Runs on the event loop when a closure finished in a thread."""
        if session != self.session:
            return  # the session ended meanwhile; the scheduler refuses it anyway
        self.running -= 1
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
                for r in results:
                    self.held.discard(r[0])
                self.hold = reply["hold"]
        finally:
            self.reporting = False

    # -- running a closure (worker thread) ------------------------------------------------
    def _contexts(self, attempt: int = 1) -> tuple[WorkerContext, InputContext]:
        wctx = WorkerContext(self.index, self.num_workers, self.device,
                             self.worker.address, attempt, self.name)
        n = max(1, self.num_workers)
        ictx = InputContext(n, min(self.index, n - 1), n, worker=wctx)
        return wctx, ictx

    def _fetch_spec(self, rid: str) -> bytes | None:
        return sync(self.worker.loop, self.worker.scheduler.daskdist_get_resource,
                    name=self.name, rid=rid)

    def _run(self, session: str, cid: str, payload: bytes, attempt: int) -> None:
        if self.hold:  # an error is being raised: this closure counts as still queued
            self._finished(session, (cid, False, None, UNSTARTED, []))
            return
        tokens: list = []
        _set_current(self._contexts(attempt)[0], tokens.append)
        try:
            fn, args, kwargs = loads(payload)
            if args or kwargs:
                args, kwargs = self.resources.resolve((args, kwargs))
            value = fn(*args, **kwargs)
            result = (cid, True, dumps(value), None, tokens)
        except InputError as e:
            result = (cid, False, dump_error(e), INPUT_ERROR, tokens)
        except BaseException as e:  # noqa: BLE001 - every user error goes back to the client
            result = (cid, False, dump_error(e), USER_ERROR, tokens)
        finally:
            _set_current(None, None)
        self._finished(session, result)

    def _finished(self, session: str, result: tuple) -> None:
        try:
            self.worker.loop.add_callback(self._on_done, session, result)
        except RuntimeError:  # the worker's loop is closed: the worker is going away
            pass


class CoordinatorWorkerPlugin(WorkerPlugin):
    """Registered on every worker (present and future) by the scheduler plugin."""

    idempotent = True

    def __init__(self, name: str = "default", prefetch: int = DEFAULT_PREFETCH):
        self.name = name
        self.prefetch = prefetch
        self.runner: ClosureRunner | None = None

    async def setup(self, worker) -> None:
        self.runner = ClosureRunner(worker, self.name, self.prefetch)
        await self.runner.start()

    async def teardown(self, worker) -> None:
        if self.runner is not None:
            await self.runner.stop()
            self.runner = None

    def __getstate__(self):
        return {"name": self.name, "prefetch": self.prefetch, "runner": None}

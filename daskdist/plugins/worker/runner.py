"""ClosureRunner: one coordinator's pull loop on one worker, the threads it runs
closures in and how their values leave.

The loop pulls closures from the scheduler plugin (reporting finished ones in the same
call), keeps a small prefetch so RPC latency is hidden, and runs closures in its own
daemon threads (:class:`DaemonPool`, never on the worker's event loop). Everything it
runs belongs to a *session* (:class:`~daskdist.plugins.worker.services.Session`,
registered, renewed and ended by the runner's base,
:class:`~daskdist.plugins.worker.services.SessionLifecycle`). A session owns its
scheduler services and its per-worker resources; each closure runs bound to the session
it was dispatched under (:func:`daskdist.session.scope.closure_scope`), so a closure that
outlives its session can only make calls the scheduler refuses, and its result is
dropped. A closure's value is pickled with its tensors on the host (:func:`dump_result`).

Threads: the event loop owns the loop state (``unacked``, ``done``, ``taken``, the
current session, which it registers, renews and ends); closure threads run ``_run``
and hand results back with ``add_callback``; ``_pending`` (received, not started) and
``_started`` (started, not finished) are shared under ``_lock``. Every message to the
scheduler says which held closures started, so a lost worker's prefetched closures
count no failure.
A worker with a preemption deadline starts only closures expected to end before it
(:class:`~daskdist.plugins.worker.deadlines.Admission`); the others go back unstarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import functools
import io
import logging
import os
import pickle
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import cloudpickle
from distributed.comm.core import CommClosedError
from distributed.protocol.pickle import dumps, loads
from distributed.utils import sync

from daskdist import config
from daskdist.context import WorkerContext
from daskdist.core.gpus import given_gpu, gpu_identity
from daskdist.core.leases.table import merge_tokens
from daskdist.core.protocol import (
    COLLECTIVE_ERROR,
    FAILED,
    HOSTS_UPDATED,
    INPUT_ERROR,
    PENDING,
    READY,
    RETIRING,
    UNSTARTED,
    USER_ERROR,
    Dispatch,
    Outcome,
    Preemption,
    is_session_ended,
)
from daskdist.errors import CollectiveError, HostsUpdatedInterrupt, InputError, dump_error
from daskdist.observe.recorder import gang_scope
from daskdist.plugins.worker import deadlines
from daskdist.plugins.worker.malloc import restore_dynamic_thresholds
from daskdist.plugins.worker.services import Session, SessionLifecycle
from daskdist.session.counters import set_membership
from daskdist.session.scope import ClosureScope, closure_scope, origin_of

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=100)
def _load_function(fn_bytes: bytes) -> Callable:
    """Unpickle a closure's function once per distinct payload (clients cache dumps)."""
    return loads(fn_bytes)


def _error_kind(e: BaseException) -> str:
    if isinstance(e, InputError):
        return INPUT_ERROR
    if isinstance(e, HostsUpdatedInterrupt):
        return HOSTS_UPDATED
    if isinstance(e, CollectiveError):
        # re-running the gang on a re-formed group cannot help every collective error
        # (no member holds the committed state): those fail the gang like a user error
        return COLLECTIVE_ERROR if e.transient else USER_ERROR
    return USER_ERROR


def _bind_device(torch_threads: int | None = None) -> tuple[Any, str]:
    """This worker's device and the GPU it reports (:func:`gpu_identity`: the UUID or
    MIG id it was given, else its device's UUID, else the index it was given; ``""``
    with none). A worker given a GPU that binds the CPU says so in its log."""
    import torch

    from daskdist.collective.device import bind_device, gpu_uuid

    restore_dynamic_thresholds()  # before torch allocates: see plugins/worker/malloc.py
    if torch_threads:  # Dask starts workers with OMP_NUM_THREADS=1
        torch.set_num_threads(torch_threads)
    device = bind_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    cuda = device.type == "cuda"
    gpu = gpu_identity(visible, gpu_uuid(device) if cuda else "", cuda)
    if not cuda and given_gpu(visible) is not None:
        logger.warning("daskdist: CUDA_VISIBLE_DEVICES=%r gives this worker GPU %s, but "
                       "torch sees no CUDA device: it runs on the CPU", visible, gpu)
    return device, gpu


class DaemonPool:
    """At most ``size`` daemon threads running submitted calls in order (threads start
    on demand, as ThreadPoolExecutor's do). ``submit`` and ``shutdown`` from any thread.

    Daemon threads because ``concurrent.futures.ThreadPoolExecutor`` joins its threads
    when the process exits: a closure still running when its worker process was asked
    to exit (Ctrl-C on a LocalCluster's client, ``cluster.close()``) held the exit until
    the nanny gave up and SIGKILLed the process (``0.8 x`` its 5 s timeout, every time).
    A closure lives no longer than its worker: these threads end with the process, and
    a stop takes the time the worker's own close takes.
    """

    def __init__(self, size: int, prefix: str) -> None:
        self.size = max(1, int(size))
        self.prefix = prefix
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # threads waiting for work
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in a pool thread; ``RuntimeError`` after :meth:`shutdown`."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.prefix}: cannot submit after shutdown")
            self._work.put((fn, args))
            if self._idle.acquire(timeout=0):
                return  # an idle thread takes it
            if len(self._threads) < self.size:
                t = threading.Thread(target=self._serve, daemon=True,
                                     name=f"{self.prefix}_{len(self._threads)}")
                self._threads.append(t)
                t.start()

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a pool thread outlives any one call
                logger.exception("daskdist: %s: a call failed", self.prefix)
            del item, fn, args
            self._idle.release()

    def shutdown(self) -> None:
        """Drop calls not started and let the threads end once their call returns
        (without waiting for them: a running closure may be blocked for long)."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    self._work.get_nowait()
                except queue.Empty:
                    break
            for _ in self._threads:
                self._work.put(None)


def dump_result(value: Any, host: str | None = "cpu") -> bytes:
    """``value`` pickled, every tensor not on ``host`` as a copy on ``host`` (``None``:
    as they are). ``host`` is a parameter so the CPU tests can send every tensor to
    ``"meta"`` and see that each one took the hook.

    A closure that returns CUDA tensors (a loss, a state dict, predictions) could not be
    fetched on a client without CUDA: torch pickles a tensor with its device, and
    unpickling a CUDA tensor needs CUDA. So every tensor not on the host is pickled as
    its host copy, at any depth of the value (lists, dicts, a user's object), unless
    ``daskdist.worker.results-to-cpu`` is false (the client has the same GPUs). Tensors
    on the host pickle as they are (no copy), and a value with no tensor pickles as it
    always did: the hook is a per-type entry of the pickler's dispatch table.
    """
    torch = sys.modules.get("torch")
    if host is None or torch is None:  # no torch imported here: no tensor in the value
        return dumps(value)
    plain, cloud = _tables(host, torch)
    buf = io.BytesIO()
    try:
        p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        p.dispatch_table = plain
        p.dump(value)
    except Exception:  # a lambda, a local class: cloudpickle, as distributed does
        buf = io.BytesIO()
        _CloudPickler(buf, cloud).dump(value)
    return buf.getvalue()


class _CloudPickler(cloudpickle.Pickler):
    """cloudpickle with a dispatch table of its own: the C pickler reads the table when
    it is made (cloudpickle's class attribute would win over one set afterwards)."""

    def __init__(self, file: Any, table: dict) -> None:
        self.dispatch_table = table
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)


_TABLES: dict[tuple[str, int], tuple[dict, dict]] = {}


def _tables(host: str, torch: Any) -> tuple[dict, dict]:
    """The dispatch tables of pickle and cloudpickle as plain dicts (the C pickler looks
    every object's type up in them) with the tensor types' entry; made once per host
    (and again if a package registered another reducer with ``copyreg``)."""
    key = (host, len(copyreg.dispatch_table))
    tables = _TABLES.get(key)
    if tables is None:
        reduce = _to_host(host)
        made = []
        for base in (copyreg.dispatch_table, cloudpickle.Pickler.dispatch_table):
            table = dict(base.items())
            table[torch.Tensor] = table[torch.nn.Parameter] = reduce
            made.append(table)
        tables = _TABLES[key] = (made[0], made[1])
    return tables


def _to_host(host: str):
    import torch

    host_type = torch.device(host).type

    def reduce(t: Any) -> Any:
        if t.device.type != host_type:
            moved = t.detach().to(host)
            if isinstance(t, torch.nn.Parameter):
                moved = torch.nn.Parameter(moved, requires_grad=t.requires_grad)
            else:
                moved.requires_grad_(t.requires_grad and moved.is_floating_point())
            t = moved
        return t.__reduce_ex__(2)

    return reduce


class Work(NamedTuple):
    """A received closure, and the session it was dispatched under."""

    session: Session
    cid: str
    payload: Any
    attempt: int
    gang: bool
    owner: str


class ClosureRunner(SessionLifecycle):
    """The pull loop of one coordinator on one worker: exchange, run closures in threads
    (its base, :class:`SessionLifecycle`, registers, renews and ends its sessions)."""

    def __init__(self, worker, name: str, prefetch: int | None = None):
        self.worker = worker
        self.name = name
        self.nthreads = max(1, worker.state.nthreads)
        if prefetch is None:
            prefetch = int(config.get("worker.prefetch"))
        self.capacity = self.nthreads + max(0, prefetch)
        # daemon threads: a closure running when the process exits does not hold the exit
        self.executor = DaemonPool(self.nthreads, f"daskdist-{name}")
        # a slot of its own for gang members, so they start even when all threads are busy
        self.gang_executor = DaemonPool(1, f"daskdist-gang-{name}")
        self.session: Session | None = None
        self.index = -1
        self.num_workers = 0
        self.device: Any = None
        self.gpu = ""  # the GPU it reports: the scheduler tells shared GPUs apart by it
        self.unacked: set[str] = set()  # received, not yet acknowledged by the scheduler
        self.taken = 0  # received, not yet finished here: running or prefetched (not gangs)
        self.gangs = 0  # gang members received, not yet finished (their own executor)
        self.leaving = False  # the scheduler said this worker retires (see stop())
        # (generation, the members this one passes that generation's broken-group word on
        # to): set by the group's init, taken once by the peer-lost handler (event loop)
        self.relay: tuple[int, list[str]] | None = None
        # Received closures not yet started, oldest first: ``nthreads`` drain loops in
        # the executor take them in order; ``give_back`` (event loop) takes from the
        # tail. Guarded by ``_lock`` (both sides).
        self._pending: deque[Work] = deque()
        self._started: set[str] = set()  # started here, not yet finished
        self._drains = 0  # drain loops running in the executor
        self._lock = threading.Lock()
        self.renewer: asyncio.Task | None = None
        # how often to renew the session's lease: the scheduler's word (it grows with
        # the cluster, as Dask's heartbeats do), the configured interval until it speaks
        self.renew_interval = config.seconds("liveness.renew-interval")
        self.observe = 0.0  # gang members' window length, the scheduler's word (0: none)
        self.last_sent = 0.0  # when the last exchange left (it renews the lease too)
        self.done: list[Outcome] = []  # finished, not yet sent
        self.wakeup = asyncio.Event()
        self.polling = False  # a blocking exchange is outstanding
        self.reporting = False
        self.stopping = False
        # owners whose error the scheduler is raising: give their prefetched closures back
        self.hold: frozenset[str] = frozenset()
        self.registering: str | None = None  # the session the scheduler may ask us to confirm
        self.poked = False  # the scheduler has pinned work for us: exchange now
        self.task: asyncio.Task | None = None
        self.closers: list[threading.Thread] = []  # closing ended sessions' resources
        # results leave with their tensors on the host (a client may have no CUDA)
        self.results_host = "cpu" if config.get("worker.results-to-cpu", True) else None
        # this worker's preemption deadline (the deadline watch sets it), the closures'
        # durations (function key, seconds: a C append, the closure's path runs no code
        # elsewhere) and the judgement of what ends before the deadline
        self.deadline: Preemption | None = None
        self.ran: deque[tuple[int, float]] = deque(maxlen=1024)
        self.admission = deadlines.Admission()

    @property
    def session_id(self) -> str:
        return self.session.id if self.session is not None else ""

    # -- life -----------------------------------------------------------------------
    async def start(self, torch_threads: int | None = None) -> None:
        """Bind the device (a failure fails the plugin's setup), then start the loop,
        which registers the first session: not here, because the scheduler confirms a
        registration by asking this worker, which answers no one while it starts (a
        worker sets its plugins up during its own start)."""
        self.device, self.gpu = await asyncio.to_thread(_bind_device, torch_threads)
        self.task = asyncio.create_task(self._loop())
        self.renewer = asyncio.create_task(self._renew_loop())

    async def stop(self) -> None:
        """The plugin is torn down. A worker leaving gracefully (retired, or a
        preemption notice) first lets its gang members reach their next commit, where
        they leave their group (a last holder checkpoints there), for at most
        ``daskdist.preemption.grace``; then the session ends and the closures still
        running are reported started, to run again elsewhere."""
        if self.leaving and self.gangs:
            deadline = time.monotonic() + config.seconds("preemption.grace")
            while self.gangs and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
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
        session = self.session_id or self.registering  # a registration cut short
        try:
            if session:
                await self.worker.scheduler.daskdist_unregister(
                    name=self.name, session=session, results=results,
                    started=self.started(),
                )
        except Exception as e:  # the scheduler is gone too: it will see the worker leave
            logger.debug("daskdist: unregister failed: %r", e)
        self._end_session()
        self.executor.shutdown()
        self.gang_executor.shutdown()

    def poke(self) -> None:
        self.poked = True
        self.wakeup.set()

    def call(self, op: str, **kwargs: Any) -> Any:
        """Call a scheduler handler from a worker thread (not the event loop); the wait
        ends after ``daskdist.worker.rpc-timeout`` (``TimeoutError``)."""
        return sync(self.worker.loop, getattr(self.worker.scheduler, op), name=self.name,
                    callback_timeout=config.seconds("worker.rpc-timeout"), **kwargs)

    # -- the loop -----------------------------------------------------------------------
    def _retiring(self) -> bool:
        return self.worker.status.name in RETIRING

    async def _loop(self) -> None:
        if not await self._register_until_done():
            return
        deadlines.tell(self)  # a deadline known before this session: the scheduler hears it
        backoff = 0.05
        while not self.stopping:
            late = self.deadline is not None and not self.admission.takes_more(self)
            want = 0 if self._retiring() or late else self.capacity - self.taken
            # Report results as soon as there are any (asking for more in the same call);
            # long-poll only when a thread is idle; otherwise wait for a result, so the
            # loop does not compete with running closures for the GIL.
            if not self.done and not self.poked and (want <= 0 or self.taken >= self.nthreads):
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            results, self.done = self.done, []
            # With a thread idle, wait at the scheduler for work (results are applied
            # first, so reporting and asking again take one round trip); busy, do not.
            block = self.taken < self.nthreads and want > 0 and not self.poked
            self.poked = False
            self.polling = block
            self.last_sent = time.monotonic()
            try:
                reply = await self.worker.scheduler.daskdist_exchange(
                    name=self.name, session=self.session_id, results=results,
                    held=list(self.unacked), want=want, block=block, started=self.started(),
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
            if reply.get("closed"):  # its last owner closed: this plugin is being removed
                return
            if is_session_ended(reply):
                # The scheduler ended this session (it put our closures back): start anew.
                self.unacked.clear()
                self.done.clear()
                self._drop_pending()
                if not await self._register_until_done():
                    return
                deadlines.tell(self)
                continue
            for r in results:
                self.unacked.discard(r.cid)
            self.num_workers = reply["num_workers"]
            self.renew_interval = reply.get("renew", self.renew_interval)
            self.set_hold(reply["hold"])
            set_membership(reply["version"], reply.get("joins"), session=self.session_id)
            session = self.session
            work = []
            for cid, payload, attempt, gang, owner in map(Dispatch._make, reply["closures"]):
                self.unacked.add(cid)
                item = Work(session, cid, payload, attempt, gang, owner)
                if gang:
                    self.gangs += 1
                    self.gang_executor.submit(self._run_gang, item)
                else:
                    work.append(item)
            if work:
                self.taken += len(work)
                self._enqueue(work)

    def _enqueue(self, work: list[Work]) -> None:
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
                self._started.add(item.cid)
            self._run(item)

    @property
    def busy(self) -> int:
        """Closures received here and not finished, gang members included (event loop)."""
        return self.taken + self.gangs

    def started(self) -> list[str]:
        """Closures started here and not yet finished (what the scheduler may count as
        executing if this worker is lost)."""
        with self._lock:
            return list(self._started)

    def give_back(self, n: int) -> int:
        """The scheduler asks for up to ``n`` unstarted closures back (an idle worker
        waits): the newest pending ones return as unstarted. Event loop."""
        with self._lock:
            take = [self._pending.pop() for _ in range(min(max(0, n), len(self._pending)))]
        if not take:
            return 0
        self.taken -= len(take)
        self.done.extend(_unstarted(w) for w in take if w.session is self.session)
        self.wakeup.set()
        if self.polling and not self.reporting:
            asyncio.ensure_future(self._report())
        return len(take)

    def set_hold(self, owners: list[str]) -> None:
        """The scheduler holds these owners' closures (raising an error of theirs, or
        they closed): the ones received and not started go back now, unstarted, and
        none of theirs starts until released. Event loop."""
        hold = frozenset(owners)
        if hold == self.hold:
            return
        self.hold = hold
        if not hold:
            return
        with self._lock:
            take = [w for w in self._pending if w.owner in hold]
            if take:
                self._pending = deque(w for w in self._pending if w.owner not in hold)
        if take:
            self.taken -= len(take)
            self.done.extend(_unstarted(w) for w in take if w.session is self.session)
            self.wakeup.set()
            if self.polling and not self.reporting:
                asyncio.ensure_future(self._report())

    def _drop_pending(self) -> None:
        """The session ended: closures it received and did not start are not ours to run."""
        with self._lock:
            dropped = len(self._pending)
            self._pending.clear()
        self.taken -= dropped

    def _on_done(self, item: Work, result: Outcome | None) -> None:
        """Runs on the event loop when a closure finished in a thread (``result`` None:
        it was not run, its session having ended)."""
        if not item.gang:
            self.taken -= 1  # a thread is free, whichever session it ran for
            with self._lock:
                self._started.discard(item.cid)
        if result is None or item.session is not self.session:
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
                        name=self.name, session=self.session_id, results=results,
                        held=list(self.unacked), started=self.started(),
                    )
                except (OSError, CommClosedError):
                    self.done[:0] = results
                    return
                if is_session_ended(reply):
                    self.poke()  # fenced: the loop's next exchange registers anew
                    return
                for r in results:
                    self.unacked.discard(r.cid)
                self.set_hold(reply["hold"])
        finally:
            self.reporting = False

    # -- running a closure (worker thread) ------------------------------------------------
    def _worker_context(self, attempt: int = 1) -> WorkerContext:
        return WorkerContext(self.index, self.num_workers, self.device,
                             self.worker.address, attempt, self.name)

    def _run(self, item: Work) -> None:
        session = item.session
        if session.services.ended:  # not ours to run any more: the scheduler put it back
            self._finished(item, None)  # its slot is free again; no result to send
            return
        if item.owner in self.hold and not item.gang:  # its owner's error is being raised
            self._finished(item, _unstarted(item))
            return
        if self.deadline is not None and not item.gang and \
                not self.admission.fits(self, item.payload[0]):  # it would end too late
            self._finished(item, _unstarted(item))
            return
        scope = ClosureScope(self._worker_context(item.attempt), session.services,
                             origin=origin_of(item.cid))
        with closure_scope(scope):
            try:
                fn_bytes, arg_bytes = item.payload
                fn = _load_function(fn_bytes)
                args, kwargs = ((), {}) if arg_bytes is None else loads(arg_bytes)
                if args or kwargs:
                    args, kwargs = session.resources.resolve((args, kwargs))
                start = time.monotonic()
                value = fn(*args, **kwargs)
                if not item.gang:
                    self.ran.append((hash(fn_bytes), time.monotonic() - start))
                state, payload, kind = READY, dump_result(value, self.results_host), None
            except BaseException as e:  # noqa: BLE001 - every user error goes to the client
                state, payload, kind = FAILED, dump_error(e), _error_kind(e)
        # sealed: a thread the closure started takes no more rows for it (they would
        # never be acknowledged), so the tokens sent now are all it consumed; merged
        # only when there are any (a closure that read no rows needs no merging)
        tokens = scope.end()
        aside = scope.end_aside()  # fetched ahead, never trained: back to the pool
        if aside and item.gang:
            # a gang member's tokens are never acknowledged by its result: the
            # scheduler releases them all with it (no call of their own)
            tokens, aside = tokens + aside, []
        if tokens:
            tokens = merge_tokens(tokens)
        if aside:
            with contextlib.suppress(Exception):  # an ended session's rows go with it
                session.services.release_tokens(aside)
        self._finished(item, Outcome(item.cid, state, payload, kind, item.attempt,
                                     tokens=tokens))

    def _run_gang(self, item: Work) -> None:
        """A gang member's thread: run it, then count it finished (event loop)."""
        try:
            with gang_scope(self, item.cid, item.session):  # its steps' phases (SPEC §5.1)
                self._run(item)
        finally:
            try:
                self.worker.loop.add_callback(self._gang_ended)
            except RuntimeError:  # the worker's loop is closed: the worker is going away
                pass

    def _gang_ended(self) -> None:
        self.gangs -= 1
        if self.deadline is not None:  # leaving on it: its iterators' rows go back
            deadlines.left_group(self)

    def _finished(self, item: Work, result: Outcome | None) -> None:
        try:
            self.worker.loop.add_callback(self._on_done, item, result)
        except RuntimeError:  # the worker's loop is closed: the worker is going away
            pass


def _unstarted(item: Work) -> Outcome:
    """A closure handed back without being started (not an error)."""
    return Outcome(item.cid, PENDING, None, UNSTARTED, item.attempt)

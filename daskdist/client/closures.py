"""The client's closure machinery: ``RemoteValue`` and its statuses, ``PerWorkerValues``
and the per-rank ``GangValues``, and ``ClosureClient``, the half of ``Coordinator`` a
closure's path runs on the client (``schedule`` to ``fetch``).

``schedule`` never waits for a round trip: closures are pickled in the caller's thread
and sent in batches by a flusher on the client's event loop; outcomes come back in
batches through one long-poll and resolve their ``RemoteValue``s. Errors follow
TensorFlow: the first failure is raised by the next ``schedule`` / ``join`` / ``done``,
which first cancels everything still queued. Errors belong to their owner: another
Coordinator of the same name (another notebook) never sees them.
"""

from __future__ import annotations

import asyncio
import html
import itertools
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any

import cloudpickle
from distributed import Client
from distributed.comm.core import CommClosedError
from distributed.worker import dumps_function

from daskdist import config
from daskdist.client import reprs
from daskdist.core import checks, protocol
from daskdist.core.nest import map_structure
from daskdist.core.protocol import (
    CANCELLED,
    FAILED,
    READY,
    USER_ERROR,
    Outcome,
    Submission,
)
from daskdist.errors import CancelledError, CoordinatorClosedError, dump_error, load_error


class RemoteValueStatus(str, Enum):
    """Where a scheduled closure is in its life (SPEC §2.5a)."""

    PENDING = protocol.PENDING
    RUNNING = protocol.RUNNING
    READY = protocol.READY
    FAILED = protocol.FAILED
    CANCELLED = protocol.CANCELLED


class RemoteValue:
    """The future result of one scheduled closure (TensorFlow's ``RemoteValue``).

    ``reader(cid)`` is called once, when its value is first read (``fetch`` or
    ``exception`` returns): a keep-alive coordinator's read receipt."""

    __slots__ = ("_cid", "_coordinator", "_event", "_status", "_payload", "_kind",
                 "_value", "_loaded", "_reader", "attempt", "__weakref__")

    def __init__(self, cid: str, coordinator: Any = None,
                 reader: Callable[[str], None] | None = None):
        self._cid = cid
        self._coordinator = coordinator
        self._reader = reader
        self._event = threading.Event()
        self._status = RemoteValueStatus.PENDING
        self._payload: Any = None
        self._kind: str | None = None
        self._value: Any = None
        self._loaded = False
        self.attempt = 0

    # set by the coordinator's result loop
    def _set(self, state: str, payload: Any, kind: str | None, attempt: int) -> None:
        if self._event.is_set():
            return  # final once
        self._status = RemoteValueStatus(state)
        self._payload = payload
        self._kind = kind
        self.attempt = attempt
        self._event.set()

    def _cancel(self, error: BaseException) -> None:
        """Cancelled with ``error`` (its coordinator closed), unless already final."""
        if self._event.is_set():
            return
        self._status = RemoteValueStatus.CANCELLED
        self._value, self._loaded = error, True
        self._event.set()

    def _load(self) -> Any:
        if not self._loaded:
            if self._status is RemoteValueStatus.READY:
                self._value = pickle.loads(self._payload)
            elif self._status is RemoteValueStatus.FAILED:
                self._value = load_error(self._payload, self._kind)
            else:
                self._value = CancelledError(
                    f"closure {self._cid} was cancelled after an earlier closure's error"
                )
            self._payload = None
            self._loaded = True
        return self._value

    def _read(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader(self._cid)

    def fetch(self, timeout: float | None = None) -> Any:
        """Wait for the closure; return its value or raise its error."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"closure {self._cid} did not finish within {timeout} s")
        value = self._load()
        self._read()
        if self._status is not RemoteValueStatus.READY:
            raise value
        return value

    def done(self) -> bool:
        """Whether the closure reached a final state (non-blocking)."""
        return self._event.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the closure; its error, or ``None`` if it succeeded."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"closure {self._cid} did not finish within {timeout} s")
        self._read()
        if self._status is RemoteValueStatus.READY:
            return None
        return self._load()

    @property
    def status(self) -> RemoteValueStatus:
        """PENDING, RUNNING, READY, FAILED or CANCELLED (RUNNING is asked of the scheduler)."""
        if not self._event.is_set() and self._coordinator is not None:
            state = self._coordinator._closure_state(self._cid)
            if state == protocol.RUNNING and not self._event.is_set():
                return RemoteValueStatus.RUNNING
        return self._status

    def __reduce__(self):
        raise TypeError(
            "a RemoteValue cannot be passed to a closure or pickled; "
            "fetch() it on the client and pass the value instead"
        )

    def __repr__(self) -> str:
        return f"<RemoteValue {self._cid} {self._status.value}>"

    def _repr_html_(self) -> str:
        """Its state (not asking the scheduler), attempt, and a short form of the value."""
        color = {protocol.READY: "green", protocol.FAILED: "red",
                 protocol.CANCELLED: "gray"}.get(
            self._status.value, "orange")
        extra = f" · attempt {self.attempt}" if self.attempt else ""
        if self._event.is_set():
            try:
                text = repr(self._load())
            except Exception as e:  # a value that cannot be loaded here
                text = f"<unloadable: {e!r}>"
            extra += f" · <code>{html.escape(text[:200])}</code>"
        return (f"<b>RemoteValue</b> <code>{html.escape(self._cid)}</code> "
                f"<span style='color:{color}'>{self._status.value}</span>{extra}")


class PerWorkerValues:
    """One component per worker (TensorFlow's ``PerWorkerValues``).

    Either a reference to a per-worker resource (``rid``: each worker resolves it to its
    own component when the object is a closure argument), or, on the client, the
    per-worker results of a gang closure (``values``: a tuple in rank order).
    """

    __slots__ = ("rid", "kind", "values")

    def __init__(self, rid: str | None = None, kind: str = "resource",
                 values: tuple | None = None):
        if (rid is None) == (values is None):
            raise ValueError("PerWorkerValues needs exactly one of rid= or values=")
        self.rid = rid
        self.kind = kind
        self.values = None if values is None else tuple(values)

    def __next__(self):
        raise TypeError(
            "PerWorkerValues hold one component per worker and can only be used as a "
            "closure argument: pass them to Coordinator.schedule()"
        )

    def __iter__(self):
        if self.values is None:
            raise TypeError(
                "a per-worker resource has no client-side components; pass it to "
                "Coordinator.schedule() and each worker uses its own"
            )
        return iter(self.values)

    def __len__(self) -> int:
        if self.values is None:
            raise TypeError("a per-worker resource has no client-side length")
        return len(self.values)

    def __getitem__(self, i: int):
        if self.values is None:
            raise TypeError("a per-worker resource has no client-side components")
        return self.values[i]

    def __reduce__(self):
        """A closure argument travels as a :class:`~daskdist.core.protocol.ResourceRef`,
        which each worker resolves to its own component."""
        if self.values is not None:
            raise TypeError("client-side PerWorkerValues of RemoteValues cannot be pickled")
        return (protocol.ResourceRef, (self.rid, self.kind))

    def __repr__(self) -> str:
        if self.values is not None:
            return f"PerWorkerValues({list(self.values)!r})"
        return f"PerWorkerValues({self.kind} {self.rid})"


class ResourceHandle(PerWorkerValues):
    """The client's reference to a registered per-worker resource: when it is garbage
    collected, the resource is released on the scheduler and the workers (once every
    closure scheduled before has finished). Travels as a plain ``PerWorkerValues``."""

    __slots__ = ("__weakref__", "parent")

    def __init__(self, rid: str, kind: str, parent: PerWorkerValues | None = None):
        super().__init__(rid=rid, kind=kind)
        self.parent = parent  # an iterator keeps its dataset alive


def _dataset_read(args: Any, kwargs: Any) -> str:
    """The dataset whose per-worker iterator is one of a closure's arguments (its
    ``Submission.dataset``: at the epoch's tail the scheduler sends the closure to a
    worker still holding that dataset's rows); ``""`` for none."""
    for value in (*args, *(kwargs or {}).values()):
        parent = value.parent if isinstance(value, ResourceHandle) else None
        if parent is not None and value.kind == "iterator":
            return parent.rid
    return ""


class GangValues(PerWorkerValues):
    """The per-rank ``RemoteValue``s of a gang closure (``schedule_on_all``).

    Once the gang is done they are those of the ranks of the generation that completed
    it, in rank order (a member that left is not an error).
    """

    __slots__ = ("whole", "final")

    def __init__(self, whole: RemoteValue):
        super().__init__(values=())
        self.whole = whole
        self.final = False


class ClosureClient:
    """The closure half of ``Coordinator``: ``schedule``, ``join``, ``done``, ``fetch``,
    the flusher and the results loop that run them, and the release of dropped
    per-worker resources (which waits on the oldest unfinished closure).

    ``_init_closures`` sets its own state; the class using it sets ``client``, ``name``,
    ``_rpc`` (the scheduler's RPC), ``_owner``, ``_token`` and ``_workers`` (the member
    count, renewed by each batch of results), and ``_owned`` (a call acting as this
    owner, used only once an error is pending), then starts ``_results_loop``; and
    ``_reader``, what each ``RemoteValue`` it makes calls when read (``None``: nothing).
    """

    client: Client
    name: str
    _rpc: Any
    _owner: str
    _token: str
    _workers: int
    _owned: Callable[..., Any]

    def _init_closures(self, max_queued: int | None) -> None:
        """The closure state, and the bound on unfinished closures: ``max_queued``, or
        the ``daskdist.coordinator`` settings read once here (not per ``schedule``)."""
        if max_queued is not None:
            checks.integer(max_queued, "max_queued", 1, 2**62)
            self._per_worker_queued = self._min_queued = 0
        else:
            self._per_worker_queued = int(config.get("coordinator.max-queued-per-worker"))
            self._min_queued = int(config.get("coordinator.min-max-queued"))
        self._max_queued = max_queued
        self._seq = itertools.count()
        self._reader: Callable[[str], None] | None = None  # a keep-alive owner's receipts
        self._cv = threading.Condition()
        self._pending: dict[str, RemoteValue] = {}
        # gang cid -> its per-rank values; written by the caller and the result loop,
        # always under self._cv
        self._gangs: dict[str, GangValues] = {}
        self._outgoing: deque[Submission] = deque()
        self._flushing = False
        self._error_pending = False
        self._closed = False
        # (watermark, rid) of per-worker resources whose handle was garbage collected:
        # released once no closure scheduled before the watermark is unfinished
        self._released: deque[tuple[int, str]] = deque()

    def _check_open(self) -> None:
        if self._closed:
            raise CoordinatorClosedError(f"coordinator {self.name!r} is closed")

    def _limit(self) -> int:
        if self._max_queued is not None:
            return self._max_queued
        return max(self._min_queued, self._per_worker_queued * self._workers)

    # -- public API ---------------------------------------------------------------------------
    def schedule(
        self,
        fn: Callable,
        args: tuple | list = (),
        kwargs: dict | None = None,
        *,
        retries: int = 0,
    ) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns at once.

        Raises the first unraised error of an earlier closure (after cancelling what
        is queued), ``TypeError`` for a bad ``fn`` or argument; blocks while the
        queue holds ``max_queued`` unfinished closures. Raises
        ``dd.CoordinatorClosedError`` once closed.
        """
        self._check_open()
        if self._error_pending:
            self._raise_pending()
        payload = self._pickle(fn, args, kwargs, retries)
        cid = f"{self._owner}-{next(self._seq)}"
        rv = RemoteValue(cid, self, self._reader)
        while True:
            with self._cv:
                while (len(self._pending) >= self._limit() and not self._error_pending
                       and not self._closed):
                    self._cv.wait(0.5)
                self._check_open()
                if not self._error_pending:
                    self._pending[cid] = rv
                    self._outgoing.append(Submission(cid, payload, retries,
                                                     _dataset_read(args, kwargs)))
                    start, self._flushing = not self._flushing, True
                    break
            self._raise_pending()  # an error arrived while we waited for room
        if start:
            self.client.loop.add_callback(self._flush)
        return rv

    @staticmethod
    def _pickle(fn: Callable, args: Any, kwargs: Any, retries: int) -> list:
        """The closure's payload: ``[function bytes, argument bytes or None]``.

        Functions are pickled through Dask's cache (as ``client.submit`` does), so a
        loop scheduling the same function pickles it once.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
        if not isinstance(retries, int) or retries < 0:
            raise TypeError(f"retries must be a non-negative int, got {retries!r}")
        what = getattr(fn, "__name__", repr(fn))
        try:
            fn_bytes = dumps_function(fn)
        except Exception as e:
            raise TypeError(f"closure {what!r} cannot be pickled: {e}") from e
        if not args and not kwargs:
            return [fn_bytes, None]
        try:
            return [fn_bytes, cloudpickle.dumps((tuple(args), kwargs or {}))]
        except Exception as e:
            if isinstance(e, TypeError) and "RemoteValue" in str(e):
                raise TypeError(str(e)) from None
            raise TypeError(f"the arguments of closure {what!r} cannot be pickled: {e}") from e

    def join(self, timeout: float | None = None, progress: bool = False) -> None:
        """Block until every closure scheduled here finished; raise the first error.

        ``progress=True`` shows a ``tqdm.auto`` bar of the closures finishing meanwhile.
        Raises ``dd.CoordinatorClosedError`` once closed (also when ``close()`` ends it
        while it waits)."""
        self._check_open()
        if progress:  # the bar until none is left (or an error, or the time is up)
            return self.join(reprs.join_with_bar(self.name, self._unfinished, timeout))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_open()
            if self._error_pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._raise_pending(left)
                continue
            with self._cv:
                if not self._pending:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"join: {len(self._pending)} closures still unfinished after {timeout} s"
                    )
                self._cv.wait(left if left is not None else 1.0)

    def done(self) -> bool:
        """Whether every closure scheduled here finished (raises the first error, or
        ``dd.CoordinatorClosedError`` once closed)."""
        self._check_open()
        if self._error_pending:
            self._raise_pending()
        with self._cv:
            return not self._pending

    def fetch(self, structure: Any) -> Any:
        """Replace every RemoteValue inside nested lists, tuples and dicts by its value.

        Once closed it never waits: a closure that had not finished raises
        ``dd.CoordinatorClosedError`` (a ``dd.CancelledError``)."""
        def one(v):
            if isinstance(v, RemoteValue):
                return v.fetch()
            if isinstance(v, GangValues):
                # done: the values are the completing generation's; a gang that failed
                # before any group formed has none, so its own value raises the error
                if v.whole.exception() is not None and not v.values:
                    v.whole.fetch()
            if isinstance(v, PerWorkerValues) and v.values is not None:
                return [one(x) for x in v.values]
            return v

        return map_structure(one, structure)

    # -- the client loop: sending closures, receiving outcomes ----------------------------
    async def _flush(self) -> None:
        """Send queued puts in batches (runs on the client's event loop)."""
        while True:
            with self._cv:
                if not self._outgoing:
                    self._flushing = False
                    return
                n = min(len(self._outgoing), checks.MAX_ITEMS)
                batch = [self._outgoing.popleft() for _ in range(n)]
            try:
                # one-way: no reply to wait for, so the scheduler dispatches sooner
                await self._rpc.daskdist_put(name=self.name, owner=self._owner,
                                             token=self._token, closures=batch, reply=False)
            except Exception as e:  # the scheduler is unreachable: these closures fail
                err = RuntimeError(f"could not send closures to the scheduler: {e!r}")
                payload = dump_error(err)
                for sub in batch:
                    self._resolve(Outcome(sub.cid, FAILED, payload, USER_ERROR))

    async def _results_loop(self) -> None:
        """Receive outcomes in batches until closed (runs on the client's event loop).

        The scheduler answers only when there is something to say (or after its poll
        interval), so an idle client, even one with an error unread, costs no CPU."""
        ack = 0
        while not self._closed:
            try:
                reply = await self._rpc.daskdist_results(
                    name=self.name, owner=self._owner, token=self._token, ack=ack
                )
            except Exception as e:
                if self._closed or self.client.status in ("closing", "closed"):
                    return  # shutting down: whatever the comm says, nothing more comes
                if isinstance(e, (OSError, CommClosedError)):
                    await asyncio.sleep(0.1)
                    continue
                if not isinstance(e, (KeyError, PermissionError)):
                    raise
                reply = {"detached": True}  # the scheduler no longer knows this owner
            if reply is None or reply.get("detached"):
                self._cancel_all("the scheduler dropped it (its client was cut off longer "
                                 "than daskdist.coordinator.client-grace, another client "
                                 "attached to it, or the scheduler restarted)")
                return
            first = reply["first"]
            items = reply["items"]
            for i, item in enumerate(items):
                if first + i >= ack:
                    self._resolve(Outcome._make(item))
            ack = max(ack, first + len(items))
            with self._cv:
                self._error_pending = self._error_pending or reply["error"]
                self._workers = reply["workers"]
                self._cv.notify_all()
            if self._released:
                await self._release_resources()

    def _resolve(self, item: Outcome) -> None:
        cid, state, payload, kind, attempt = item[:5]
        with self._cv:
            rv = self._pending.pop(cid, None)
            if rv is not None and state == FAILED:
                self._error_pending = True
            view = self._gangs.pop(cid, None)
            if view is not None:  # per-rank values first: whoever waits on the gang sees them
                self._spread_gang(view, state, payload, kind, attempt)
            if rv is not None:  # final under the lock: close() returns with every value final
                rv._set(state, payload, kind, attempt)
            self._cv.notify_all()

    @staticmethod
    def _spread_gang(view: GangValues, state: str, payload: Any, kind: str | None,
                     attempt: int) -> None:
        """A gang's outcome (the per-rank results of the generation that completed it)
        to its per-rank values; the view's length becomes that generation's size.
        Called with ``self._cv`` held."""
        gid = view.whole._cid
        old = list(view.values)
        if state != READY:
            for rv in old:
                rv._set(state, payload, kind, attempt)
            view.final = True
            return
        members = old[: len(payload)]
        members += [RemoteValue(f"{gid}#{r}", None, view.whole._reader)
                    for r in range(len(members), len(payload))]
        for rv, value in zip(members, payload, strict=True):
            rv._set(state, value, None, attempt)
        for rv in old[len(payload):]:  # ranks of a member that left: not an error
            rv._set(CANCELLED, None, None, attempt)
        view.values = tuple(members)
        view.final = True

    def _raise_pending(self, timeout: float | None = None) -> None:
        """Raise the first unraised error, cancelling what is still queued (TF semantics)."""
        reply = self._owned("daskdist_raise", timeout=timeout)
        if reply.get("timeout"):
            raise TimeoutError(f"in-flight closures did not finish within {timeout} s")
        for owner, cid in reply["cancelled"]:
            if owner == self._owner:
                self._resolve(Outcome(cid, CANCELLED))
        with self._cv:
            self._error_pending = False
        if reply["error"] is not None:
            _cid, payload, kind = reply["error"]
            raise load_error(payload, kind)

    def _cancel_all(self, why: str) -> None:
        """This Coordinator is closed: every closure not yet final is cancelled, saying
        ``why``; waiters wake up."""
        with self._cv:  # under the lock: whichever thread cancels, all are final after
            self._closed = True
            pending, self._pending = self._pending, {}
            gangs, self._gangs = self._gangs, {}
            self._outgoing.clear()
            for cid, rv in pending.items():
                rv._cancel(CoordinatorClosedError(
                    f"closure {cid} did not finish: coordinator {self.name!r} closed ({why})"))
            for gid, view in gangs.items():
                for rv in view.values or ():
                    rv._cancel(CoordinatorClosedError(
                        f"gang {gid} did not finish: coordinator {self.name!r} closed ({why})"))
            self._cv.notify_all()

    def _unfinished(self, wait: float) -> tuple[int, bool]:
        """How many closures are unfinished and whether an error is pending, after
        waiting up to ``wait`` seconds for the next batch of results while some are."""
        with self._cv:
            if self._pending and not self._error_pending and wait > 0:
                self._cv.wait(wait)  # woken by every batch of results
            return len(self._pending), self._error_pending

    def _resource_dropped(self, rid: str) -> None:
        """A resource handle was garbage collected (any thread; must not block)."""
        self._released.append((next(self._seq), rid))

    async def _release_resources(self) -> None:
        """Release dropped resources that no unfinished closure can still use (client loop)."""
        with self._cv:
            oldest = min((_seq_of(cid) for cid in self._pending), default=None)
        rids = []
        while self._released and (oldest is None or self._released[0][0] < oldest):
            rids.append(self._released.popleft()[1])
        if rids:
            try:
                await self._rpc.daskdist_release_resources(
                    name=self.name, owner=self._owner, token=self._token, rids=rids,
                    reply=False)
            except Exception:  # the scheduler is gone: so are its resources
                pass

    def _release_now(self) -> None:
        """Release dropped resources without waiting for the next results (tests)."""
        self.client.sync(self._release_resources)


def _seq_of(cid: str) -> int:
    """The schedule order of a closure (``owner-12``) or gang (``owner-g12``) id."""
    return int(cid.rpartition("-")[2].lstrip("g"))



"""What a closure runs with: its contexts (what it and a per-worker factory know about
where they run), the session's per-worker resources (:class:`ResourceRegistry`), its
scope (:class:`ClosureScope`) and the lease tokens it consumed."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import InitVar, dataclass, field
from typing import Any

from daskdist.core.nest import map_structure
from daskdist.core.protocol import ResourceRef, ResourceSpec
from daskdist.errors import InputError

logger = logging.getLogger(__name__)

_local = threading.local()  # what a per-worker resource being built mints States after
# The closure a thread runs, as a context variable: a thread the closure starts in its
# context (``threading.Thread(target=contextvars.copy_context().run, args=(fn,))``)
# belongs to the closure too, so the rows it takes count for it.
_current: contextvars.ContextVar[ClosureScope | None] = contextvars.ContextVar(
    "daskdist_closure_scope", default=None)


@dataclass(frozen=True)
class WorkerContext:
    """The worker a closure runs on, as seen by that closure (SPEC §2.2)."""

    worker_index: int
    num_workers: int
    device: Any  # torch.device; typed loosely so this module needs no torch import
    address: str
    attempt: int = 1
    name: str = "default"


@dataclass
class InputContext:
    """What a per-worker dataset factory receives (TensorFlow's ``tf.distribute.InputContext``).

    ``num_input_pipelines`` pipelines in all (one per worker), this one is
    ``input_pipeline_id``; ``num_replicas_in_sync`` replicas consume the global batch.
    ``worker`` is the worker's :class:`WorkerContext` when built by a worker plugin.
    ``services`` are the scheduler services of the worker session the dataset is built
    for (the ``"dynamic"`` policy's leases, among them: set by the worker plugin), or a
    :class:`~daskdist.data.LocalLeaseService` outside a coordinator, or ``None``.
    ``leases=`` is its former, deprecated name.
    ``dataset_id`` is the identity of the per-worker dataset being built (the call that
    made it, the same on every worker; ``None`` outside a coordinator): loaders take
    theirs from it (:meth:`next_dataset_id`).
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1
    worker: WorkerContext | None = None
    services: Any = None
    extra: dict = field(default_factory=dict)
    dataset_id: str | None = None
    _loaders: int = field(default=0, repr=False, compare=False)
    leases: InitVar[Any] = None  # deprecated: services=

    def __post_init__(self, leases: Any = None) -> None:
        if leases is not None and leases is not self.services:  # (replace() passes both)
            warnings.warn("InputContext(leases=...) is deprecated; pass services=...",
                          DeprecationWarning, stacklevel=3)
            if self.services is None:
                self.services = leases
        if self.num_input_pipelines < 1:
            raise ValueError(f"num_input_pipelines must be >= 1, got {self.num_input_pipelines}")
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id {self.input_pipeline_id} is outside "
                f"[0, {self.num_input_pipelines})"
            )
        if self.num_replicas_in_sync < 1:
            raise ValueError(f"num_replicas_in_sync must be >= 1, got {self.num_replicas_in_sync}")

    @property
    def device(self) -> Any:
        """The worker's device (``torch.device``), CPU outside a worker."""
        if self.worker is not None:
            return self.worker.device
        import torch

        return torch.device("cpu")

    def next_dataset_id(self) -> str | None:
        """The dataset id of the next loader built with this context: ``dataset_id`` for
        the first, ``"<dataset_id>.<k>"`` for the k-th after it (a factory that builds
        a training and an evaluation loader gets two datasets); ``None`` outside a
        coordinator."""
        if self.dataset_id is None:
            return None
        k, self._loaders = self._loaders, self._loaders + 1
        return self.dataset_id if k == 0 else f"{self.dataset_id}.{k}"

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Split a global batch evenly over the replicas (TensorFlow's rule: it must divide)."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by "
                f"num_replicas_in_sync {self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync


def _deprecated_leases(self: InputContext) -> Any:
    """``ctx.leases``: the former name of :attr:`InputContext.services` (deprecated; read
    without a warning, since ``dataclasses.replace`` reads it too)."""
    return self.services


InputContext.leases = property(_deprecated_leases)  # type: ignore[assignment]


def get_worker_context() -> WorkerContext:
    """The context of the closure running in this thread; ``RuntimeError`` outside one."""
    scope = _current.get()
    if scope is None or scope.context is None:
        raise RuntimeError("get_worker_context() must be called inside a daskdist closure")
    return scope.context


@dataclass
class ClosureScope:
    """What the closure running in a thread is bound to (TensorFlow's
    ``coordinator_context``): its context, the scheduler services of the worker session
    it was dispatched under, and the lease tokens it consumed.

    The worker runner enters one per closure (:func:`closure_scope`); data and collective
    code reach the services through :func:`session_services`, never through the worker
    plugin, so a closure of an ended session can only make calls the scheduler refuses.
    Threads the closure starts in its context share the scope (``tokens`` under
    ``lock``); once the closure ended (:meth:`end`) the scope takes no more tokens.
    """

    context: WorkerContext | None = None
    services: Any = None  # plugins.worker.services.SessionServices (duck-typed here)
    tokens: list = field(default_factory=list)
    aside: list = field(default_factory=list)  # taken out of ``tokens``, still its own
    # what rides the next gradient allreduce of the closure (collective.riders), by key
    riders: dict = field(default_factory=dict)
    # messages for the worker's event loop sent when the closure's synced loop next
    # is asked for a batch (collective.later); None while no such loop runs
    later: list | None = None
    origin: str = ""  # what States made here are named after (see mint_state_id)
    minted: int = 0  # States made here so far
    ended: bool = False  # the closure returned: its tokens went with its result
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def end(self) -> list:
        """The closure ended: its tokens (sent with its result); later ones are refused."""
        with self.lock:
            self.ended = True
            out, self.tokens = list(self.tokens), []
        return out

    def send_queued(self) -> None:
        """Send the messages queued for the synced loop's next batch (``later``): the
        loop hands one out, or ends, or the closure does."""
        if not self.later:  # the common case, every step: nothing queued, no lock
            return
        with self.lock:
            if not self.later:
                return
            queued, self.later[:] = list(self.later), []
        for message in queued:
            message.send()

    def end_aside(self) -> list:
        """The tokens still set aside when the closure ended: batches fetched ahead and
        never trained (the runner gives their rows back)."""
        with self.lock:
            out, self.aside = list(self.aside), []
        return out


def origin_of(cid: str) -> str:
    """What a closure's :attr:`ClosureScope.origin` is: the gang a member closure belongs
    to (the same on every rank and attempt: a member's id is
    ``<gang>@<generation>#<rank>``, see ``core.gang.member_cid``); any other closure's
    own id."""
    return cid.split("@", 1)[0]


class ClosureEndedError(RuntimeError):
    """A thread the closure started consumed rows after the closure returned: no closure
    can acknowledge them any more."""


@contextlib.contextmanager
def closure_scope(scope: ClosureScope) -> Iterator[ClosureScope]:
    """Bind ``scope`` to this thread's context while the block runs (the runner, and
    tests); threads started in a copy of that context share it."""
    token = _current.set(scope)
    try:
        yield scope
    finally:
        _current.reset(token)


def _scope() -> ClosureScope | None:
    return _current.get()


def closure_scope_now() -> ClosureScope | None:
    """The scope of the closure running in this thread (``None`` outside one)."""
    return _scope()


def closure_riders() -> dict | None:
    """The riders registered in this thread's closure (``collective.riders``: owned by
    the closure's thread, which registers and takes them); ``None`` outside a closure."""
    scope = _scope()
    return None if scope is None else scope.riders


@contextlib.contextmanager
def minting(origin: str) -> Iterator[None]:
    """States made in this thread while the block runs are named after ``origin`` (the
    worker's resource registry, while it builds per-worker resource ``origin``)."""
    prev = getattr(_local, "mint", None)
    _local.mint = [origin, 0]
    try:
        yield
    finally:
        _local.mint = prev


def mint_state_id() -> str:
    """An id for a new elastic ``State``, the same on every rank and on a replacement
    worker: the per-worker resource being built, or else the gang closure running (its
    id without the attempt: every rank runs the same one), and how many States it made
    before this one. Outside both, a local id (no scheduler ever sees it)."""
    mint = getattr(_local, "mint", None)
    if mint is not None:
        origin, n = mint
        mint[1] += 1
        return f"{origin}/{n}"
    scope = _scope()
    if scope is not None and scope.origin:
        scope.minted += 1
        return f"{scope.origin}/{scope.minted - 1}"
    return f"local-{uuid.uuid4().hex}"


# Per-worker resources as built on this worker -> their resource id (the call that made
# them, the same on every worker and replacement), so code handed the object (a
# framework integration given the user's module) can name State ids after it.
_resource_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def note_resource(obj: Any, rid: str) -> None:
    """Record that ``obj`` is per-worker resource ``rid`` (the worker's resource registry,
    once built); objects that cannot be weakly referenced or hashed are not recorded."""
    try:
        _resource_ids[obj] = rid
    except TypeError:
        pass


def resource_id(obj: Any) -> str | None:
    """The id of the per-worker resource ``obj`` is on this worker, or ``None``."""
    try:
        return _resource_ids.get(obj)
    except TypeError:
        return None


class ResourceRegistry:
    """One worker session's per-worker resources, built on first use.

    A resource (a replica, a dataset, an iterator over a dataset) is built from the
    factory its client registered (a :class:`~daskdist.core.protocol.ResourceSpec`,
    fetched from the scheduler) the first time a closure of the session needs it, with
    the session's contexts: a dataset's :class:`InputContext` carries the session's
    services, so a loader can only lease rows for the session that built it, and the
    dataset's identity (its resource id: the call that made it). When the session ends,
    :meth:`close` closes every resource that has a ``close()`` (loaders and their
    iterators: their prefetch threads and open files go). Any closure thread may call
    :meth:`get`; a resource is built once (a lock per rid).
    """

    def __init__(self, fetch_spec: Callable[[str], bytes | None],
                 contexts: Callable[[str], tuple[WorkerContext, InputContext]]):
        self._fetch_spec = fetch_spec
        self._contexts = contexts
        self._objects: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self._closed = False

    def get(self, rid: str) -> Any:
        try:
            return self._objects[rid]
        except KeyError:
            pass
        with self._lock:
            if self._closed:
                raise InputError(f"per-worker resource {rid}: its worker session ended")
            lock = self._building.setdefault(rid, threading.Lock())
        with lock:
            if rid not in self._objects:
                obj = self._build(rid)
                with self._lock:
                    if self._closed:  # the session ended while this was built
                        _close(rid, obj)
                        raise InputError(f"per-worker resource {rid}: its worker session "
                                         "ended")
                    self._objects[rid] = obj
                note_resource(obj, rid)  # integrations name their States after it
            return self._objects[rid]

    def _build(self, rid: str) -> Any:
        # distributed's unpickler, imported here: ``import daskdist`` (this module)
        # loads no Dask, and only a worker builds resources
        from distributed.protocol.pickle import loads

        payload = self._fetch_spec(rid)
        if payload is None:
            raise InputError(f"per-worker resource {rid} is not registered with the coordinator")
        spec = ResourceSpec._make(loads(payload))
        worker_ctx, input_ctx = self._contexts(rid)
        try:
            if spec.kind == "iterator":
                return (spec.factory or iter)(self.get(spec.parent))
            with minting(rid):  # elastic States it makes are named alike on every worker
                return spec.factory(input_ctx if spec.kind == "dataset" else worker_ctx)
        except InputError:
            raise
        except Exception as e:
            raise InputError(
                f"per-worker {spec.kind} {rid} could not be built on worker "
                f"{worker_ctx.address}: {type(e).__name__}: {e}", e
            ) from e

    def resolve(self, structure: Any) -> Any:
        """Replace every per-worker reference in ``structure`` by this worker's component."""
        def is_ref(v: Any) -> bool:
            return isinstance(v, ResourceRef)

        return map_structure(lambda v: self.get(v.rid) if is_ref(v) else v, structure, is_ref)

    def drop(self, rids: list[str]) -> None:
        """Forget released resources (the client dropped them after every closure that
        could use them had finished) and close them in a thread of their own: called on
        the event loop, and closing a loader may wait for its producer's lease RPC, or
        make one (giving back leased rows), both of which need that loop."""
        with self._lock:
            gone = [(rid, self._objects.pop(rid)) for rid in rids if rid in self._objects]
            for rid in rids:
                self._building.pop(rid, None)
        if gone:
            threading.Thread(target=_close_all, args=(gone,), daemon=True,
                             name="daskdist-close-dropped").start()

    def close(self) -> None:
        """The session ended: close every resource (iterators before their datasets) and
        build no more. Blocks while a producer thread finishes its read: call it off the
        event loop."""
        with self._lock:
            self._closed = True
            objects, self._objects = self._objects, {}
            self._building.clear()
        for rid, obj in reversed(list(objects.items())):  # built after their parents
            _close(rid, obj)

    def __len__(self) -> int:
        return len(self._objects)


def _close_all(objects: list[tuple[str, Any]]) -> None:
    for rid, obj in reversed(objects):  # iterators before their datasets
        _close(rid, obj)


def _close(rid: str, obj: Any) -> None:
    close = getattr(obj, "close", None)
    if not callable(close):
        return
    try:
        close()
    except Exception as e:  # noqa: BLE001 - a user's resource: say so and go on
        logger.warning("daskdist: closing per-worker resource %s failed: %r", rid, e)


def session_services() -> Any:
    """The scheduler services of the running closure's session (lease release, commit
    parts, commit outcomes); ``RuntimeError`` outside a closure run by a worker plugin."""
    scope = _scope()
    if scope is None or scope.services is None:
        raise RuntimeError("no daskdist session: call this inside a closure on a worker")
    return scope.services


def record_consumed(token: Any) -> bool:
    """Record that the closure running in this thread consumed ``token`` (e.g. leased rows).

    The worker plugin sends every recorded token with the closure's result, in one
    message, so the scheduler acknowledges them only if the closure completes. Returns
    ``False`` (recording nothing) in a thread that runs no closure, and raises
    :class:`ClosureEndedError` in a thread the closure started once the closure ended:
    the caller gives such rows back (no closure could acknowledge them).
    """
    scope = _scope()
    if scope is None:
        return False
    with scope.lock:
        if scope.ended:
            raise ClosureEndedError(
                f"thread {threading.current_thread().name!r} consumed rows after the "
                f"closure it was started in ended")
        scope.tokens.append(token)
    return True


def consumed_mark() -> int:
    """How many tokens the closure in this thread has recorded so far (0 outside one)."""
    scope = _scope()
    if scope is None:
        return 0
    with scope.lock:
        return len(scope.tokens)


def take_consumed(since: int = 0) -> list:
    """Remove and return the tokens recorded in this thread from position ``since`` on.

    Elastic state takes them at ``commit()`` (the commit acknowledges them instead of
    the closure's end) and ``synced`` takes a batch it gives back. ``[]`` outside a
    closure.
    """
    return _take(since, aside=False)


def set_aside(since: int) -> list:
    """Take the tokens recorded from position ``since`` on out of the closure's list (a
    commit does not acknowledge them) and keep them as its own, set aside: a batch a
    framework fetched ahead, its rows trained later (:func:`take_back`) or given back
    (:func:`drop_aside`). ``[]`` outside a closure."""
    return _take(since, aside=True)


def _take(since: int, aside: bool) -> list:
    scope = _scope()
    if scope is None:
        return []
    with scope.lock:
        out = scope.tokens[since:]
        del scope.tokens[since:]
        if aside:
            scope.aside.extend(out)
    return out


def take_back(tokens: list) -> None:
    """Tokens set aside (the same objects) are recorded as consumed again, now: their
    batch begins training, so the next commit acknowledges them."""
    _unset(tokens)
    for t in tokens:
        record_consumed(t)


def drop_aside(tokens: list) -> None:
    """Tokens set aside (the same objects) are no longer the closure's: the caller gives
    their rows back."""
    _unset(tokens)


def _unset(tokens: list) -> None:
    scope = _scope()
    if scope is None or not tokens:
        return
    ids = {id(t) for t in tokens}
    with scope.lock:
        scope.aside[:] = [t for t in scope.aside if id(t) not in ids]


def held_tokens() -> list:
    """Every token the closure in this thread holds, recorded or set aside (rows it
    consumed and has not committed); ``[]`` outside one."""
    scope = _scope()
    if scope is None:
        return []
    with scope.lock:
        return scope.tokens + scope.aside


def consumed_since(mark: int) -> list:
    """The tokens recorded in this thread's closure from position ``mark`` on, left
    where they are (a batch's own, for :func:`take_tokens` later); ``[]`` outside one."""
    scope = _scope()
    if scope is None:
        return []
    with scope.lock:
        return scope.tokens[mark:]


def put_aside(tokens: list) -> None:
    """Those of ``tokens`` (the same objects) the closure in this thread still holds are
    set aside: no commit acknowledges them, and the closure's end gives their rows back
    (a batch never trained when the group broke: the closure is ending)."""
    scope = _scope()
    if scope is None or not tokens:
        return
    ids = {id(t) for t in tokens}
    with scope.lock:
        scope.aside.extend(t for t in scope.tokens if id(t) in ids)
        scope.tokens[:] = [t for t in scope.tokens if id(t) not in ids]


def take_tokens(tokens: list) -> list:
    """Remove and return those of ``tokens`` (the same objects) that the closure running
    in this thread still holds.

    How a batch taken but never trained is given back: by identity, never by position
    (others take tokens out and record them again meanwhile, e.g. a framework's
    fetch-ahead, and a generator's ``finally`` may run late, in another closure's
    thread, when the garbage collector finalizes it: there it finds nothing of its own).
    """
    scope = _scope()
    if scope is None or not tokens:
        return []
    ids = {id(t) for t in tokens}
    with scope.lock:
        out = [t for t in scope.tokens if id(t) in ids]
        if out:
            scope.tokens[:] = [t for t in scope.tokens if id(t) not in ids]
    return out


# Membership as this worker last heard it from the scheduler plugin, per worker *session*
# (one registration of one coordinator's plugin on this worker): a coordinator's
# counters are its own, so a new coordinator of the same name on the same workers (or a
# session registered anew after fencing) starts from the scheduler's count, never from
# an older coordinator's. The worker plugin updates it and forgets a session when it
# ends; collective code (elastic State.commit) reads the entry of its closure's session.
# ``(version, joins)``: ``version`` grows on every join, leave or retirement, ``joins``
# on joins only (a change without a join is "members only left": Horovod's skip_sync).
_membership: dict[str, tuple[int, int]] = {}


def _session_key(session: str | None = None) -> str:
    """``session``, else the session of the closure running in this thread ("" outside
    one: a group used without a coordinator)."""
    if session is not None:
        return session
    scope = _scope()
    services = scope.services if scope is not None else None
    return getattr(services, "session", "") or ""


def membership_version(session: str | None = None) -> int:
    """A counter the scheduler plugin bumps whenever a worker joins or leaves the
    coordinator of worker session ``session`` (default: the session of the closure
    running in this thread)."""
    return _membership.get(_session_key(session), (0, 0))[0]


def membership_joins(session: str | None = None) -> int:
    """How many workers ever joined that coordinator (the part of
    :func:`membership_version` that counts joins)."""
    return _membership.get(_session_key(session), (0, 0))[1]


def _set_membership(version: int, joins: int | None = None,
                    session: str | None = None) -> None:
    """Record the scheduler's counters for ``session``; they never go back (a late
    message with older counts changes nothing)."""
    key = _session_key(session)
    old_version, old_joins = _membership.get(key, (0, 0))
    _membership[key] = (max(old_version, int(version)),
                        old_joins if joins is None else max(old_joins, int(joins)))


def _forget_membership(session: str) -> None:
    """``session`` ended: its counters go (a worker lives through many sessions)."""
    _membership.pop(session, None)


# group generation -> the membership (version, joins) the scheduler formed it at;
# generations are unique across coordinators (the scheduler numbers them above any a
# worker has seen), so one table serves every session of this process
_formations: dict[int, tuple[int, int]] = {}


def formation_version(generation: int) -> int | None:
    """The membership version the scheduler formed ``generation`` at (``None``: unknown)."""
    counts = _formations.get(generation)
    return None if counts is None else counts[0]


def formation_joins(generation: int) -> int | None:
    """The joins count the scheduler formed ``generation`` at (``None``: unknown)."""
    counts = _formations.get(generation)
    return None if counts is None or counts[1] < 0 else counts[1]


def _set_formation_version(generation: int, version: int | None,
                           joins: int | None = None) -> None:
    if version is not None:
        _formations[int(generation)] = (int(version), -1 if joins is None else int(joins))
        for g in [g for g in _formations if g < generation - 8]:
            del _formations[g]

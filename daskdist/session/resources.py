"""One worker session's per-worker resources (:class:`ResourceRegistry`), built on first
use from the factories their clients registered, and the ids of the objects built."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from daskdist.core.nest import map_structure
from daskdist.core.protocol import ResourceRef, ResourceSpec
from daskdist.errors import InputError
from daskdist.session.scope import minting

if TYPE_CHECKING:
    from daskdist.context import InputContext, WorkerContext

logger = logging.getLogger(__name__)


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

    def rids(self) -> list[str]:
        """The resources built here now."""
        with self._lock:
            return list(self._objects)

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



"""Computing a Dask collection's partitions for a loader, and interrupting the waits.

- :class:`DaskComputer`: inside a coordinator, through the worker's own Dask client:
  the collection's own graph on Dask's scheduler (helpers preferred, under
  ``Coordinator(resources=...)``), a partition computed here read from this worker's
  memory, one computed elsewhere gathered; a persisted partition read in place.
- :class:`LocalComputer`: outside one, Dask's synchronous scheduler in a few threads of
  the loader's own (shut down with the loader's reader).
- :class:`Interrupt`: ends a reader's waits for Dask at once when its iterator closes.

Every wait here ends: the partition is there (computed, erred or cancelled), or the
interrupt. A partition whose data was lost after it finished is waited for on Dask's
own state until Dask has computed it again, never by polling.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from daskdist.observe import phases

__all__ = ["DaskComputer", "Interrupt", "Interrupted", "LocalComputer", "make_computer",
           "settled"]


class Interrupted(Exception):
    """A wait for a partition ended by :meth:`Interrupt.interrupt` (its iterator closed or
    was dropped): internal, the reader stops."""


class Interrupt:
    """Ends a reader's waits: each :meth:`wait` returns when what it waits for happened,
    or raises :class:`Interrupted` once :meth:`interrupt` was called (from any thread, at
    once; also from ``__del__``: it only sets events). So closing a loader never waits
    for a partition still computing (a slow or stuck graph)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: set[threading.Event] = set()
        self.interrupted = False

    def interrupt(self) -> None:
        with self._lock:
            self.interrupted = True
            for ev in self._waits:
                ev.set()

    @phases.partitions(phases.COMPUTING)  # a gang's data waits on Dask (SPEC §5.1)
    def wait(self, when: Callable[[Callable[[], None]], None]) -> None:
        """Until ``when`` calls the callback it is given (once what it watches is done)."""
        ev = threading.Event()
        with self._lock:
            if self.interrupted:
                raise Interrupted
            self._waits.add(ev)
        try:
            when(ev.set)
            ev.wait()  # ends: the callback ran, or interrupt()
        finally:
            with self._lock:
                self._waits.discard(ev)
        if self.interrupted:
            raise Interrupted

    def wait_future(self, future: Any) -> None:
        """Until a ``concurrent.futures`` future is done."""
        self.wait(lambda done: future.add_done_callback(lambda _: done()))


class Computed:
    """A partition asked of Dask: its future (or local future) until released, or its
    data read in place from this worker's memory (``future`` None)."""

    __slots__ = ("data", "future", "unit")

    def __init__(self, unit: int, future: Any, data: Any = None) -> None:
        self.unit = unit
        self.future = future
        self.data = data


_MISSING = object()


def settled(fut: Any, loop: Any) -> Callable[[Callable[[], None]], None]:
    """For :meth:`Interrupt.wait`: calls back once Dask has the distributed future ``fut``
    finished, erred or cancelled, awaiting the future's own state on its client's event
    ``loop``; a result lost after it finished (its worker died) clears that state until
    Dask has computed it again, so the wait goes on without polling. (A done callback
    would not do: Dask calls it at once for a lost future.)"""
    def when(done: Callable[[], None]) -> None:
        async def wait() -> None:
            try:
                await fut._state.wait()
            finally:
                done()

        asyncio.run_coroutine_threadsafe(wait(), loop.asyncio_loop)

    return when


async def _local(worker: Any, key: Any) -> Any:
    """A key's value in this worker's memory, or ``_MISSING`` (on its event loop)."""
    try:
        return worker.data[key] if key in worker.data else _MISSING
    except KeyError:
        return _MISSING


class DaskComputer:
    """Computes partitions on the cluster through the worker's own Dask client.

    ``helpers()`` names the workers preprocessing should prefer (non-members, when the
    coordinator's members are restricted by ``resources=``): a loose restriction, so
    Dask may still run a task elsewhere. Releasing the future lets Dask forget the
    partition (a persisted one keeps the user's keys)."""

    def __init__(self, worker: Any, helpers: Callable[[], list[str]] | None = None) -> None:
        self.worker = worker
        self.client = worker._get_client()
        self.helpers = helpers

    def submit(self, coll: Any, unit: int) -> Computed:
        if coll.direct is not None and coll.direct[unit]:
            # a persisted partition as it is: read in place if this worker holds it
            from distributed.utils import sync

            found = sync(self.worker.loop, _local, self.worker, coll.holders[unit])
            if found is not _MISSING:
                return Computed(unit, None, found)
        workers = self.helpers() if self.helpers is not None else None
        kw = {"workers": workers, "allow_other_workers": True} if workers else {}
        return Computed(unit, self.client.compute(coll.parts[unit], **kw))

    def result(self, c: Computed, interrupt: Interrupt) -> tuple[Any, bool]:
        """The partition's data (waits for Dask, or until ``interrupt``; the user's
        error if its graph raised), and whether it is the user's own object (persisted
        data read in place: its tensors get buffers of their own). A partition this
        loader computed is read in place when computed here."""
        from distributed.utils import sync

        if c.future is None:
            return c.data, True
        fut = c.future
        interrupt.wait(settled(fut, self.worker.loop))
        if fut.status == "finished":
            found = sync(self.worker.loop, _local, self.worker, fut.key)
            if found is not _MISSING:
                return found, False
        return fut.result(), False  # gathered (a lost one again waits for Dask)

    def release(self, c: Computed) -> None:
        if c.future is not None:
            c.future.release()
        c.data = None

    def close(self) -> None:
        """Nothing to close: the client is the worker's own."""


class LocalComputer:
    """Computes partitions in this process (a loader outside a coordinator): Dask's
    synchronous scheduler in ``threads`` threads of its own, shut down by :meth:`close`."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(max(1, threads), "daskdist-partition")

    def submit(self, coll: Any, unit: int) -> Computed:
        part = coll.parts[unit]
        return Computed(unit, self.pool.submit(part.compute, scheduler="sync"))

    def result(self, c: Computed, interrupt: Interrupt) -> tuple[Any, bool]:
        interrupt.wait_future(c.future)
        return c.future.result(), False

    def release(self, c: Computed) -> None:
        c.future.cancel()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def make_computer(services: Any, ahead: int) -> Any:
    """The computer for a loader: the worker's Dask client inside a coordinator (its
    lease service knows the worker), else local threads (the partition read next and
    those ``ahead``)."""
    worker = getattr(services, "worker", None)
    if worker is not None and hasattr(worker, "_get_client"):
        return DaskComputer(worker, getattr(services, "helpers", None))
    return LocalComputer(ahead + 1)

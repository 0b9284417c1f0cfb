"""The hand-off of converted blocks from a loader's prefetch thread to its consumers.

A :class:`Feed` runs a generator of chunks either in a background thread that fills a
bounded :class:`ChunkBuffer` (``prefetch > 0``), or inline in the consumer's thread
(``prefetch == 0``). Either way the consumer sees, per :meth:`Feed.get`, a chunk, then
:data:`END` (or a :class:`Failure` carrying the producer's exception), or
:data:`CLOSED` once the feed was stopped.

Threads and waits: the producer thread owns the generator (and everything it drives:
the reader, the lease RPCs, the device stage). It waits only in :meth:`ChunkBuffer.put`
while the buffer is full; that wait ends when a consumer takes a chunk or the buffer is
closed. A consumer waits only in :meth:`ChunkBuffer.get` while it is empty; that wait
ends when the producer puts a chunk or its end marker, or the buffer is closed. So
:meth:`Feed.signal` (close the buffer) ends every wait on both sides, from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["CLOSED", "END", "ChunkBuffer", "Failure", "Feed"]


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


END = _Marker("END")  # the generator is exhausted
CLOSED = _Marker("CLOSED")  # the feed was stopped; nothing more will come


class Failure:
    """The producer's exception, re-raised in the consumer that receives it."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class ChunkBuffer:
    """Bounded hand-off of converted chunks from the prefetch thread to consumers.

    The producer waits while the queued chunks hold ``max_rows`` rows or more (``prefetch``
    batches), so memory is bounded by that plus the chunk being built. Every wait also
    ends on :meth:`close`.
    """

    def __init__(self, max_rows: int) -> None:
        self._cv = threading.Condition()
        self._items: deque[tuple[Any, int]] = deque()
        self._rows = 0
        self._max_rows = max(1, max_rows)
        self._closed = False

    def put(self, item: Any, rows: int) -> bool:
        """Queue ``item`` (waits while full); ``False`` once the buffer is closed."""
        with self._cv:
            while self._rows >= self._max_rows and not self._closed:
                self._cv.wait()
            if self._closed:
                return False
            self._items.append((item, rows))
            self._rows += rows
            self._cv.notify_all()
            return True

    def get(self) -> Any:
        """The next item (waits while empty); :data:`CLOSED` once the buffer is closed."""
        with self._cv:
            while not self._items and not self._closed:
                self._cv.wait()
            if self._closed:
                return CLOSED
            item, rows = self._items.popleft()
            self._rows -= rows
            self._cv.notify_all()
            return item

    def close(self) -> None:
        """Drop what is queued and end every wait, now and later (idempotent)."""
        with self._cv:
            self._closed = True
            self._items.clear()
            self._rows = 0
            self._cv.notify_all()


def _produce(gen: Iterator[Any], buf: ChunkBuffer) -> None:
    """Prefetch thread body: push every chunk of ``gen``, then ``END`` (or a failure)."""
    try:
        for item in gen:
            if not buf.put(item, item.rows):
                return
        buf.put(END, 0)
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
        buf.put(Failure(e), 0)
    finally:
        try:
            gen.close()  # work only on the closed path: a release of rows read ahead
        except Exception:  # noqa: BLE001 - nobody reads the buffer any more
            # the scheduler frees the leases of an ended session or a dropped dataset
            # itself; a release refused because its coordinator is gone loses nothing
            logger.debug("a closed loader's give-back failed", exc_info=True)


class Feed:
    """Chunks of ``gen``: from a prefetch thread through a buffer of ``max_rows`` rows, or
    inline when ``max_rows`` is ``None``.

    Inline, :meth:`get` runs the generator in the caller's thread; the caller must
    serialize calls (the loader iterator does, under its lock).
    """

    def __init__(self, gen: Iterator[Any], max_rows: int | None, name: str) -> None:
        self._gen: Iterator[Any] | None = gen
        self._buf: ChunkBuffer | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        if max_rows is not None:
            self._buf = ChunkBuffer(max_rows)
            self._thread = threading.Thread(target=_produce, args=(gen, self._buf),
                                            daemon=True, name=name)
            self._gen = None
            self._thread.start()

    def get(self) -> Any:
        """A chunk, :data:`END`, a :class:`Failure`, or :data:`CLOSED`."""
        if self._buf is not None:
            return self._buf.get()
        if self._stopped or self._gen is None:
            return CLOSED
        try:
            return next(self._gen, END)
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            return Failure(e)

    def signal(self) -> None:
        """End every wait on the buffer (any thread; no join, safe in ``__del__``)."""
        self._stopped = True
        if self._buf is not None:
            self._buf.close()

    def join(self) -> None:
        """Wait for the prefetch thread to return (after :meth:`signal`: see :meth:`stop`)."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None

    def stop(self) -> None:
        """Signal, then join the prefetch thread (or close the inline generator).

        The join ends once the producer returns from what it is doing (a read, a lease
        RPC, a staging copy): every put after the signal fails at once.
        """
        self.signal()
        self.join()
        if self._gen is not None:
            self._gen.close()
            self._gen = None

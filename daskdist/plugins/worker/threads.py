"""DaemonPool: the threads a runner runs closures in, as daemon threads.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the process exits, so
a closure still running when its worker process is asked to exit (Ctrl-C on a
LocalCluster's client, ``cluster.close()``) held the exit until the nanny gave up and
SIGKILLed the process (``0.8 x`` its 5 s timeout, every time). A closure lives no longer
than its worker: these threads end with the process, and a stop takes the time the
worker's own close takes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class DaemonPool:
    """At most ``size`` daemon threads running submitted calls in order (threads start
    on demand, as ThreadPoolExecutor's do). ``submit`` and ``shutdown`` from any thread."""

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

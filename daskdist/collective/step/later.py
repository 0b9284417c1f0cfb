"""Messages a closure sends when its ``synced`` loop is next asked for a batch.

Rank 0's commit message goes to the scheduler through the worker's event loop, and
waking that loop from the training thread (``call_soon_threadsafe``) hands it the GIL:
the training thread then waits while the loop sends (about a millisecond on a busy
host), in the middle of the commit, its host copy included. Its answer is needed only
at the next commit, so inside a ``synced`` loop the message is queued in the closure's
scope and sent when the commit is over: when the loop is asked for the next batch
(before it waits for any: rows at an epoch's tail wait for this very commit), as the
step's own work begins. Asking for the answer first sends it at once; so do the loop's end and the
closure's.

The closure's thread owns the queue (``ClosureScope.later``, under its lock).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from daskdist.session.scope import closure_scope_now


class Late:
    """A message sent once, later or when its answer is asked for: ``result(timeout)``
    as a ``concurrent.futures.Future``'s (an error sending it is the future's)."""

    def __init__(self, send: Callable[[], concurrent.futures.Future]) -> None:
        self._send = send
        self._future: concurrent.futures.Future | None = None
        self._lock = threading.Lock()

    def send(self) -> concurrent.futures.Future:
        """Send it now, if not sent yet; its answer's future."""
        with self._lock:
            if self._future is None:
                try:
                    self._future = self._send()
                except BaseException as e:  # noqa: BLE001 - the answer's error
                    failed: concurrent.futures.Future = concurrent.futures.Future()
                    failed.set_exception(e)
                    self._future = failed
            return self._future

    def result(self, timeout: float | None = None) -> Any:
        return self.send().result(timeout)

    @classmethod
    def of(cls, future: concurrent.futures.Future) -> Late:
        """One sent already, its answer's future ``future``."""
        late = cls(lambda: future)
        late._future = future
        return late


def send_later(send: Callable[[], concurrent.futures.Future]) -> Late:
    """``send`` queued until this closure's ``synced`` loop is asked for its next batch, or
    called now when no such loop runs (its error then raised at once)."""
    scope = closure_scope_now()
    if scope is not None:
        with scope.lock:
            if scope.later is not None:
                late = Late(send)
                scope.later.append(late)
                return late
    return Late.of(send())  # now: its error raised here, as a direct call's


class Queue:
    """While a ``synced`` loop runs in this closure, messages queue here until it is
    asked for a batch (:meth:`send`); what is left is sent when it ends (:meth:`close`, maybe
    from another thread: a late finalizer)."""

    def __init__(self) -> None:
        self.scope = closure_scope_now()
        self.outer: list | None = None
        if self.scope is not None:
            with self.scope.lock:
                self.outer, self.scope.later = self.scope.later, []

    def send(self) -> None:
        if self.scope is not None:
            self.scope.send_queued()

    def close(self) -> None:
        scope, self.scope = self.scope, None
        if scope is None:
            return
        scope.send_queued()
        with scope.lock:
            scope.later = self.outer

"""Each worker's preemption deadline, as its closures see it (``ctx.preemption``).

The worker's deadline watch (``plugins/worker/deadlines.py``) sets it, from whichever
source spoke first (SIGTERM, a configured signal, Dask's ``lifetime``, a cloud poller,
``coord.notify_preemption``); closures and an elastic State's commit read it. Keyed by
the worker's address, so workers sharing a process (threads of one ``LocalCluster``)
keep their own. Light: no Dask, tornado or torch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from daskdist.core.protocol import Preemption
from daskdist.session.scope import closure_scope_now

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_by_worker: dict[str, Preemption] = {}
# what else acts on a worker's deadline (a holder of an asynchronous model handing the
# global model over first): called with (address, notice) when a worker's changes
_listeners: list[Callable[[str, Preemption], None]] = []


def on_preemption(listener: Callable[[str, Preemption], None]) -> Callable[[], None]:
    """Call ``listener(address, notice)`` (on the worker's event loop; it must not block)
    whenever a worker of this process gets an earlier deadline: the seam for what must
    act before the deadline besides closures, which read ``ctx.preemption``, and elastic
    States, which leave at their next commit. Returns what unregisters it."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def set_preemption(address: str, notice: Preemption) -> None:
    """Worker ``address`` will be taken away: ``notice`` (its deadline and why); the
    :func:`on_preemption` listeners hear it."""
    with _lock:
        _by_worker[address] = notice
    for listener in list(_listeners):
        try:
            listener(address, notice)
        except Exception:  # noqa: BLE001 - one listener's bug must not stop the others
            logger.exception("daskdist: a preemption listener failed")


def forget_preemption(address: str) -> None:
    """Worker ``address`` closed (its process may host another worker later)."""
    with _lock:
        _by_worker.pop(address, None)


def preemption_of(address: str) -> Preemption | None:
    """Worker ``address``'s deadline, or ``None``."""
    return _by_worker.get(address)


def preemption_now() -> Preemption | None:
    """The deadline of the worker running this thread's closure (``None`` outside one,
    or without a deadline)."""
    scope = closure_scope_now()
    context = scope.context if scope is not None else None
    return None if context is None else preemption_of(context.address)

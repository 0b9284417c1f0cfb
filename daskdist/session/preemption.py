"""Each worker's preemption deadline, as its closures see it (``ctx.preemption``).

The worker's deadline watch (``plugins/worker/deadlines.py``) sets it, from whichever
source spoke first (SIGTERM, a configured signal, Dask's ``lifetime``, a cloud poller,
``coord.notify_preemption``); closures and an elastic State's commit read it. Keyed by
the worker's address, so workers sharing a process (threads of one ``LocalCluster``)
keep their own. Light: no Dask, tornado or torch.
"""

from __future__ import annotations

import threading

from daskdist.core.protocol import Preemption
from daskdist.session.scope import closure_scope_now

_lock = threading.Lock()
_by_worker: dict[str, Preemption] = {}


def set_preemption(address: str, notice: Preemption) -> None:
    """Worker ``address`` will be taken away: ``notice`` (its deadline and why)."""
    with _lock:
        _by_worker[address] = notice


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

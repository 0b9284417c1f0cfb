"""Process-wide state of this worker's membership in a collective group.

torch.distributed has one default process group per process, so a worker is a
member of at most one group at a time. This module holds that membership (rank,
generation, backend, device), the generations the scheduler plugin declared lost,
the events of collective calls now waiting (so a lost peer wakes them at once),
and a graveyard of abandoned process groups whose in-flight work has not finished
(dropping the last reference to a gloo group with pending work would block the
dropping thread until gloo's own timeout).

Everything here is guarded by one lock; nothing here issues a collective call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from daskdist.errors import CollectiveError


@dataclass
class Member:
    """This process's place in the formed group of one generation."""

    rank: int
    world_size: int
    generation: int
    backend: str
    device: Any
    timeout: float
    broken: str = ""  # why the group can no longer be used ("" while healthy)
    pg: Any = None  # this generation's torch process group (the default group)


lock = threading.RLock()
member: Member | None = None
lost_upto: int = 0  # every generation <= lost_upto has lost a peer
waiters: set[threading.Event] = set()
stores: dict[int, Any] = {}  # generation -> TCPStore master held on rank 0
graveyard: list[tuple[Any, Any]] = []  # (process group, pending work) kept alive


def current() -> Member | None:
    """The formed membership, or ``None``."""
    return member


def break_group(generation: int, reason: str) -> None:
    """Mark ``generation`` unusable and wake every collective call waiting on it."""
    with lock:
        m = member
        if m is not None and m.generation == generation and not m.broken:
            m.broken = reason
        for ev in waiters:
            ev.set()


def mark_lost(generation: int, reason: str) -> None:
    """Record that ``generation`` (and every older one) lost a peer."""
    global lost_upto
    with lock:
        lost_upto = max(lost_upto, generation)
        m = member
        if m is not None and m.generation <= generation and not m.broken:
            m.broken = reason
        for ev in waiters:
            ev.set()


def check(generation: int) -> Member:
    """The healthy membership of ``generation``; ``CollectiveError`` otherwise."""
    m = member
    if m is None:
        raise CollectiveError(
            f"collective group generation {generation} is gone (this worker left it)"
        )
    if m.generation != generation:
        raise CollectiveError(
            f"collective group generation {generation} was replaced by generation {m.generation}"
        )
    if m.broken:
        raise CollectiveError(f"collective group generation {generation} is broken: {m.broken}")
    return m


def bury(pg: Any, work: Any) -> None:
    """Keep ``pg`` and its unfinished ``work`` alive until the work ends by itself."""
    with lock:
        graveyard.append((pg, work))


def prune_graveyard() -> None:
    """Drop abandoned groups whose work has finished (cheap; called at each formation)."""
    with lock:
        graveyard[:] = [(pg, w) for pg, w in graveyard if not _completed(w)]


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a broken work object is as good as finished
        return True

"""Process-wide state of this worker's membership in a collective group.

torch.distributed has one default process group per process, so a worker is a
member of at most one group at a time. :data:`PROCESS`, the one
:class:`ProcessGroupState` of this process, holds that membership (rank, generation,
backend, device), the generations the scheduler plugin declared lost, the events of
collective calls now waiting (so a lost peer wakes them at once), rank 0's rendezvous
stores, and a graveyard of abandoned process groups whose in-flight work has not
finished (dropping the last reference to a gloo group with pending work would block
the dropping thread until gloo's own timeout).

Everything here is guarded by one lock; nothing here issues a collective call or
imports torch. Every user goes through :data:`PROCESS`: ``bootstrap`` (formation,
teardown, lost peers), ``group`` (collective calls) and the worker plugin.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from daskdist.errors import CollectiveError


@dataclass
class ProcessMembership:
    """This process's place in the formed group of one generation."""

    rank: int
    world_size: int
    generation: int
    backend: str
    device: Any
    timeout: float
    broken: str = ""  # why the group can no longer be used ("" while healthy)
    pg: Any = None  # this generation's torch process group (the default group)


class ProcessGroupState:
    """This process's collective-group state (one per process: :data:`PROCESS`).

    Any thread may call any method; ``lock`` (re-entrant) guards every attribute.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.member: ProcessMembership | None = None
        self.lost_upto = 0  # every generation <= lost_upto has lost a peer
        self.waiters: set[threading.Event] = set()
        self.stores: dict[int, Any] = {}  # generation -> TCPStore master held on rank 0
        self.graveyard: list[tuple[Any, Any]] = []  # (process group, pending work) kept alive

    # -- membership -----------------------------------------------------------------
    def current(self) -> ProcessMembership | None:
        """The formed membership, or ``None``."""
        return self.member

    def join(self, member: ProcessMembership) -> bool:
        """Become ``member``, unless its generation was declared lost meanwhile
        (``False``: nothing changes)."""
        with self.lock:
            if self.is_lost(member.generation):
                return False
            self.member = member
            return True

    def leave(self, keep_store: int | None) -> ProcessMembership | None:
        """Forget the membership (marked broken), wake every waiting call and drop every
        store but ``keep_store``'s; the membership left, if any."""
        with self.lock:
            m, self.member = self.member, None
            if m is not None and not m.broken:
                m.broken = "the group was destroyed"
            for ev in self.waiters:
                ev.set()
            for g in [g for g in self.stores if g != keep_store]:
                del self.stores[g]
        return m

    def is_lost(self, generation: int) -> bool:
        """Whether ``generation`` was declared lost (a peer left, or it was superseded)."""
        return generation <= self.lost_upto

    def highest_generation(self) -> int:
        """The newest collective generation this process has seen (later ones must be
        numbered higher). Lock-free: the worker plugin asks from its event loop."""
        m = self.member
        return max(self.lost_upto, m.generation if m else 0, max(list(self.stores), default=0))

    def break_group(self, generation: int, reason: str) -> None:
        """Mark ``generation`` unusable and wake every collective call waiting on it."""
        with self.lock:
            m = self.member
            if m is not None and m.generation == generation and not m.broken:
                m.broken = reason
            for ev in self.waiters:
                ev.set()

    def mark_lost(self, generation: int, reason: str) -> None:
        """Record that ``generation`` (and every older one) lost a peer."""
        with self.lock:
            self.lost_upto = max(self.lost_upto, generation)
            m = self.member
            if m is not None and m.generation <= generation and not m.broken:
                m.broken = reason
            for ev in self.waiters:
                ev.set()

    def check(self, generation: int) -> ProcessMembership:
        """The healthy membership of ``generation``; ``CollectiveError`` otherwise."""
        m = self.member
        if m is None:
            raise CollectiveError(
                f"collective group generation {generation} is gone (this worker left it)"
            )
        if m.generation != generation:
            raise CollectiveError(f"collective group generation {generation} was replaced "
                                  f"by generation {m.generation}")
        if m.broken:
            raise CollectiveError(
                f"collective group generation {generation} is broken: {m.broken}")
        return m

    # -- waiting calls ----------------------------------------------------------------
    @contextlib.contextmanager
    def waiting(self) -> Iterator[threading.Event]:
        """An event registered while a call waits: lost-peer marks and teardown set it."""
        wake = threading.Event()
        with self.lock:
            self.waiters.add(wake)
        try:
            yield wake
        finally:
            with self.lock:
                self.waiters.discard(wake)

    # -- rank 0's rendezvous stores ---------------------------------------------------
    def keep_store(self, generation: int, store: Any) -> None:
        """Hold ``generation``'s store (rank 0), dropping those of older generations."""
        with self.lock:
            for g in [g for g in self.stores if g < generation]:
                del self.stores[g]
            self.stores[generation] = store

    def store(self, generation: int) -> Any:
        """The store held for ``generation``, or ``None``."""
        with self.lock:
            return self.stores.get(generation)

    # -- abandoned groups -------------------------------------------------------------
    def bury(self, pg: Any, work: Any) -> None:
        """Keep ``pg`` and its unfinished ``work`` alive until the work ends by itself."""
        with self.lock:
            self.graveyard.append((pg, work))

    def prune_graveyard(self) -> None:
        """Drop abandoned groups whose work has finished (cheap; called at each formation)."""
        with self.lock:
            self.graveyard[:] = [(pg, w) for pg, w in self.graveyard if not _completed(w)]


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a broken work object is as good as finished
        return True


PROCESS = ProcessGroupState()  # this process's one collective-group state

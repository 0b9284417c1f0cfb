"""What the scheduler keeps for a ``Coordinator(keep_alive=True)`` (pure): its outcomes,
until its client has read them.

A keep-alive owner outlives its client (a restarted kernel, a laptop asleep): whoever
attaches next (``Coordinator.attach``) gets every value nobody read, so an outcome stays
here after it reached the client, until the client *reads* it (``fetch`` or
``exception`` sends a read receipt), not merely receives it: a value that reached a
kernel which died before it was fetched is still there. :class:`KeptResults` holds them
and counts their bytes against a bound (``daskdist.coordinator.keep-results``):

- while no client is attached, past the bound it is ``full``: the owner's queued
  closures wait (the closures already handed to workers finish), so no value is
  dropped, and the next client to attach finds them all;
- while a client is attached (it may be waiting for a queued closure: holding the queue
  could never end), past the bound the oldest values that client has *received* are
  kept no longer (it holds them; only its crash would lose them), so the bound holds
  but for values not delivered yet.

It also remembers the highest closure number it saw, so an attached client numbers its
closures above every earlier one.

Imports nothing from Dask or the rest of the package but the wire's types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from daskdist.core.protocol import Outcome

OVERHEAD = 256  # bytes an outcome costs beyond its payload (the tuple, its strings)


def size_of(value: Any) -> int:
    """The payload bytes of an outcome's value: bytes, or lists of them (a gang's
    per-rank results); anything else counts nothing."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(size_of(v) for v in value)
    return 0


def seq_of(cid: str) -> int | None:
    """The schedule number of a closure id (``owner-12``) or a gang id (``owner-g12``);
    ``None`` for anything else (a gang member's ``owner-g12@3#0``)."""
    tail = cid.rpartition("-")[2].lstrip("g")
    return int(tail) if tail.isdigit() else None


def next_seq(cids: Iterable[str], floor: int = -1) -> int:
    """The first schedule number above ``floor`` and above every one of ``cids``."""
    return max([floor, *(s for s in map(seq_of, cids) if s is not None)]) + 1


def is_gang(cid: str) -> bool:
    """Whether ``cid`` is a gang's id (``owner-g12``)."""
    return cid.rpartition("-")[2].startswith("g")


def gang_of(cid: str) -> str:
    """The outcome a read receipt names: a gang's per-rank value (``gid#rank``) is read
    as its gang's."""
    return cid.partition("#")[0]


class KeptResults:
    """A keep-alive owner's outcomes not yet read, in arrival order, and their bytes.

    ``on_full(full)`` is called whenever ``full`` changes (the caller holds or releases
    the owner's queued closures). ``attached``: a client is connected (see the module).
    """

    def __init__(self, limit: int, on_full: Callable[[bool], None] | None = None) -> None:
        if limit < 0:
            raise ValueError(f"keep-results must be >= 0 bytes, got {limit}")
        self.limit = int(limit)
        self.on_full = on_full
        self.outcomes: dict[str, Outcome] = {}
        self.nbytes = 0
        self.high = -1  # the highest schedule number seen
        self._sizes: dict[str, int] = {}
        self._received: dict[str, None] = {}  # kept ids its client received, oldest first
        self._full = False
        self.attached = True
        self.let_go = 0  # values received by an attached client, kept no longer

    @property
    def full(self) -> bool:
        """Whether the owner's queue waits: no client attached, and the unread outcomes
        hold more than ``limit`` bytes."""
        return self._full

    def set_attached(self, attached: bool) -> None:
        """A client is connected to the owner (``True``), or none is."""
        self.attached = attached
        self._update()

    def received(self, cids: Iterable[str]) -> None:
        """The attached client received these outcomes (not read them)."""
        for cid in cids:
            if cid in self.outcomes:
                self._received[cid] = None
        self._update()

    def add(self, outcome: Outcome) -> None:
        """An outcome of the owner (final: it replaces one of the same id, a duplicate)."""
        cid = outcome.cid
        seq = seq_of(cid)
        if seq is not None and seq > self.high:
            self.high = seq
        size = OVERHEAD + size_of(outcome.value)
        self.nbytes += size - self._sizes.get(cid, 0)
        self._sizes[cid] = size
        self.outcomes[cid] = outcome
        self._update()

    def read(self, cids: Iterable[str]) -> int:
        """The client read these values (a gang's per-rank ids count as the gang's):
        they are forgotten. How many were kept."""
        n = 0
        for cid in map(gang_of, cids):
            if cid in self.outcomes:
                self._forget(cid)
                n += 1
        if n:
            self._update()
        return n

    def _forget(self, cid: str) -> None:
        del self.outcomes[cid]
        self.nbytes -= self._sizes.pop(cid)
        self._received.pop(cid, None)

    def unread(self) -> list[Outcome]:
        """The outcomes kept, oldest first."""
        return list(self.outcomes.values())

    def __len__(self) -> int:
        return len(self.outcomes)

    def _update(self) -> None:
        if self.attached:  # past the bound, what the client holds goes, oldest first
            while self.nbytes > self.limit and self._received:
                self._forget(next(iter(self._received)))
                self.let_go += 1
        full = self.nbytes > self.limit and not self.attached
        if full != self._full:
            self._full = full
            if self.on_full is not None:
                self.on_full(full)

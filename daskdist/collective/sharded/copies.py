"""ShardCopy: a sharded commit as one rank keeps it in host memory.

A rank keeps its own shard (parameters and optimizer state it holds, packed in one flat
buffer: ``layout.py``), the copy of its ring predecessor's shard that the commit
received (another flat buffer), and the rest (buffers, step counters, hyperparameters)
with the State's objects (a :class:`~daskdist.collective.state.snapshot.HostCopy`): about 2/N of
the whole state. Buffers are made once and refilled in place; from CUDA the own shard
is copied into pinned memory on the current stream and waited for only when read.
:class:`Cut` says how the commit was cut, so a re-formed group of another size finds
which rows each held shard has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from daskdist.collective.sharded.layout import Entry, Live, flat_size, pack
from daskdist.collective.state.snapshot import HostCopy
from daskdist.core.resharding import predecessors


@dataclass(frozen=True)
class Cut:
    """How a commit's shards were cut: by the ``world`` ranks of ``generation``, copies
    along the ring ``order``, over ``entries``."""

    generation: int
    world: int
    order: tuple[int, ...]
    entries: tuple[Entry, ...]

    def peer(self, index: int) -> int:
        """The shard index whose copy shard ``index``'s rank keeps (-1: none)."""
        return predecessors(self.order)[index] if self.world > 1 else -1

    def successor(self, index: int) -> int:
        """The rank that keeps a copy of shard ``index`` (itself alone: none)."""
        return self.order[(self.order.index(index) + 1) % self.world]

    def nbytes(self, index: int) -> int:
        return flat_size(self.entries, self.world, index)


class ShardCopy:
    """One rank's copy of a sharded commit (see the module). Owned by one thread."""

    def __init__(self) -> None:
        self.cut: Cut | None = None
        self.index = -1  # this rank's shard index in the cut
        self.own: torch.Tensor | None = None
        self.peer: torch.Tensor | None = None
        self.rest = HostCopy()
        self._events: list[Any] = []

    @property
    def nbytes(self) -> int:
        """Host bytes held (own shard, the copy, the rest)."""
        own = 0 if self.own is None else self.own.numel()
        peer = 0 if self.peer is None else self.peer.numel()
        return own + peer + self.rest.nbytes

    @property
    def held(self) -> tuple[int, int]:
        """(own index, index of the copy kept) in the cut; -1 for none."""
        if self.cut is None:
            return -1, -1
        return self.index, (self.cut.peer(self.index) if self.peer is not None else -1)

    def fill(self, live: Live, objects: dict, cut: Cut, index: int,
             incoming: torch.Tensor | None, events: list | None = None,
             packed: torch.Tensor | None = None) -> tuple[torch.Tensor | None,
                                                          torch.Tensor | None]:
        """Keep ``live`` as shard ``index`` of ``cut`` (copied, or ``packed``: its flat
        buffer already made, taken as it is), ``objects`` with its rest, and
        ``incoming`` (the predecessor's shard, taken as it is). Returns the buffers it
        held before for the copy and, when given ``packed``, for its own shard: the
        next commit receives and packs into them."""
        n = cut.nbytes(index)
        cuda = any(t.is_cuda for t in live.locals)
        old_own = None
        if packed is not None:
            old_own, self.own = self.own, packed
        else:
            if self.own is None or self.own.numel() != n or bool(self.own.is_pinned()) != cuda:
                self.own = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
            pack(live.locals, cut.entries, cut.world, index, self.own)
        evs = list(events or [])
        if cuda:
            for dev in {t.device for t in live.locals if t.is_cuda}:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                evs.append(ev)
        self.rest.fill((live.rest, objects))
        self.cut, self.index, self._events = cut, index, evs
        old, self.peer = self.peer, incoming
        return old, old_own

    def flat(self, index: int) -> torch.Tensor | None:
        """The buffer holding shard ``index`` of the cut (read it after :meth:`wait`)."""
        own, peer = self.held
        if index == own:
            return self.own
        if index == peer and index >= 0:
            return self.peer
        return None

    def wait(self) -> None:
        """Block until the last fill's copies from CUDA are in host memory."""
        for ev in self._events:
            ev.synchronize()
        self._events = []
        self.rest.wait()

    def value(self, to_devices: bool = False) -> tuple[dict, dict]:
        """(rest, objects) as kept: host buffers, or fresh tensors where they were."""
        self.wait()
        if self.rest.skeleton is None:
            return {}, {}
        rest, objects = self.rest.value(to_devices=to_devices)
        return rest, objects

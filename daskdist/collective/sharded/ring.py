"""A sharded commit's ring copy, one rank's side: its shard sent to its ring successor
and its predecessor's taken, before the commit's allgather, so a commit that happened on
any rank has every copy in place.

Between ranks of different hosts the shard travels as bytes (``wire.py``); between
ranks of one host that agreed on it at ``sync()`` (``maps.py``), the rank packs its
shard into shared memory and only a :class:`~daskdist.collective.sharded.maps.Handle`
travels (or none: every handle went with the commit's early confirmation), and the
successor keeps a mapping of it. The buffers a copy arrives in and a shard is packed in
are kept from commit to commit (a promoted commit's predecessor frees its own).
"""

from __future__ import annotations

from typing import Any

import torch

from daskdist import config
from daskdist.collective.group import Group
from daskdist.collective.sharded.copies import Cut, ShardCopy
from daskdist.collective.sharded.layout import Live, pack, segments
from daskdist.collective.sharded.maps import SHARED, Handle, Offer
from daskdist.collective.sharded.wire import Run, pair_rounds, transfer
from daskdist.errors import CollectiveError


class RingCopy:
    """This rank's side of the commits' ring copy (see the module). Owned by the thread
    that trains (the State's)."""

    def __init__(self) -> None:
        # scratch buffers of the wire: "in" is where the next commit packs its shard
        self.wire: dict[str, Any] = {}
        self.handles: dict[str, Any] = {}  # the wire's scratch for a handle's few bytes
        # (generation, the ranks whose copy is a mapping of their shard, every rank's pid)
        self.local: tuple[Any, frozenset[int], list[int]] = (None, frozenset(), [])
        self.incoming: torch.Tensor | None = None  # the predecessor's shard: arrived, or
        # the buffer the next one arrives in
        self.staged: tuple | None = None  # (live, cut, event, packed) of the commit

    def mapped(self, g: Group) -> frozenset[int]:
        """The ranks of ``g`` whose copy is a mapping of their shard (agreed at sync)."""
        gen, ranks, _ = self.local
        return ranks if gen == g.generation else frozenset()

    def agree(self, g: Group, order: tuple[int, ...], offers: list[Offer],
              hosts: list[int]) -> None:
        """Which ranks' copies are mappings in generation ``g`` (a collective)."""
        self.local = (g.generation, SHARED.agree(g, order, offers, hosts),
                      [o.pid for o in offers])

    def announce(self, g: Group, cut: Cut, saved: ShardCopy) -> list[int]:
        """The handle of the buffer this commit packs into, when it is known before the
        confirmation: the committed copy's own (the spare once the commit in flight is
        promoted, which the confirmation does or raises), of this commit's size; zeros
        when not."""
        if g.rank not in self.mapped(g) or "in" in self.wire:
            return [0] * Handle.LEN
        own = saved.own
        if not SHARED.owns(own) or own.numel() != cut.nbytes(g.rank):
            return [0] * Handle.LEN
        return SHARED.handle(own).ints()

    def stage(self, g: Group, live: Live, cut: Cut, told: list[Handle] | None,
              spare: ShardCopy | None) -> None:
        """This rank's shard to its successor and the predecessor's into
        :attr:`incoming`: bytes on the wire, or, between ranks of one host, a handle to
        the packed shard that the successor maps. ``told``: every rank's announced
        handle; ``spare``: a copy whose buffers are free."""
        event = packed = None
        if g.world_size > 1:
            pred, succ = cut.peer(g.rank), cut.successor(g.rank)
            cuda = any(t.is_cuda for t in live.locals)
            mapped = self.mapped(g) if not cuda else frozenset()
            # every mapping's handle went with the confirmation: none travels now
            told = told if told and mapped and all(told[r].fd for r in mapped) else None
            self._reuse(spare, cuda)
            handle = 0 if told else Handle.wire_bytes()
            if g.rank in mapped:  # packed into shared memory: the successor maps it
                packed = self.wire.get("in")  # taken once the handle went out
                if not SHARED.owns(packed) or packed.numel() != cut.nbytes(g.rank):
                    packed = self.wire["in"] = SHARED.resized(packed, cut.nbytes(g.rank))
                if told and told[g.rank] != SHARED.handle(packed):
                    raise CollectiveError("ShardedState.commit(): the shard's buffer is not "
                                          "the one announced to the ring successor")
                pack(live.locals, cut.entries, cut.world, g.rank, packed)
                own = Run.of([] if told else [SHARED.handle(packed).encode()])
            else:
                own = Run(cut.nbytes(g.rank),
                          segments(live.locals, cut.entries, cut.world, g.rank))
            if pred in mapped:
                inc = torch.empty(handle, dtype=torch.uint8)
            else:
                n = cut.nbytes(pred)
                inc = self.incoming
                if inc is None or inc.numel() != n or bool(inc.is_pinned()) != cuda \
                        or SHARED.is_view(inc):
                    inc = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
            chunk = config.nbytes("collective.shard-bucket")
            rounds = pair_rounds({(r, cut.successor(r)): handle if r in mapped
                                  else cut.nbytes(r) for r in range(g.world_size)}, chunk)
            self.incoming = None  # in transit: a failed transfer leaves it unusable
            event = transfer(g, {succ: own}, {pred: Run.of([inc])}, rounds, chunk,
                             self.handles if g.rank in mapped else self.wire)
            if pred in mapped:
                h = told[pred] if told else Handle.decode(inc)
                inc = SHARED.view(self.local[2][pred], h)
            self.incoming = inc
            if g.rank in mapped:
                del self.wire["in"]
            elif rounds == 1 and not cuda:
                # the wire buffer holds the packed shard: keep it
                packed = self.wire.pop("in")[:own.nbytes]
        self.staged = (live, cut, event, packed)

    def _reuse(self, spare: ShardCopy | None, cuda: bool) -> None:
        """The spare copy's buffers (a commit promoted: the one before it is free) become
        the ones this commit's copy arrives in and its shard is packed in."""
        if spare is None:
            return
        if self.incoming is None and spare.peer is not None \
                and not SHARED.is_view(spare.peer):  # a mapping is never written
            self.incoming = spare.peer
        spare.peer = None
        if not cuda and "in" not in self.wire and spare.own is not None:
            self.wire["in"], spare.own = spare.own, None

    def fill(self, copy: ShardCopy, objects: dict, g: Group) -> ShardCopy:
        """``copy`` takes what was staged: this rank's shard, the predecessor's that
        arrived, and the rest with ``objects``; its old buffers serve the next commit."""
        live, cut, event, packed = self.staged
        inc = self.incoming if g.world_size > 1 else None
        old, own = copy.fill(live, objects, cut, g.rank, inc,
                             [event] if event else None, packed)
        self.incoming = old if g.world_size > 1 and not SHARED.is_view(old) else None
        if own is not None:
            self.wire["in"] = own  # the next commit packs its shard there
        self.staged = None  # taken: the commit happened here
        return copy

    def abandon(self, g: Group, objects: dict) -> ShardCopy | None:
        """The commit failed here: what it staged, as a copy to keep until the next
        ``sync()`` when its predecessor's shard arrived (if the commit completed on
        other ranks, a member died inside its allgather, this rank's shard and copy of
        it are needed there); ``None`` when nothing arrived."""
        staged, self.staged = self.staged, None
        if staged is None or self.incoming is None:
            return None
        live, cut, event, packed = staged
        copy = ShardCopy()
        copy.fill(live, objects, cut, g.rank, self.incoming, [event] if event else None,
                  packed)
        self.incoming = None
        return copy

    def loose_bytes(self) -> int:
        """Host bytes of the buffers kept between commits (mappings counted where the
        memory is)."""
        loose = [self.incoming, self.wire.get("in"), self.wire.get("out")]
        return sum(t.numel() for t in loose
                   if t is not None and not t.is_cuda and not SHARED.is_view(t))

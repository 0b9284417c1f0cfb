"""ShardKeeper: what a ShardedState keeps, this rank's shard of the model sharded over the
group with FSDP2 and its ring predecessor's, and how a ``sync()`` reshards the newest
commit to a new group (SPEC §4.5).

- Each generation of the group gets its own model: ``sync()`` on a new generation builds
  the ``DeviceMesh`` over the group's own process group, builds the whole model
  (``build()``, on every rank), shards it with ``shard(model, mesh)``, guards FSDP2's
  collectives (``fsdp.py``: a lost peer ends them at once) and makes the optimizer
  (``make(params)``).
- A commit sends this rank's shard to its ring successor and takes its predecessor's
  (``ring.py``) before the commit's allgather, and keeps both (``ShardCopy``): about
  2/N of the state per rank. It learns the previous commit's outcome first (its head
  cannot ride the gradient allreduce: it would carry a stale one).
- ``sync()``: where the commit comes from is ``core.resharding.choose``'s rule on what
  every rank holds (:class:`ShardHead`): the ranks' newest commit when every one of its
  shards is still held, moved to the new cut straight from the ranks holding it
  (``wire.py``) without reading storage; else the newest durable checkpoint (every
  rank writes its own part, ``store.py``); else lost.
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from daskdist import config
from daskdist.collective.group import Group, get_group
from daskdist.collective.replicas import broadcast_parameters
from daskdist.collective.sharded.copies import Cut, ShardCopy
from daskdist.collective.sharded.fsdp import forget_meshes, guard, mesh_for
from daskdist.collective.sharded.layout import (
    Capture,
    Live,
    apply_rest,
    capture,
    placed,
    portable,
    sizes,
    targets,
    views,
)
from daskdist.collective.sharded.maps import SHARED, Handle, Offer
from daskdist.collective.sharded.ring import RingCopy
from daskdist.collective.sharded.wire import (
    copy_run,
    gather_whole,
    landing_run,
    pair_rounds,
    transfer,
)
from daskdist.collective.state.heads import SyncHead
from daskdist.collective.state.keeper import CHECKPOINT, FRESH, HELD, LOST, Origin, Subject
from daskdist.collective.state.snapshot import cloned
from daskdist.core.resharding import Report, Source, choose, ring, routes, span
from daskdist.errors import CollectiveError

_NOTHING = Report(0, 0, 0, -1, -1)


class ShardHead(NamedTuple):
    """One rank's part of a ``sync()``'s allgather: what its committed copy holds, what
    a failed commit staged (commits 0: nothing), its host, and its offer to map its
    ring neighbour's memory (``maps.py``)."""

    held: Report
    tentative: Report
    host: int
    offer: Offer

    def encode(self) -> list[int]:
        return [*_ints(self.held), *_ints(self.tentative), self.host, *self.offer.encode()]

    @classmethod
    def decode(cls, ints: list[int]) -> ShardHead:
        n = _REPORT
        return cls(Report(*ints[:n]), Report(*ints[n:2 * n]), ints[2 * n],
                   Offer.decode(ints[2 * n + 1:]))


_REPORT = 5  # a Report's ints


def _ints(r: Report) -> list[int]:
    return [r.commits, r.layout, r.world, r.own, r.peer]


def _held(copy: ShardCopy | None, commits: int) -> Report:
    """What ``copy`` holds, as ``sync()`` reports it (nothing: zeros and -1s)."""
    if copy is None or copy.cut is None:
        return _NOTHING
    own, peer = copy.held
    return Report(commits, copy.cut.generation, copy.cut.world, own, peer)


class ShardKeeper:
    """The shards a ShardedState keeps, and its model of each generation (see the
    module). Owned by the State's thread."""

    rides = False  # it learns the previous outcome before its copy travels

    def __init__(self, subject: Subject, build: Callable[[], torch.nn.Module],
                 make: Callable[..., Any] | None, shard: Callable[..., Any]) -> None:
        self.subject = subject
        self.build, self.make, self.shard = build, make, shard
        self.dims: tuple[str, ...] = ("data_parallel",)
        self.built: int | None = None  # the generation its model is sharded over
        self.plan = Capture()  # how the live shards are read (the model's layout)
        self.live: Live | None = None  # captured for the commit
        self.cut: Cut | None = None  # this generation's cut (made anew when it changes)
        self.order: tuple[int, ...] | None = None  # this generation's copy ring
        self.saved = ShardCopy()  # the committed copy
        self.spare: ShardCopy | None = None  # a promoted commit's predecessor: free
        self.tentative: ShardCopy | None = None  # what a failed commit staged
        self.source: ShardCopy | None = None  # the copy sync() serves from
        self.ring = RingCopy()
        self.heads: list[ShardHead] = []  # the ranks' parts at sync()

    # -- each generation's model ---------------------------------------------------
    def build_for(self, g: Group, fresh: bool) -> None:
        """Mesh, model, shards, guarded collectives and optimizer of generation ``g``.
        A model a commit is loaded into is built on the meta device and given memory
        after sharding (no weights made to be overwritten), unless it has buffers the
        commit does not hold (non-persistent ones: only its build makes them)."""
        forget_meshes()
        mesh = mesh_for(g, self.dims)
        model = self.built_model(meta=not fresh)
        if fresh and g.world_size > 1:
            # no commit yet: every rank starts from rank 0's weights, as a State does
            broadcast_parameters(model, src=0, group=g)
        meta = any(t.is_meta for t in model.parameters())
        out = self.shard(model, mesh)
        if isinstance(out, torch.nn.Module):
            model = out
        if meta:
            model.to_empty(device=g.device)
        if not guard(model, g):
            raise ValueError("ShardedState: shard(model, mesh) made no FSDP module (call "
                             "torch.distributed.fsdp.fully_shard on the model with mesh=mesh)")
        self.subject.model = model
        self.subject.optimizer = self.make(model.parameters()) if self.make is not None else None
        self.built = g.generation
        self.cut = None
        self.plan = Capture()  # the old model's plan must not outlive it

    def built_model(self, meta: bool) -> torch.nn.Module:
        """``build()``, on the meta device when ``meta`` and nothing but the commit's
        state is in it."""
        if meta:
            with torch.device("meta"):
                model = self.build()
            if isinstance(model, torch.nn.Module) and not any(
                    m._non_persistent_buffers_set for m in model.modules()):
                return model
        model = self.build()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ShardedState: model() returned {type(model).__name__}, "
                            f"not a torch.nn.Module")
        return model

    def adopt(self, model: torch.nn.Module, optimizer: Any) -> None:
        """``model``, sharded over this generation's mesh by its owner, and ``optimizer``
        are this generation's (see ``ShardedState.adopt``)."""
        g = get_group()
        if not guard(model, g):
            raise ValueError("ShardedState.adopt: the model holds no FSDP module (shard it "
                             "with fully_shard over the group's mesh first)")
        s = self.subject
        if model is not s.model or optimizer is not s.optimizer:
            self.plan = Capture()
        s.model, s.optimizer = model, optimizer
        self.built = g.generation
        self.cut = None

    def require_built(self, g: Group, what: str) -> None:
        if self.built != g.generation or self.subject.model is None:
            raise RuntimeError(
                f"ShardedState.{what}(): call state.sync() first in each run of the gang "
                f"closure: the model is sharded over generation {self.built}'s group and "
                f"the group is generation {g.generation} now")

    def _cut_for(self, g: Group, live: Live) -> Cut:
        """This generation's cut of ``live`` (made anew when its entries changed)."""
        cut = self.cut
        if cut is None or cut.generation != g.generation or (
                cut.entries is not live.entries and cut.entries != live.entries):
            cut = Cut(g.generation, g.world_size, self.order or tuple(range(g.world_size)),
                      live.entries)
            self.cut = cut
        return cut

    # -- commits -------------------------------------------------------------------
    def capture(self, g: Group) -> None:
        self.require_built(g, "commit")
        s = self.subject
        self.live = self.plan(s.model, s.optimizer, g.rank, g.world_size)

    def announce(self, g: Group) -> list[int]:
        """A rank whose copy is a mapping knows the buffer its shard is packed into
        before the confirmation: its handle rides it, and when every such rank's did,
        the copy needs no call of its own."""
        return self.ring.announce(g, self._cut_for(g, self.live), self.saved)

    def stage(self, g: Group, told: list[list[int]] | None) -> None:
        """The ring copy (``told``: every rank's announced handle)."""
        live, self.live = self.live, None
        handles = [Handle(*t) for t in told] if told is not None else None
        self.ring.stage(g, live, self._cut_for(g, live), handles, self.spare)

    def abandon(self, g: Group) -> None:
        kept = self.ring.abandon(g, self.subject.objects)
        if kept is not None:
            self.tentative = kept  # the copy arrived, the commit did not complete

    def candidate(self) -> ShardCopy:
        spare, self.spare = self.spare, None
        return self.ring.fill(spare or ShardCopy(), self.subject.objects, get_group())

    def refill(self) -> ShardCopy:
        return self.ring.fill(self.saved, self.subject.objects, get_group())

    def promote(self, copy: ShardCopy) -> None:
        if copy is not self.saved:  # a commit in flight confirmed: swap the buffers
            self.spare, self.saved = self.saved, copy

    def idle(self) -> None:
        """The spare's buffers take the next commit's copy (kept)."""

    def save(self) -> None:
        """The copy to the ring successor travels (a collective)."""
        if self.subject.model is None:
            return
        g = get_group()
        s = self.subject
        live = self.plan(s.model, s.optimizer, g.rank, g.world_size)
        self.ring.stage(g, live, self._cut_for(g, live), None, self.spare)
        try:
            self.refill()
        finally:
            self.ring.staged = None

    def nbytes(self, in_flight: Any) -> int:
        """The committed copy (its shard and its neighbour's), a commit in flight, and
        the buffers the next copy travels in; a neighbour's shard mapped from its
        memory is counted there, not here."""
        copies = [c for c in (self.saved, self.spare, in_flight, self.tentative)
                  if isinstance(c, ShardCopy)]
        held = sum(c.nbytes - (c.peer.numel() if SHARED.is_view(c.peer) else 0)
                   for c in copies)
        return held + self.ring.loose_bytes()

    def load(self) -> None:
        """Back to the committed copy (this generation's): own shard, rest, objects."""
        saved, s = self.saved, self.subject
        if saved.cut is None or s.model is None:
            return
        g = get_group()
        if saved.cut.generation != self.built:
            raise CollectiveError(
                f"ShardedState.restore(): the commit was cut for generation "
                f"{saved.cut.generation}, the model is generation {self.built}'s; call "
                f"sync() to take it over the new group")
        saved.wait()
        cut = saved.cut
        dst = targets(s.model, s.optimizer, cut.entries, g.rank, cut.world)
        with torch.no_grad():
            for t, v in zip(dst, views(saved.own, cut.entries, cut.world, saved.index),
                            strict=True):
                t.copy_(v)
        rest, objects = saved.value(to_devices=True)
        apply_rest(s.model, s.optimizer, rest)
        s.replace_objects(objects)

    # -- sync ----------------------------------------------------------------------
    def rewind(self, synced: bool, renewed: bool) -> None:
        """A re-formation: the objects, and the old optimizer's hyperparameters, as
        committed (what reset callbacks see and may change); the model is built anew."""
        if not renewed or self.saved.cut is None:
            return
        rest, objects = self.saved.value(to_devices=True)
        self.subject.replace_objects(objects)
        if self.subject.optimizer is not None:
            for group, kept in zip(self.subject.optimizer.param_groups,
                                   rest.get("groups", []), strict=False):
                group.update({k: v for k, v in kept.items() if k != "params"})

    def report(self, g: Group, commits: int) -> list[int]:
        host = zlib.crc32(socket.gethostname().encode())
        return ShardHead(_held(self.saved, commits), _held(self.tentative, commits + 1),
                         host, SHARED.offer(g)).encode()

    def choose(self, g: Group, heads: list[SyncHead], parts: list[list[int]]) -> Origin:
        self.heads = mine = [ShardHead.decode(p) for p in parts]
        reports = [h.held for h in mine]
        staged = {r: h.tentative for r, h in enumerate(mine) if h.tentative.commits > 0}
        src = choose(reports, checkpoint=heads[0].newest,
                     known=max(h.known for h in heads), tentative=staged)
        if src.kind == LOST:
            self.tentative = None
        elif src.kind == "memory":
            own = reports[g.rank]
            keep = ((own.commits, own.layout) == (src.commits, src.layout)
                    or g.rank not in staged)
            self.source = self.saved if keep else self.tentative
        kind = HELD if src.kind == "memory" else src.kind  # the others: the same names
        return Origin(kind, src.commits, src, tuple(src.missing))

    def take(self, g: Group, origin: Origin, durable: Any) -> dict | None:
        """This generation's ring and mappings, its model (built when new), then the
        commit resharded: from the ranks' copies, or a checkpoint (its record)."""
        hosts = [h.host for h in self.heads]
        self.order = tuple(ring(hosts))
        self.ring.agree(g, self.order, [h.offer for h in self.heads], hosts)
        s = self.subject
        if self.built != g.generation or s.model is None:
            self.build_for(g, fresh=origin.kind == FRESH)
        elif origin.kind == FRESH and self.saved.cut is not None \
                and self.saved.cut.generation == g.generation:
            self.load()  # back to the state the first sync kept
        record = None
        if origin.kind == HELD:
            self._take_memory(g, origin.plan)
        elif origin.kind == CHECKPOINT:
            record = self._take_checkpoint(g, durable, origin.commits)
        self.tentative = self.source = None
        return record

    def _rest_now(self, held: ShardCopy) -> tuple[dict, dict]:
        """The commit's rest with the hyperparameters as the optimizer has them now (a
        reset callback's), and the objects now."""
        rest, _ = held.value()
        opt = self.subject.optimizer
        if opt is not None and len(opt.param_groups) == len(rest.get("groups", [])):
            rest = dict(rest)
            rest["groups"] = [{**{k: v for k, v in group.items() if k != "params"},
                               "params": kept["params"]}
                              for group, kept in zip(opt.param_groups, rest["groups"],
                                                     strict=True)]
        return rest, self.subject.objects

    def _take_memory(self, g: Group, src: Source) -> None:
        """Every rank's rows of the new cut, from the ranks holding the commit's shards."""
        s = self.subject
        first = min(src.serve.values())
        held: ShardCopy = self.source
        payload = None
        if g.rank == first:
            held.wait()
            rest, objects = self._rest_now(held)
            payload = portable((held.cut.entries, rest, objects))
        entries, rest, objects = g.broadcast_object(payload, src=first)
        rest, objects = placed((rest, objects), g.device)
        dst = targets(s.model, s.optimizer, entries, g.rank, g.world_size)
        rows, rb = sizes(entries)
        plan = routes(rows, src.world, g.world_size, src.serve)
        if any(a == g.rank for a, _ in plan):
            held.wait()
        sends = {d: copy_run(held, entries, src.world, parts)
                 for (a, d), parts in plan.items() if a == g.rank}
        recvs, moved = {}, []
        for (a, d), parts in plan.items():
            if d == g.rank:
                recvs[a] = landing_run(entries, dst, g, parts, moved)
        fan = max([sum(1 for (a, d) in plan if a == r and d != r) for r in range(g.world_size)]
                  + [sum(1 for (a, d) in plan if d == r and a != r)
                     for r in range(g.world_size)] + [1])
        chunk = max(1, config.nbytes("collective.shard-bucket") // fan)
        nbytes = {k: sum((p.stop - p.start) * rb[p.entry] for p in v) for k, v in plan.items()}
        event = transfer(g, sends, recvs, pair_rounds(nbytes, chunk), chunk)
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            for t, tmp, dim in moved:  # rows that arrived with their split dimension first
                t.movedim(dim, 0).copy_(tmp)
        apply_rest(s.model, s.optimizer, rest)
        s.replace_objects(objects)

    def _take_checkpoint(self, g: Group, durable: Any, commits: int) -> dict:
        """Every rank reads its rows of checkpoint ``commits``; its record."""
        s = self.subject
        blob = durable.read_rest(commits)
        entries, rest, objects = placed(blob["rest"], g.device)
        dst = targets(s.model, s.optimizer, entries, g.rank, g.world_size)
        want = {}
        for e, t in zip(entries, dst, strict=True):
            a, _ = span(e.rows, g.world_size, g.rank)
            offs = tuple(a if i == e.dim else 0 for i in range(len(e.shape)))
            want[e.key] = (t, offs)
        durable.read_rows(commits, want)
        apply_rest(s.model, s.optimizer, rest)
        s.replace_objects(objects)
        return blob["record"]

    # -- durable checkpoints: every rank writes its part ---------------------------
    def durable(self, url: str, every: int) -> Any:
        from daskdist.collective.sharded.store import ShardedDurable  # imports DCP

        return ShardedDurable(url, every)

    def writes_durable(self, rank: int) -> bool:
        return True

    def write_durable(self, durable: Any, state_id: str, commits: int, services: Any,
                      wait: bool) -> None:
        """This rank's part of the committed copy (its shard, in the cut the commit was
        made in: a commit promoted at a later ``sync()`` keeps its own numbering)."""
        saved = self.saved
        saved.wait()
        cut = saved.cut
        chunks = {}
        for e, v in zip(cut.entries, views(saved.own, cut.entries, cut.world, saved.index),
                        strict=True):
            a, _ = span(e.rows, cut.world, saved.index)
            offs = tuple(a if i == e.dim else 0 for i in range(len(e.shape)))
            chunks[e.key] = (v.clone(), offs, e.shape)  # the write outlives the buffers
        rest = None
        if saved.index == 0:
            rest_now, objects = saved.value()
            rest = portable((cut.entries, cloned(rest_now), cloned(objects)))
        durable.write_part(state_id, commits, saved.index, cut.world, cut.generation,
                           chunks, rest, services, wait=wait)

    # -- reading the whole model ---------------------------------------------------
    def full_state_dict(self, optimizer: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's state (and its optimizer's) on every rank (a collective)."""
        g = get_group()
        self.require_built(g, "full_state_dict")
        s = self.subject
        live = capture(s.model, s.optimizer if optimizer else None, g.rank, g.world_size)
        return gather_whole(live, g, list(s.model.state_dict().keys()))

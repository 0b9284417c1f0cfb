"""ShardedState: elastic state for a model sharded over the group with FSDP2 (SPEC §4.5).

``ShardedState(model=build, optimizer=make, shard=shard, **objects)`` is a
:class:`~daskdist.collective.state.elastic.State` (commit, restore, sync, interrupts at the
same commit on every rank, reset callbacks, rows acknowledged by commits,
``checkpoint_to``) whose model is built, sharded and loaded anew in every generation of
the group:

- ``sync()`` on a new generation builds the ``DeviceMesh`` over the group's own process
  group, builds the whole model (``build()``, on every rank), shards it with
  ``shard(model, mesh)`` (default ``fully_shard(model, mesh=mesh)``), guards FSDP2's
  collectives (``collective.fsdp``: a lost peer ends them at once), makes the optimizer
  (``make(params)``) with its state, and loads the newest commit *resharded* to the
  new world size. Reset callbacks run before, with the previous commit's objects and
  optimizer hyperparameters, which they may change.
- ``commit()`` first sends this rank's shard to its ring successor (``core.shards.ring``)
  and takes its predecessor's, then runs ``State.commit`` (one allgather, rows
  acknowledged, interrupts), which keeps its own shard and that copy
  (``ShardCopy``): about 2/N of the state per rank. The copy is taken before the
  commit's allgather, so a commit that happened on any rank has every copy in place.
- Where a commit comes from at ``sync()`` is ``core.shards.choose``'s rule on what every
  rank holds: the ranks' newest commit when every one of its shards is still held
  (any single loss; a host's ranks when their copies are on other hosts), moved to the
  new cut straight from the ranks holding it (``shardwire``) without reading storage;
  else the newest durable checkpoint (``checkpoint_to``: every rank writes its own part,
  ``shardstore``); else ``CollectiveError``, never a silent fresh start.
- ``full_state_dict()`` (a collective) gathers the whole model on every rank.

The committed state after a re-formation equals the last commit before it, bit for bit.
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from daskdist import config
from daskdist.collective.group import Group, get_group
from daskdist.collective.replicas import broadcast_parameters
from daskdist.collective.sharded.copies import Cut, ShardCopy
from daskdist.collective.sharded.fsdp import forget_meshes, fully_shard_all, guard, mesh_for
from daskdist.collective.sharded.layout import (
    Capture,
    Live,
    apply_rest,
    capture,
    pack,
    placed,
    portable,
    segments,
    sizes,
    targets,
    views,
)
from daskdist.collective.sharded.maps import OFFER_LEN, SHARED, Handle
from daskdist.collective.sharded.wire import (
    Run,
    copy_run,
    gather_whole,
    landing_run,
    pair_rounds,
    transfer,
)
from daskdist.collective.state.elastic import State, _clone, _outcome, _services
from daskdist.core.resharding import Report, Source, choose, ring, routes, span
from daskdist.errors import CollectiveError
from daskdist.session.counters import membership_joins, membership_version

__all__ = ["ShardedState"]

_MINE = ("_build", "_make", "_shard", "_dims", "_built", "_staged", "_incoming",
         "_wire", "_handles", "_local", "_told", "_cut", "_ring", "_tentative", "_source",
         "_capture")


class ShardedState(State):
    """State (SPEC §4, §4.1–4.3) of a model sharded over the group with FSDP2 (§4.5).

    ``model``: a function building the whole model (on every rank, in every generation);
    ``optimizer``: a function of the parameters making the optimizer; ``shard``:
    ``shard(model, mesh)`` shards it in place (default ``fully_shard(model,
    mesh=mesh)``); ``objects``: attributes committed with it. ``state.model`` and
    ``state.optimizer`` are the current generation's, after ``sync()``.
    """

    # its commit learns the previous outcome before the copy travels (_confirm_early):
    # a head gathered earlier would carry a stale one
    _rides = False

    def __init__(
        self,
        model: Callable[[], torch.nn.Module],
        optimizer: Callable[[Iterable[torch.nn.Parameter]], Any] | None = None,
        shard: Callable[[torch.nn.Module, Any], Any] | None = None,
        **objects: Any,
    ):
        for name, fn in (("model", model), ("optimizer", optimizer), ("shard", shard)):
            if fn is not None and (not callable(fn) or isinstance(fn, torch.nn.Module)):
                raise TypeError(
                    f"ShardedState: {name}= takes a function (model=lambda: Net(), "
                    f"optimizer=lambda params: AdamW(params), shard=lambda model, mesh: "
                    f"...), got {type(fn).__name__}: the model is built anew in every "
                    f"generation of the group")
        if model is None:
            raise TypeError("ShardedState: model= (a function building the model) is required")
        mine = {"_build": model, "_make": optimizer, "_shard": shard or fully_shard_all,
                "_dims": ("data_parallel",), "_built": None, "_staged": None,
                "_incoming": None, "_wire": {}, "_handles": {},
                "_local": (None, frozenset(), []), "_told": None, "_cut": None, "_ring": None,
                "_tentative": None, "_source": None, "_capture": Capture()}
        for k, v in mine.items():
            object.__setattr__(self, k, v)
        super().__init__(model=None, optimizer=None, **objects)
        object.__setattr__(self, "_saved", ShardCopy())
        object.__setattr__(self, "_spare", None)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MINE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __repr__(self) -> str:
        names = ", ".join(sorted(self._objects))
        return (f"ShardedState(model={getattr(self._build, '__name__', 'fn')}, "
                f"generation={self._built}, commits={self._commits}, objects=[{names}])")

    def checkpoint_to(self, url: str, every: int = 100) -> ShardedState:
        """Every rank writes its own shard of every ``every``-th commit to ``url`` with
        DCP (``collective.shardstore``), in the background; a group of any size resumes
        from it, resharded (see ``State.checkpoint_to``)."""
        from daskdist.collective.sharded.store import ShardedDurable

        object.__setattr__(self, "_durable", ShardedDurable(url, every))
        return self

    # -- building each generation's model ------------------------------------------------
    def _build_for(self, g: Group, fresh: bool) -> None:
        """Mesh, model, shards, guarded collectives and optimizer of generation ``g``.
        A model a commit is loaded into is built on the meta device and given memory
        after sharding (no weights made to be overwritten), unless it has buffers the
        commit does not hold (non-persistent ones: only its build makes them)."""
        forget_meshes()
        mesh = mesh_for(g, self._dims)
        model = self._built_model(meta=not fresh)
        if fresh and g.world_size > 1:
            # no commit yet: every rank starts from rank 0's weights, as a State does
            broadcast_parameters(model, src=0, group=g)
        meta = any(t.is_meta for t in model.parameters())
        out = self._shard(model, mesh)
        if isinstance(out, torch.nn.Module):
            model = out
        if meta:
            model.to_empty(device=g.device)
        if not guard(model, g):
            raise ValueError("ShardedState: shard(model, mesh) made no FSDP module (call "
                             "torch.distributed.fsdp.fully_shard on the model with mesh=mesh)")
        self.model = model
        self.optimizer = self._make(model.parameters()) if self._make is not None else None
        self._built = g.generation
        self._cut = None
        self._capture = Capture()  # the old model's plan must not outlive it

    def _built_model(self, meta: bool) -> torch.nn.Module:
        """``model()``, on the meta device when ``meta`` and nothing but the commit's
        state is in it."""
        if meta:
            with torch.device("meta"):
                model = self._build()
            if isinstance(model, torch.nn.Module) and not any(
                    m._non_persistent_buffers_set for m in model.modules()):
                return model
        model = self._build()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ShardedState: model() returned {type(model).__name__}, "
                            f"not a torch.nn.Module")
        return model

    def adopt(self, model: torch.nn.Module, optimizer: Any) -> None:
        """Take ``model``, sharded over this generation's mesh by its owner (a framework
        hook: Lightning's ``configure_model``), and ``optimizer`` as this generation's
        instead of building them; the next ``sync()`` loads the newest commit into them.
        The mesh is ``collective.fsdp.mesh_for(get_group())``."""
        g = get_group()
        if not guard(model, g):
            raise ValueError("ShardedState.adopt: the model holds no FSDP module (shard it "
                             "with fully_shard over the group's mesh first)")
        if model is not self.model or optimizer is not self.optimizer:
            self._capture = Capture()
        self.model, self.optimizer = model, optimizer
        self._built = g.generation
        self._cut = None

    def _require_built(self, g: Group, what: str) -> None:
        if self._built != g.generation or self.model is None:
            raise RuntimeError(
                f"ShardedState.{what}(): call state.sync() first in each run of the gang "
                f"closure: the model is sharded over generation {self._built}'s group and "
                f"the group is generation {g.generation} now")

    # -- commits -------------------------------------------------------------------------
    def commit(self) -> None:
        """Send this rank's shard to its ring successor (taking its predecessor's), then
        ``State.commit``: the commit keeps both (see the module)."""
        g = get_group()
        self._require_built(g, "commit")
        live = self._capture(self.model, self.optimizer, g.rank, g.world_size)
        if self._ledger.in_flight:
            self._confirm_early(g, live)
        self._stage(g, live)
        try:
            super().commit()
        except BaseException:
            if self._staged is not None and self._incoming is not None:
                self._keep_tentative(g)  # the copy arrived, the commit did not complete
            raise
        finally:
            self._staged = None

    def _confirm_early(self, g: Group, live: Live) -> None:
        """The commit in flight's outcome, learnt before this commit's copy travels (one
        small allgather of each rank's view of it, as ``State.commit``'s carries): once
        promoted, the commit before it is free and its buffers take this one's copy, so
        a rank keeps two commits' buffers, not three. A rank whose copy is a mapping
        (``shardmaps``) knows that buffer already: its :class:`Handle` rides along, and
        when every such rank's did, the copy needs no call of its own."""
        prev = _outcome(self._ledger.reply, g.timeout / 2)
        rows = [t.tolist() for t in g.allgather(torch.tensor(
            [prev] + self._announce(g, live), dtype=torch.int64,
            device=g.wire_device))]
        self._confirm(rows[0][0], min(r[0] for r in rows), [])
        self._told = (g.generation, [r[1:] for r in rows])

    def _announce(self, g: Group, live: Live) -> list[int]:
        """The handle of the buffer this commit packs into, when it is known before the
        confirmation: the committed copy's own (the spare once the commit in flight is
        promoted, which ``_confirm`` does or raises), of this commit's size; zeros
        when not."""
        if g.rank not in self._mapped(g) or "in" in self._wire:
            return [0] * Handle.LEN
        own = self._saved.own
        if not SHARED.owns(own) or own.numel() != self._cut_for(g, live).nbytes(g.rank):
            return [0] * Handle.LEN
        h = SHARED.handle(own)
        return [h.fd, h.inode, h.offset, h.nbytes]

    def _cut_for(self, g: Group, live: Live) -> Cut:
        """This generation's cut of ``live`` (made anew when its entries changed)."""
        cut = self._cut
        if cut is None or cut.generation != g.generation or (
                cut.entries is not live.entries and cut.entries != live.entries):
            cut = Cut(g.generation, g.world_size, self._order, live.entries)
            self._cut = cut
        return cut

    @property
    def commit_bytes(self) -> int:
        """Host bytes this rank keeps for commits: the committed copy (its shard and its
        neighbour's), a commit in flight, and the buffers the next copy travels in. A
        neighbour's shard mapped from its memory is counted there, not here."""
        copies = [c for c in (self._saved, self._spare, self._ledger.state, self._tentative)
                  if isinstance(c, ShardCopy)]
        held = sum(c.nbytes - (c.peer.numel() if SHARED.is_view(c.peer) else 0)
                   for c in copies)
        loose = [self._incoming, self._wire.get("in"), self._wire.get("out")]
        return held + sum(t.numel() for t in loose
                          if t is not None and not t.is_cuda and not SHARED.is_view(t))

    def _keep_tentative(self, g: Group) -> None:
        """What a failed commit staged, kept until the next ``sync()``: if the commit
        completed on other ranks (a member died inside its allgather), this rank's
        shard and copy of it are needed there (``core.shards.choose``)."""
        live, cut, event, packed = self._staged
        copy = ShardCopy()
        copy.fill(live, self._objects, cut, g.rank, self._incoming, [event] if event else None,
                  packed)
        self._incoming = None
        self._tentative = copy

    def save(self) -> None:
        """Keep the current state as the committed one (a collective for a ShardedState:
        the copy to the ring successor travels)."""
        if self.model is None:
            return
        g = get_group()
        self._stage(g)
        try:
            self._refill()
        finally:
            self._staged = None

    def _stage(self, g: Group, live: Live | None = None) -> None:
        """This rank's shard to its successor and the predecessor's into ``_incoming``:
        bytes on the wire, or, between ranks of one host, a :class:`Handle` to the
        packed shard that the successor maps (``shardmaps``). ``live``: the capture
        the commit already took (taken here when none)."""
        if live is None:
            live = self._capture(self.model, self.optimizer, g.rank, g.world_size)
        cut = self._cut_for(g, live)
        told, self._told = self._told, None
        event = packed = None
        if g.world_size > 1:
            pred, succ = cut.peer(g.rank), cut.successor(g.rank)
            cuda = any(t.is_cuda for t in live.locals)
            mapped = self._mapped(g) if not cuda else frozenset()
            # every mapping's handle went with the confirmation: none travels now
            told = told[1] if told and told[0] == g.generation and mapped and all(
                told[1][r][0] for r in mapped) else None
            self._reuse_spare(cuda)
            handle = 0 if told else Handle.wire_bytes()
            if g.rank in mapped:  # packed into shared memory: the successor maps it
                packed = self._wire.get("in")  # taken once the handle went out
                if not SHARED.owns(packed) or packed.numel() != cut.nbytes(g.rank):
                    packed = self._wire["in"] = SHARED.resized(packed, cut.nbytes(g.rank))
                if told and Handle(*told[g.rank]) != SHARED.handle(packed):
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
                inc = self._incoming
                if inc is None or inc.numel() != n or bool(inc.is_pinned()) != cuda \
                        or SHARED.is_view(inc):
                    inc = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
            chunk = config.nbytes("collective.shard-bucket")
            rounds = pair_rounds({(r, cut.successor(r)): handle if r in mapped
                                  else cut.nbytes(r) for r in range(g.world_size)}, chunk)
            self._incoming = None  # in transit: a failed transfer leaves it unusable
            event = transfer(g, {succ: own}, {pred: Run.of([inc])}, rounds, chunk,
                             self._handles if g.rank in mapped else self._wire)
            if pred in mapped:
                h = Handle(*told[pred]) if told else Handle.decode(inc)
                inc = SHARED.view(self._local[2][pred], h)
            self._incoming = inc
            if g.rank in mapped:
                del self._wire["in"]
            elif rounds == 1 and not cuda:
                # the wire buffer holds the packed shard: keep it
                packed = self._wire.pop("in")[:own.nbytes]
        self._staged = (live, cut, event, packed)

    def _mapped(self, g: Group) -> frozenset[int]:
        """The ranks of ``g`` whose copy is a mapping of their shard (agreed at sync)."""
        gen, ranks, _ = self._local
        return ranks if gen == g.generation else frozenset()

    def _reuse_spare(self, cuda: bool) -> None:
        """The spare copy's buffers (a commit promoted: the one before it is free) become
        the ones this commit's copy arrives in and its shard is packed in."""
        spare = self._spare
        if spare is None:
            return
        if self._incoming is None and spare.peer is not None \
                and not SHARED.is_view(spare.peer):  # a mapping is never written
            self._incoming = spare.peer
        spare.peer = None
        if not cuda and "in" not in self._wire and spare.own is not None:
            self._wire["in"], spare.own = spare.own, None

    def _fill(self, copy: ShardCopy) -> ShardCopy:
        live, cut, event, packed = self._staged
        g = get_group()
        inc = self._incoming if g.world_size > 1 else None
        old, own = copy.fill(live, self._objects, cut, g.rank, inc,
                             [event] if event else None, packed)
        self._incoming = old if g.world_size > 1 and not SHARED.is_view(old) else None
        if own is not None:
            self._wire["in"] = own  # the next commit packs its shard there
        self._staged = None  # taken: the commit happened here
        return copy

    def _candidate(self) -> ShardCopy:
        spare, self._spare = self._spare, None
        return self._fill(spare or ShardCopy())

    def _refill(self) -> ShardCopy:
        return self._fill(self._saved)

    @property
    def _order(self) -> tuple[int, ...]:
        """This generation's copy ring (set by ``sync()``)."""
        return self._ring or tuple(range(get_group().world_size))

    # -- restore (local) -----------------------------------------------------------------
    def _load(self, saved: ShardCopy) -> None:
        """Back to ``saved`` (this generation's commit): own shard, rest, objects."""
        if saved.cut is None or self.model is None:
            return
        g = get_group()
        if saved.cut.generation != self._built:
            raise CollectiveError(
                f"ShardedState.restore(): the commit was cut for generation "
                f"{saved.cut.generation}, the model is generation {self._built}'s; call "
                f"sync() to take it over the new group")
        saved.wait()
        cut = saved.cut
        dst = targets(self.model, self.optimizer, cut.entries, g.rank, cut.world)
        with torch.no_grad():
            for t, v in zip(dst, views(saved.own, cut.entries, cut.world, saved.index),
                            strict=True):
                t.copy_(v)
        rest, objects = saved.value(to_devices=True)
        apply_rest(self.model, self.optimizer, rest)
        self._objects.clear()
        self._objects.update(objects)

    # -- sync ----------------------------------------------------------------------------
    def sync(self) -> None:
        """Shard a fresh model over this generation's group (a new generation) and load
        the newest commit resharded: from the ranks' copies when every shard is held,
        else the newest checkpoint, else ``CollectiveError`` (see the module)."""
        g = get_group()
        renewed = self._enter(g)
        self._settle_pending()
        if renewed and self._saved.cut is not None:
            self._back_to_commit()
        if renewed:
            self._reset()
        services = _services()
        known = 0
        if self._commits == 0 and services is not None:
            known = services.state_commits(self._id)
        newest = self._durable.newest() if self._durable is not None and g.rank == 0 else 0
        host = zlib.crc32(socket.gethostname().encode())
        head = torch.tensor(_held(self._saved, self._commits) + [
            self._seq, membership_version(), membership_joins(), known, newest, host]
            + _held(self._tentative, self._commits + 1) + SHARED.offer(g),
            dtype=torch.int64, device=g.wire_device)
        heads = [h.tolist() for h in g.allgather(head)]
        reports = [Report(*h[:5]) for h in heads]
        staged = {r: Report(*h[11:16]) for r, h in enumerate(heads) if h[11] > 0}
        src = choose(reports, checkpoint=int(heads[0][9]), known=max(h[8] for h in heads),
                     tentative=staged)
        if src.kind == "lost":
            self._tentative = None
            self._lost(g, src, max(h[8] for h in heads))
        if src.kind == "memory":
            mine = reports[g.rank]
            keep = ((mine.commits, mine.layout) == (src.commits, src.layout)
                    or g.rank not in staged)
            self._source = self._saved if keep else self._tentative
        self._ring = tuple(ring([h[10] for h in heads]))
        offers = [h[16:16 + OFFER_LEN] for h in heads]
        self._local = (g.generation, SHARED.agree(g, self._ring, offers, [h[10] for h in heads]),
                       [o[1] for o in offers])
        if self._built != g.generation or self.model is None:
            self._build_for(g, fresh=src.kind == "fresh")
        elif src.kind == "fresh" and self._saved.cut is not None \
                and self._saved.cut.generation == g.generation:
            self._load(self._saved)  # back to the state the first sync kept
        if src.kind == "memory":
            self._take_memory(g, src)
        elif src.kind == "checkpoint":
            self._take_checkpoint(g, src.commits)
        self._tentative = self._source = None
        self._took(g, [h[6] for h in heads], [h[7] for h in heads], [h[5] for h in heads],
                   src.commits)
        self.save()

    def _back_to_commit(self) -> None:
        """The objects, and the old optimizer's hyperparameters, as committed (what reset
        callbacks see and may change)."""
        rest, objects = self._saved.value(to_devices=True)
        self._objects.clear()
        self._objects.update(objects)
        if self.optimizer is not None:
            for group, kept in zip(self.optimizer.param_groups, rest.get("groups", []),
                                   strict=False):
                group.update({k: v for k, v in kept.items() if k != "params"})

    def _rest_now(self, held: ShardCopy) -> tuple[dict, dict]:
        """The commit's rest with the hyperparameters as the optimizer has them now (a
        reset callback's), and the objects now."""
        rest, _ = held.value()
        if self.optimizer is not None and len(self.optimizer.param_groups) == len(
                rest.get("groups", [])):
            rest = dict(rest)
            rest["groups"] = [{**{k: v for k, v in group.items() if k != "params"},
                               "params": kept["params"]}
                              for group, kept in zip(self.optimizer.param_groups,
                                                     rest["groups"], strict=True)]
        return rest, self._objects

    def _take_memory(self, g: Group, src: Source) -> None:
        """Every rank's rows of the new cut, from the ranks holding the commit's shards."""
        first = min(src.serve.values())
        held: ShardCopy = self._source
        payload = None
        if g.rank == first:
            held.wait()
            rest, objects = self._rest_now(held)
            payload = portable((held.cut.entries, rest, objects))
        entries, rest, objects = g.broadcast_object(payload, src=first)
        rest, objects = placed((rest, objects), g.device)
        dst = targets(self.model, self.optimizer, entries, g.rank, g.world_size)
        rows, rb = sizes(entries)
        plan = routes(rows, src.world, g.world_size, src.serve)
        if any(s == g.rank for s, _ in plan):
            held.wait()
        sends = {d: copy_run(held, entries, src.world, parts)
                 for (s, d), parts in plan.items() if s == g.rank}
        recvs, moved = {}, []
        for (s, d), parts in plan.items():
            if d == g.rank:
                recvs[s] = landing_run(entries, dst, g, parts, moved)
        fan = max([sum(1 for (s, d) in plan if s == r and d != r) for r in range(g.world_size)]
                  + [sum(1 for (s, d) in plan if d == r and s != r)
                     for r in range(g.world_size)] + [1])
        chunk = max(1, config.nbytes("collective.shard-bucket") // fan)
        nbytes = {k: sum((p.stop - p.start) * rb[p.entry] for p in v) for k, v in plan.items()}
        event = transfer(g, sends, recvs, pair_rounds(nbytes, chunk), chunk)
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            for t, tmp, dim in moved:  # rows that arrived with their split dimension first
                t.movedim(dim, 0).copy_(tmp)
        apply_rest(self.model, self.optimizer, rest)
        self._objects.clear()
        self._objects.update(objects)

    def _take_checkpoint(self, g: Group, commits: int) -> None:
        """Every rank reads its rows of checkpoint ``commits``; rank 0 gives its datasets'
        ledger to the scheduler (rows it acknowledged are never delivered again)."""
        blob = self._durable.read_rest(commits)
        entries, rest, objects = placed(blob["rest"], g.device)
        dst = targets(self.model, self.optimizer, entries, g.rank, g.world_size)
        want = {}
        for e, t in zip(entries, dst, strict=True):
            a, _ = span(e.rows, g.world_size, g.rank)
            offs = tuple(a if i == e.dim else 0 for i in range(len(e.shape)))
            want[e.key] = (t, offs)
        self._durable.read_rows(commits, want)
        apply_rest(self.model, self.optimizer, rest)
        self._objects.clear()
        self._objects.update(objects)
        services = _services()
        if g.rank == 0 and services is not None:
            services.restore_ledger(self._id, blob["record"].get("ledger") or {})
            services.state_commits(self._id, committed=True)
        self._announced = True

    def _lost(self, g: Group, src: Source, known: int) -> None:
        if not src.missing:
            self._no_holder(g, known)
        err = CollectiveError(
            f"no member holds shards {list(src.missing)} of commit {src.commits} of "
            f"ShardedState {self._id!r}: every member that held them (the shard's own rank "
            f"and its ring successor) was lost, and no checkpoint holds an earlier commit "
            f"(going on from a fresh state would silently drop what was trained); "
            f"checkpoint_to(url, every=N) keeps one")
        err.transient = False
        raise err

    # -- durable checkpoints: every rank writes its part ---------------------------------
    def _writes_durable(self) -> bool:
        return True

    def _write_durable(self, wait: bool) -> None:
        """This rank's part of the committed copy (its shard, in the cut the commit was
        made in: a commit promoted at a later ``sync()`` keeps its own numbering)."""
        saved = self._saved
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
            rest = portable((cut.entries, _clone(rest_now), _clone(objects)))
        self._durable.write_part(self._id, self._commits, saved.index, cut.world,
                                 cut.generation, chunks, rest, _services(), wait=wait)

    # -- reading the whole model ---------------------------------------------------------
    def full_state_dict(self, optimizer: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers as CPU tensors, on every rank (a
        collective: every rank calls it); keys as ``model.state_dict()``'s. With
        ``optimizer``, also the optimizer's state split with them, under
        ``optimizer.<parameter>.<name>`` (Adam's ``exp_avg``, say)."""
        g = get_group()
        self._require_built(g, "full_state_dict")
        live: Live = capture(self.model, self.optimizer if optimizer else None, g.rank,
                             g.world_size)
        return gather_whole(live, g, list(self.model.state_dict().keys()))


def _held(copy: ShardCopy | None, commits: int) -> list[int]:
    """What ``copy`` holds, as ``sync()`` reports it: [commits, the generation and world
    size of its cut, its own index, the index of its copy] (zeros and -1s: nothing)."""
    if copy is None or copy.cut is None:
        return [0, 0, 0, -1, -1]
    own, peer = copy.held
    return [commits, copy.cut.generation, copy.cut.world, own, peer]

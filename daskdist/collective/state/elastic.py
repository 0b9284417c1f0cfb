"""Elastic training state with Horovod semantics (SPEC §4, §4.1, §4.2).

``State(model, optimizer, **objects)`` keeps a committed copy of the training state:

- ``commit()`` saves a copy, then checks for host updates: one allgather of every
  rank's ``[rows to acknowledge?, membership counter, the previous commit's outcome,
  commit counter, leaving?, joins counter]`` (the counters are those of the closure's
  worker session, ``daskdist.session.counters.membership_version()`` / ``membership_joins()``,
  bumped by the scheduler plugin on every join, leave or retirement), so every rank
  takes rank 0's decision and ``HostsUpdatedInterrupt`` is raised on **all** ranks at
  the same commit, never on some ranks only (which would deadlock the next
  collective). Where a gradient allreduce came since the last commit, ``restore()`` or
  ``sync()``, every rank's head rode it (:class:`_HeadRider`) and the commit makes no
  call of its own: the step's only call is the gradient allreduce. Its ``skip_sync``
  is Horovod's: set when members only left since the group formed (no join), so the
  survivors hold the same commit and the next ``sync()`` skips its broadcast.
- With a ``"dynamic"`` dataset inside the gang, the same commit acknowledges the rows
  each rank consumed since its last commit (see ``daskdist.core.leases.commits``): each
  rank's tokens ride the allgather, packed as int64s (``pack_tokens``) in slots the
  ranks agreed on at the previous commit, and rank 0 sends every rank's part in one
  message (``daskdist_gang_commit``) without waiting; the scheduler applies it at
  once, all or nothing. A part too large for the slots (the next commit's slots grow
  to fit it, up to ``COMMIT_SLOTS_MAX``) makes every rank send its own part instead
  (``daskdist_gang_commit_part``), and the scheduler applies the commit when every part
  came, or refuses it for good when they did not all come within the group's timeout.
  The outcome travels in the next commit's allgather (rank 0's reply, or every rank's,
  so every rank takes the same decision) and the state is promoted then; if a member
  dies meanwhile, or a reply came late, ``restore()`` or ``sync()`` asks the scheduler
  for the commit's (definite) outcome. The allgather is the plain commit's only
  collective call, so acknowledging rows adds no collective call.
- ``restore()`` returns model, optimizer and objects to the last commit and gives back
  the rows consumed since it.
- ``register_reset_callbacks(fns)`` (Horovod's): ``fns`` are called on a rank after
  every re-formation the State lives through (the first ``sync()`` or ``commit()`` on a
  newer generation than the one it last took part in), before the state is
  synchronised: rescale the learning rate to ``get_group().world_size`` there. A State
  made fresh (a replacement's, one made inside the gang closure) calls none.
- ``sync()`` goes back to this rank's last commit, then broadcasts the state of the rank
  holding the *newest* commit (ties: the lowest rank), never a fresh replacement's, and
  records it as the last commit on every rank; nothing is broadcast when every rank
  holds the same commit (after a ``skip_sync`` interrupt, or the survivors of one
  generation after a member's loss: they committed in lockstep). When no rank holds a
  commit although the scheduler recorded commits of this State (every holder was lost,
  or the sole holder retired), it raises ``CollectiveError`` on every rank and the gang fails: never
  a silent fresh start (``State._no_holder`` decides it, in one place).

A State's commits are keyed by its id (minted alike on every rank and replacement: the
per-worker resource, or the gang closure, that made it, and its place among the States
made there), the group generation and a counter the ranks agree on in the commit's
allgather and never reuse, so a second State on the same group (a sweep, a GAN's second
net) never meets the first's keys, and a State that catches ``CollectiveError``,
``restore()``s and goes on in the same generation (Horovod's pattern) commits again. The
first commit of a State on a rank tells the scheduler (once) that it committed.

The state always talks to the group formed *now* (``get_group()`` per call), so one
``State`` survives a re-formation: catch the error, re-form, ``sync()``, continue.
"""

from __future__ import annotations

from typing import Any

import torch

from daskdist.collective.group import Group, get_group
from daskdist.collective.replicas import broadcast_parameters, to_cpu
from daskdist.collective.state.snapshot import HostCopy, like
from daskdist.collective.step import riders
from daskdist.collective.step.later import Late, send_later
from daskdist.core.leases.commits import RankLedger, pack_tokens
from daskdist.core.nest import map_instances
from daskdist.core.protocol import COMMIT_SLOTS_MAX, COMMIT_SLOTS_MIN, CommitKey
from daskdist.errors import (  # defined there: the worker plugin knows them
    CollectiveError,
    HostsUpdatedInterrupt,
)
from daskdist.observe import phases
from daskdist.session.counters import (
    formation_joins,
    formation_version,
    membership_joins,
    membership_version,
)
from daskdist.session.scope import mint_state_id, session_services
from daskdist.session.tokens import consumed_since, record_consumed, take_consumed, take_tokens

_OWN = ("model", "optimizer", "_objects", "_saved", "_spare", "_last_version", "_commits",
        "_synced",
        "_ledger", "_id", "_seq", "_announced", "_durable", "_last_joins", "_generation",
        "_skip", "_reset_callbacks", "_slots", "_marker", "_gathered")


class State:
    """Model, optimizer and named objects of a training loop, committed and restored.

    Objects are attributes: ``State(model, opt, step=0)`` gives ``state.step``.
    """

    _rides = True  # the commit's head may ride the step's gradient allreduce

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **objects: Any,
    ):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_objects", dict(objects))
        # the committed copy, in host memory (collective.snapshot), and the buffers the
        # next commit in flight fills (swapped in when it is confirmed): nothing on the device
        object.__setattr__(self, "_saved", HostCopy())
        object.__setattr__(self, "_spare", HostCopy())
        object.__setattr__(self, "_last_version", membership_version())
        object.__setattr__(self, "_last_joins", membership_joins())
        object.__setattr__(self, "_generation", None)  # the last generation it took part in
        object.__setattr__(self, "_skip", False)  # its last interrupt said skip_sync
        object.__setattr__(self, "_reset_callbacks", [])
        # (generation, int64 slots) of packed tokens in the next commit's allgather
        object.__setattr__(self, "_slots", (None, COMMIT_SLOTS_MIN))
        object.__setattr__(self, "_commits", 0)  # commits behind the saved copy
        object.__setattr__(self, "_synced", False)  # took part in a sync or commit
        object.__setattr__(self, "_ledger", RankLedger())  # a commit in flight
        # the same on every rank and replacement: commit keys, and the scheduler's record
        # of whether this State ever committed (sync() on members holding nothing)
        object.__setattr__(self, "_id", mint_state_id())
        object.__setattr__(self, "_seq", 0)  # the last commit key's counter (never reused)
        object.__setattr__(self, "_announced", False)  # told the scheduler it committed
        object.__setattr__(self, "_durable", None)  # checkpoint_to's: collective.checkpoint
        # commits, restores and syncs so far: a head gathered in a gradient allreduce
        # serves the commit only when none came between them
        object.__setattr__(self, "_marker", 0)
        object.__setattr__(self, "_gathered", None)  # _Gathered: the heads that came
        self.save()

    def checkpoint_to(self, url: str, every: int = 100) -> State:
        """Write every ``every``-th commit durably to ``url`` (any fsspec URL) with
        ``torch.distributed.checkpoint``, in the background, together with the ledger of
        the ``"dynamic"`` datasets trained under this State; returns the State.

        A ``sync()`` whose members hold no commit newer than the newest complete
        checkpoint there (a new cluster, or every holder lost) loads it on every rank,
        and the datasets' epochs go on from its ledger. Call it alike on every rank
        (in the factory that makes the State).
        """
        from daskdist.collective.state.checkpoint import Durable  # imports fsspec and DCP

        object.__setattr__(self, "_durable", Durable(url, every))
        return self

    def register_reset_callbacks(self, callbacks) -> None:
        """Call each of ``callbacks`` (no arguments) on this rank after every
        re-formation of the group this State lives through, before the state is
        synchronised (Horovod's ``State.register_reset_callbacks``): the place to
        rescale a learning rate to the new ``get_group().world_size`` or re-split data.
        Not called on a State's first generation (a fresh State, a replacement's)."""
        if callable(callbacks):
            raise TypeError("register_reset_callbacks takes a list of functions, not one")
        callbacks = list(callbacks)
        for fn in callbacks:
            if not callable(fn):
                raise TypeError(f"reset callback {fn!r} is not callable")
        self._reset_callbacks.extend(callbacks)

    def _enter(self, g: Group) -> bool:
        """The first call of this State on generation ``g.generation``: the membership
        it checks commits against is the one the group formed at (a ``sync()`` skipped
        after a ``skip_sync`` interrupt must not make the next commit interrupt again).
        Whether that is a re-formation it lives through (its reset callbacks are due)."""
        if self._generation == g.generation:
            return False
        renewed = self._generation is not None
        self._generation = g.generation
        version, joins = formation_version(g.generation), formation_joins(g.generation)
        if version is not None:
            self._last_version = version
        if joins is not None:
            self._last_joins = joins
        return renewed

    def _reset(self) -> None:
        for fn in self._reset_callbacks:
            fn()

    # -- objects as attributes ---------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            self._objects[name] = value

    def __repr__(self) -> str:
        names = ", ".join(sorted(self._objects))
        return f"State(model={type(self.model).__name__}, objects=[{names}])"

    @property
    def commits(self) -> int:
        """How many commits the saved state holds (the newest wins at ``sync()``)."""
        return self._commits

    # -- Horovod's API -----------------------------------------------------------

    def _live(self) -> tuple:
        """Model and optimizer state dicts and objects as they are now (references)."""
        return (
            None if self.model is None else self.model.state_dict(),
            None if self.optimizer is None else self.optimizer.state_dict(),
            self._objects,
        )

    def _candidate(self) -> HostCopy:
        """The current state copied into the spare buffers: a commit in flight."""
        spare, self._spare = self._spare, None
        return (spare or HostCopy()).fill(self._live())

    def _refill(self) -> HostCopy:
        """The current state copied into the committed copy, in place: a commit with
        nothing in flight."""
        return self._saved.fill(self._live())

    def save(self) -> None:
        """Copy the current state into the committed copy (no communication): one copy,
        in host memory, refilled in place; from CUDA asynchronously (pinned buffers)."""
        self._saved.fill(self._live())

    @phases.timed(phases.COMMIT, ends_step=True)  # the commit phase; a step (SPEC §5.1)
    def commit(self) -> None:
        """Save (acknowledging rows consumed since the last commit), then raise
        ``HostsUpdatedInterrupt`` on all ranks if hosts changed."""
        g = get_group()
        if self._enter(g):  # a sync() skipped after a skip_sync interrupt
            self._reset()
        gathered, self._gathered = self._gathered, None
        if gathered is not None and gathered.fits(self._marker, g.generation):
            # every rank's head came in this step's gradient allreduce: the rows of the
            # batches trained since it (later ones are the next commit's)
            tokens = take_tokens(gathered.tokens)
            table = gathered.table
        else:
            tokens = take_consumed()
            head = torch.tensor(self._head(g, tokens), dtype=torch.int64)
            try:  # one small call: commit() runs every step
                table = torch.stack(g.allgather(head.to(g.wire_device))).cpu().tolist()
            except BaseException:
                _give_back(tokens)
                raise
        self._marker += 1
        ledger = self._ledger
        heads = [row[:_HEAD] for row in table]
        version, joins = heads[0][1], heads[0][5]
        # every rank takes the same counter, above any key this State ever used
        self._seq = max(h[3] for h in heads) + 1
        # and the same slots for the next commit: what the largest part needed now
        need = max(abs(h[6]) for h in heads)
        self._slots = (g.generation, _slots_for(need))
        if ledger.in_flight:  # the previous commit's outcome, as every rank saw it
            self._confirm(heads[0][2], min(h[2] for h in heads), tokens)
        if any(h[0] for h in heads):
            # rows to acknowledge. Every part fits: rank 0 sends them all in one message;
            # else every rank sends its own. The outcome is taken at the next commit (or
            # by restore() or sync()), so the step does not wait
            key = CommitKey(self._id, g.generation, self._seq)
            try:
                if all(h[6] >= 0 for h in heads):
                    reply = _Told() if g.rank != 0 else _send_commit(
                        key, g.world_size, _parts(table, heads))
                else:
                    reply = session_services().send_commit_part(key, g.rank, g.world_size,
                                                                tokens, g.timeout)
            except BaseException:
                _give_back(tokens)
                raise
            # the state copied after the allgather: it did not change since, and the
            # previous commit's buffers are free now (promoted above, or none in flight)
            ledger.begin(key, tokens, self._candidate(), reply)
            self._synced = True
        else:
            self._promote(self._refill())  # in place: nothing in flight
        self._ride()
        if min(h[4] for h in heads) and self._writes_durable():
            self._checkpoint_last(g)  # every member leaves: none would hold the state
        self._check(version, joins)

    def _head(self, g: Group, tokens: list) -> list[int]:
        """This rank's part of a commit's allgather: ``[rows to acknowledge?, membership
        counter, the previous commit's outcome, commit counter, leaving?, joins counter,
        packed ints used]``, then its packed tokens in the slots the ranks agreed on."""
        ledger = self._ledger
        # the previous commit's reply, waited for at most half the group timeout: the
        # peers already wait in the allgather (rank 0's one message: its reply alone),
        # and must not time out there first
        prev = _NONE if not ledger.in_flight else _outcome(ledger.reply, g.timeout / 2)
        leaving = int(self._durable is not None and _leaving())
        # this rank's tokens ride the allgather when they fit the slots the ranks agreed on
        slots = self._slots[1] if self._slots[0] == g.generation else COMMIT_SLOTS_MIN
        packed = pack_tokens(tokens) if tokens else []
        used = len(packed) if packed is not None else COMMIT_SLOTS_MAX + 1
        head = [int(bool(tokens)), membership_version(), prev, self._seq, leaving,
                membership_joins(), used if used <= slots else -used]
        body = packed if 0 < used <= slots else []
        return head + body + [0] * (slots - len(body))

    def _ride(self) -> None:
        """Every rank's head of the next commit rides the next gradient allreduce of
        this closure (:mod:`~daskdist.collective.step.riders`), when this kind of State
        lets it."""
        if self._rides:
            riders.ride(_HeadRider(self))

    def _confirm(self, first: int, least: int, tokens: list) -> None:
        """The commit in flight's outcome as every rank saw it in an allgather (``first``:
        rank 0's, ``least``: the lowest): promoted when every rank saw it applied; else
        ``CollectiveError`` (it stays in flight, settled later; ``tokens``, the rows of
        the commit being made, go back)."""
        ledger = self._ledger
        if isinstance(ledger.reply, _Told) and first in (_OK, _REFUSED):
            ledger.reply.ok = first == _OK  # rank 0 sent it: its reply told all
        if least != _OK:
            _give_back(tokens)
            raise CollectiveError(
                f"commit {tuple(ledger.key)} was not confirmed on every rank (a member "
                f"left, or its part or the scheduler's reply came late); restore() and "
                f"go on, or re-form and sync()")
        state, _ = ledger.settle(True)
        self._promote(state)

    def _promote(self, snapshot: HostCopy) -> None:
        if snapshot is not self._saved:  # a commit in flight confirmed: swap the buffers
            self._spare, self._saved = self._saved, snapshot
        self._commits += 1
        self._synced = True
        if self._durable is not None and self._durable.due(self._commits) \
                and self._writes_durable():
            self._write_durable(wait=False)
        if not self._announced:  # once: the scheduler's record that this State committed
            services = _services()
            if services is not None:
                services.state_commits(self._id, committed=True)
            self._announced = True

    def _check(self, version: int, joins: int) -> None:
        """Rank 0's counters against the last ones seen: a change interrupts every rank
        (``skip_sync`` when no worker joined: members only left)."""
        changed = version != self._last_version
        skip = joins == self._last_joins
        self._last_version, self._last_joins = version, joins
        self._skip = changed and skip
        if changed:
            what = "workers left" if skip else "workers joined"
            raise HostsUpdatedInterrupt(
                f"{what} (membership version {version}); re-form and sync()", skip_sync=skip)

    def restore(self) -> None:
        """Return model, optimizer and objects to the last commit (no collective call);
        rows consumed since the last commit go back to the pool."""
        self._marker += 1
        self._settle_pending()
        self._load(self._saved)
        back = take_consumed()
        if back:
            session_services().release_tokens(back)

    def _writes_durable(self) -> bool:
        """Whether this rank writes the durable checkpoints (the state is replicated:
        rank 0 alone)."""
        return _rank() == 0

    def _write_durable(self, wait: bool) -> None:
        """Rank 0: the committed copy to the checkpoint store. The write runs in the
        background while later commits refill the buffers, so it gets a copy of its own."""
        model_sd, opt_sd, objects = self._saved.value()
        snapshot = (_clone(model_sd), _clone(opt_sd), _clone(objects))
        self._durable.write(self._id, self._commits, snapshot, _services(), wait=wait)

    def _load(self, saved: HostCopy) -> None:
        """Model, optimizer and objects back to ``saved``: the model copies out of the
        host buffers; the optimizer and the objects, which keep what they are given,
        get fresh tensors on the devices they had."""
        if saved.skeleton is None:
            return
        model_sd, _, _ = saved.value()
        _, opt_sd, objects = saved.value(to_devices=True)
        if self.model is not None and model_sd is not None:
            self.model.load_state_dict(model_sd)
        if self.optimizer is not None and opt_sd is not None:
            self.optimizer.load_state_dict(opt_sd)
        self._objects.clear()
        self._objects.update(objects)

    def _settle_pending(self) -> None:
        """A commit in flight: promote it if the scheduler applied it, else give its
        rows back to the pool."""
        ledger = self._ledger
        if not ledger.in_flight:
            return
        outcome = _outcome(ledger.reply, 60.0)
        if outcome != _OK:
            outcome = _OK if session_services().commit_outcome(ledger.key) else _REFUSED
        candidate = ledger.state
        state, back = ledger.settle(outcome == _OK)
        if state is not None:
            self._promote(state)
        else:
            self._spare = candidate  # refused: its buffers serve the next commit
            if back:
                session_services().release_tokens(back)

    @phases.timed(phases.COMMIT)  # the commit phase of a gang member (SPEC §5.1)
    def sync(self) -> None:
        """Make every rank equal to the newest commit among them, and record that as the
        last commit. Ranks that took part in a commit go back to it first; the source is
        the rank with the most commits (ties: the lowest rank). When no rank holds a
        commit although commits of this State happened, raises ``CollectiveError``
        (never a silent fresh start)."""
        g = get_group()
        self._marker += 1
        # the generation it last took part in: survivors of one generation holding the
        # same count of commits hold the same commit (they committed in lockstep)
        before = -1 if self._generation is None or not self._synced else self._generation
        renewed = self._enter(g)
        self._settle_pending()
        if self._synced:
            self._load(self._saved)
        if renewed:  # Horovod's order: back to the commit, callbacks, then the broadcast
            self._reset()
        # a rank holding no commit asks whether any happened (all lost, or retired)
        known = 0
        if self._commits == 0:
            services = _services()
            known = services.state_commits(self._id) if services is not None else 0
        dev = g.wire_device
        # rank 0 looks for the newest complete checkpoint (it writes them too)
        newest = self._durable.newest() if self._durable is not None and g.rank == 0 else 0
        # skip_sync: this rank's last interrupt said members only left, and it holds a commit
        skip = int(self._skip and self._commits > 0)
        head = torch.tensor([self._commits, membership_version(), self._seq, known, newest,
                             skip, membership_joins(), before], dtype=torch.int64, device=dev)
        heads = g.allgather(head)
        counts = [int(h[0]) for h in heads]
        newest = int(heads[0][4])
        # every rank holds the same commit, none is a newcomer: all were interrupted with
        # skip_sync, or all come from one generation with the same commits (the survivors
        # of a member's loss, every open commit settled above): nothing to broadcast
        lineage = {int(h[7]) for h in heads}
        same = (len(set(counts)) == 1 and counts[0] > 0 and newest <= counts[0]
                and (all(int(h[5]) for h in heads) or (len(lineage) == 1 and -1 not in lineage)))
        if newest > max(counts):  # no member holds a newer commit: resume from it
            if g.rank == 0:
                self._resume(newest)
            counts[0] = newest  # rank 0 holds it now: the source of the broadcast below
        elif max(counts) == 0 and max(int(h[3]) for h in heads) > 0:
            self._no_holder(g, max(int(h[3]) for h in heads))
        src = counts.index(max(counts))
        if not same:
            self._broadcast_from(g, src)
        self._took(g, [int(h[1]) for h in heads], [int(h[6]) for h in heads],
                   [int(h[2]) for h in heads], counts[src])
        self.save()
        self._ride()

    def _took(self, g: Group, versions: list[int], joins: list[int], seqs: list[int],
              commits: int) -> None:
        """A sync's end on every rank: the membership counters it checks commits against
        (the group's formation, else the newest any rank saw), a commit counter above
        any rank's, and ``commits`` held."""
        version = formation_version(g.generation)
        if version is None:
            version = max(versions)
        joined = formation_joins(g.generation)
        if joined is None:
            joined = max(joins)
        self._last_version, self._last_joins, self._skip = version, joined, False
        self._commits = commits
        self._seq = max(seqs)
        self._synced = True

    def _broadcast_from(self, g: Group, src: int) -> None:
        """Every rank takes rank ``src``'s model, optimizer and objects."""
        if self.model is not None:
            broadcast_parameters(self.model, src=src, group=g)
        payload = None
        if g.rank == src:
            opt_sd = None
            if self.optimizer is not None:
                opt_sd = to_cpu(self.optimizer.state_dict())
            payload = (opt_sd, self._objects)
        opt_sd, objects = g.broadcast_object(payload, src=src)
        if g.rank != src:
            if self.optimizer is not None and opt_sd is not None:
                self.optimizer.load_state_dict(opt_sd)
            self._objects.clear()
            self._objects.update(objects)

    def _resume(self, commits: int) -> None:
        """Rank 0: load checkpoint ``commits`` into this rank's model, optimizer and
        objects (``sync()`` then hands it to every rank), and take its datasets' ledger
        to the scheduler (rows it acknowledged are never delivered again; rows
        acknowledged by later, lost commits are delivered again)."""
        model_sd = self.model.state_dict() if self.model is not None else None
        opt_sd, objects, record = self._durable.load(commits, model_sd)
        if self.optimizer is not None and opt_sd is not None:
            self.optimizer.load_state_dict(opt_sd)
        # read onto the CPU: each object's tensors go back where this State keeps them
        objects = like(objects, self._objects)
        self._objects.clear()
        self._objects.update(objects)
        services = _services()
        if services is not None:
            services.restore_ledger(self._id, record.get("ledger") or {})
            services.state_commits(self._id, committed=True)
            self._announced = True

    def _checkpoint_last(self, g: Group) -> None:
        """Rank 0, every member leaving (a preemption notice, a retirement of all): the
        newest commit, settled, is written now and waited for, so the next job resumes
        from it and not from an older checkpoint."""
        self._settle_pending()
        if self._durable.newest() < self._commits:
            self._write_durable(wait=True)

    def _no_holder(self, g: Group, known: int) -> None:
        """No member of ``g`` holds a commit of this State, yet the scheduler recorded
        ``known`` commits of it: every member that held one was lost, or the sole holder
        retired. The one place ``sync()`` decides what then happens (on every rank
        alike): the state is gone, so the gang fails rather than start afresh; its rows
        acknowledged by those commits would never be trained again."""
        err = CollectiveError(
            f"no member holds the committed state of State {self._id!r}: the scheduler "
            f"recorded {known} commit(s) of it, but every member that held them was lost "
            f"or retired, and the {g.world_size} members of generation {g.generation} "
            f"hold none (going on from a fresh state would silently drop what they "
            f"trained, rows acknowledged included); keep a member alive or checkpoint")
        err.transient = False  # a re-run on a re-formed group would meet it again
        raise err


_OK, _REFUSED, _UNKNOWN, _NONE = 1, 0, -1, 2  # a commit's outcome as a rank saw it
# a commit's head: [rows to acknowledge?, membership counter, the previous commit's
# outcome, commit counter, leaving?, joins counter, packed ints used (negative: needed,
# did not fit)], then the slots of the rank's packed tokens
_HEAD = 7


class _Told:
    """The reply of a commit rank 0 sent for every rank (ranks other than 0): the next
    commit's allgather tells its outcome (``ok``); untold, the rank abstains there and
    ``restore()`` or ``sync()`` ask the scheduler."""

    def __init__(self) -> None:
        self.ok: bool | None = None


class _HeadRider:
    """A State's next commit head, riding a gradient allreduce (``riders``): sent with
    the rows this rank consumed so far (left in place: the commit takes exactly those),
    kept as :class:`_Gathered` for the commit, and registered again for the next step's
    call until a commit comes."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.key = f"state:{state._id}"
        self.sent: tuple[int, int, list] | None = None  # (marker, generation, tokens)

    def ints(self) -> list[int]:
        st, g = self.state, get_group()
        tokens = consumed_since(0)
        self.sent = (st._marker, g.generation, tokens)
        return st._head(g, tokens)

    def arrived(self, table: list[list[int]], generation: int) -> None:
        marker, gen, tokens = self.sent
        self.sent = None
        if gen == generation:
            self.state._gathered = _Gathered(marker, gen, table, tokens)
        riders.ride(self)  # the next step's head, unless a commit comes first

    def failed(self) -> None:
        self.sent = None


class _Gathered:
    """Every rank's commit head from a gradient allreduce: the table an allgather would
    give, the State's marker and the group generation then, and this rank's tokens."""

    def __init__(self, marker: int, generation: int, table: list[list[int]],
                 tokens: list) -> None:
        self.marker, self.generation, self.table, self.tokens = (marker, generation, table,
                                                                 tokens)

    def fits(self, marker: int, generation: int) -> bool:
        """Whether it serves the commit now: no commit, restore or sync came since, on
        the same group (the same answer on every rank: they make the same calls)."""
        return self.marker == marker and self.generation == generation


def _slots_for(need: int) -> int:
    """The packed-token slots of the next commit, from the most a rank needed now (a
    power of two; the least when even the most would not fit: those go part by part)."""
    if need > COMMIT_SLOTS_MAX:
        return COMMIT_SLOTS_MIN
    return max(COMMIT_SLOTS_MIN, 1 << max(0, need - 1).bit_length())


def _parts(table: list[list[int]], heads: list) -> list[list[int]]:
    """Every rank's packed tokens from the commit's allgather (rank 0 sends them)."""
    return [row[_HEAD:_HEAD + h[6]] for row, h in zip(table, heads, strict=True)]


def _send_commit(key: CommitKey, world: int, parts: list) -> Late:
    """Rank 0's message of every rank's part of commit ``key``, sent when the synced loop
    is asked for its next batch (:mod:`~daskdist.collective.step.later`): its reply's future."""
    services = session_services()
    return send_later(lambda: services.send_commit(key, world, parts))


def _outcome(reply, timeout: float) -> int:
    """Wait for a commit's reply: ``_OK``, ``_REFUSED`` or ``_UNKNOWN`` (no reply);
    ``_NONE`` for a commit rank 0 sent whose outcome no allgather told yet."""
    if isinstance(reply, _Told):
        return _NONE if reply.ok is None else (_OK if reply.ok else _REFUSED)
    try:
        return _OK if reply.result(timeout) else _REFUSED
    except Exception:  # noqa: BLE001 - a comm error, a timeout: the outcome is unknown
        return _UNKNOWN


def _rank() -> int:
    """This member's rank in the formed group (-1 without one)."""
    try:
        return get_group().rank
    except RuntimeError:
        return -1


def _leaving() -> bool:
    """Whether this worker is leaving (retiring, closing or preempted)."""
    services = _services()
    return bool(services is not None and services.leaving)


def _services():
    """The running closure's session services; ``None`` outside a closure (a State used
    without a coordinator commits locally only)."""
    try:
        return session_services()
    except RuntimeError:
        return None


def _give_back(tokens: list) -> None:
    """Tokens taken for a commit that did not complete go back to the closure's list."""
    for t in tokens:
        record_consumed(t)


def _clone(value: Any) -> Any:
    """``value`` with every tensor cloned (a checkpoint's own copy of host buffers)."""
    return map_instances(lambda t: t.clone(), value, torch.Tensor)

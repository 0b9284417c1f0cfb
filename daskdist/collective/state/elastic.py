"""Elastic training state with Horovod semantics (SPEC §4, §4.1, §4.2): the protocol,
once for every kind of state; what a rank keeps is its keeper's
(:mod:`~daskdist.collective.state.keeper`: a replica's whole state, a sharded model's
shards).

``State(model, optimizer, **objects)`` keeps a committed copy of the training state:

- ``commit()`` copies it, then checks for host updates: one allgather of every rank's
  :class:`~daskdist.collective.state.heads.CommitHead` (rows to acknowledge?, membership
  and joins counters of the closure's worker session, bumped by the scheduler plugin on
  every join, leave or retirement, the previous commit's outcome, commit counter,
  leaving?), so every rank takes rank 0's decision and ``HostsUpdatedInterrupt`` is
  raised on **all** ranks at the same commit, never on some ranks only (which would
  deadlock the next collective). Where a gradient allreduce came since the last commit,
  ``restore()`` or ``sync()``, every rank's head rode it (the closure's
  :class:`~daskdist.collective.step.step.Step`) and the commit makes no call of its own:
  the step's only call is the gradient allreduce. Its ``skip_sync`` is Horovod's: set
  when members only left since the group formed (no join), so the survivors hold the
  same commit and the next ``sync()`` skips its broadcast.
- With a ``"dynamic"`` dataset inside the gang, the same commit acknowledges the rows
  each rank consumed since its last commit (see ``daskdist.core.leases.commits``): each
  rank's tokens ride the allgather, packed as int64s (``pack_tokens``) in slots the
  ranks agreed on at the previous commit, and rank 0 sends every rank's part in one
  message (``daskdist_gang_commit``) without waiting (deferred to the synced loop's
  next batch: :meth:`~daskdist.collective.step.step.Step.defer`); the scheduler applies
  it at once, all or nothing. A part too large for the slots (the next commit's slots
  grow to fit it, up to ``COMMIT_SLOTS_MAX``) makes every rank send its own part instead
  (``daskdist_gang_commit_part``), and the scheduler applies the commit when every part
  came, or refuses it for good when they did not all come within the group's timeout.
  The outcome travels in the next commit's allgather (rank 0's reply, or every rank's,
  so every rank takes the same decision) and the copy is promoted then; if a member dies
  meanwhile, or a reply came late, ``restore()`` or ``sync()`` asks the scheduler for
  the commit's (definite) outcome. A keeper whose copy travels before the commit (a
  sharded one) learns that outcome first, in a small allgather of its own.
- ``restore()`` returns model, optimizer and objects to the last commit and gives back
  the rows consumed since it.
- ``register_reset_callbacks(fns)`` (Horovod's): ``fns`` are called on a rank after
  every re-formation the State lives through (the first ``sync()`` or ``commit()`` on a
  newer generation than the one it last took part in), before the state is
  synchronised: rescale the learning rate to ``get_group().world_size`` there. A State
  made fresh (a replacement's, one made inside the gang closure) calls none.
- ``sync()`` makes every rank equal to the newest commit among the ranks (its keeper
  chooses where it comes from: :class:`~daskdist.collective.state.keeper.Origin`), never
  a fresh replacement's, or to the newest durable checkpoint when that is newer, and
  records it as the last commit on every rank. When no rank holds a commit although the
  scheduler recorded commits of this State (every holder was lost, or the sole holder
  retired), it raises ``CollectiveError`` on every rank and the gang fails: never a
  silent fresh start (``State._lost`` decides it, in one place).

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
from daskdist.collective.state import deadline
from daskdist.collective.state import heads as H
from daskdist.collective.state.heads import (
    CommitHead,
    ConfirmHead,
    SyncHead,
    Told,
    outcome,
    slots_for,
)
from daskdist.collective.state.keeper import CHECKPOINT, LOST, Keeper, Origin, Subject
from daskdist.collective.state.replica import ReplicaKeeper
from daskdist.collective.step.step import Late, Step, this_step
from daskdist.core.leases.commits import RankLedger, pack_tokens
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
from daskdist.session.tokens import record_consumed, take_consumed, take_tokens

__all__ = ["HostsUpdatedInterrupt", "State", "begin"]

_OWN = ("model", "optimizer", "_subject", "_objects", "_keeper", "_last_version",
        "_last_joins", "_generation", "_skip", "_reset_callbacks", "_slots", "_commits",
        "_synced", "_ledger", "_id", "_key", "_seq", "_announced", "_durable")


class State:
    """Model, optimizer and named objects of a training loop, committed and restored.

    Objects are attributes: ``State(model, opt, step=0)`` gives ``state.step``.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **objects: Any,
    ):
        begin(self, ReplicaKeeper(Subject(model, optimizer, dict(objects))))

    @property
    def model(self) -> Any:
        """The model (a ShardedState's: this generation's, after ``sync()``)."""
        return self._subject.model

    @model.setter
    def model(self, value: Any) -> None:
        self._subject.model = value

    @property
    def optimizer(self) -> Any:
        """The optimizer (a ShardedState's: this generation's, after ``sync()``)."""
        return self._subject.optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self._subject.optimizer = value

    def checkpoint_to(self, url: str, every: int = 100) -> State:
        """Write every ``every``-th commit durably to ``url`` (any fsspec URL) with
        ``torch.distributed.checkpoint``, in the background, together with the ledger of
        the ``"dynamic"`` datasets trained under this State; returns the State. Rank 0
        writes a replicated State's; every rank writes its own shard of a ShardedState's,
        and a group of any size resumes from it, resharded.

        A ``sync()`` whose members hold no commit newer than the newest complete
        checkpoint there (a new cluster, or every holder lost) loads it on every rank,
        and the datasets' epochs go on from its ledger. Call it alike on every rank
        (in the factory that makes the State).
        """
        object.__setattr__(self, "_durable", self._keeper.durable(url, every))
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

    @property
    def commit_bytes(self) -> int:
        """Host bytes this rank keeps for commits: the committed copy, and a commit in
        flight's (a replica's: one copy of the whole state, two while a commit is in
        flight; a ShardedState's: its shard and its neighbour's, see there)."""
        return self._keeper.nbytes(self._ledger.state)

    # -- Horovod's API -----------------------------------------------------------

    def save(self) -> None:
        """Keep the current state as the committed copy: in host memory, refilled in
        place (from CUDA asynchronously); a ShardedState's copy to its ring successor
        travels (a collective)."""
        self._keeper.save()

    @phases.timed(phases.COMMIT, ends_step=True)  # the commit phase; a step (SPEC §5.1)
    def commit(self) -> None:
        """Save (acknowledging rows consumed since the last commit), then raise
        ``HostsUpdatedInterrupt`` on all ranks if hosts changed."""
        g = get_group()
        keeper = self._keeper
        keeper.capture(g)
        told = None
        announce = keeper.announce(g) if self._ledger.in_flight else None
        if announce is not None:
            told = self._confirm_early(g, announce)
        keeper.stage(g, told)
        try:
            self._commit(g, keeper, this_step())
        except BaseException:
            keeper.abandon(g)
            raise

    def _commit(self, g: Group, keeper: Keeper, step: Step | None) -> None:
        if self._enter(g):  # a sync() skipped after a skip_sync interrupt
            self._reset()
        gathered = step.gathered(self._key, g.generation) if step is not None else None
        if gathered is not None:
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
        ledger = self._ledger
        heads = [CommitHead.decode(row) for row in table]
        version, joins = heads[0].version, heads[0].joins
        # every rank takes the same counter, above any key this State ever used
        self._seq = max(h.seq for h in heads) + 1
        # and the same slots for the next commit: what the largest part needed now
        self._slots = (g.generation, slots_for(max(abs(h.used) for h in heads)))
        if ledger.in_flight:  # the previous commit's outcome, as every rank saw it
            self._confirm(heads[0].outcome, min(h.outcome for h in heads), tokens)
        if any(h.rows for h in heads):
            # rows to acknowledge. Every part fits: rank 0 sends them all in one message;
            # else every rank sends its own. The outcome is taken at the next commit (or
            # by restore() or sync()), so the step does not wait
            key = CommitKey(self._id, g.generation, self._seq)
            try:
                if all(h.used >= 0 for h in heads):
                    reply = Told() if g.rank != 0 else _send_commit(
                        step, key, g.world_size,
                        [h.part(row) for h, row in zip(heads, table, strict=True)])
                else:
                    reply = session_services().send_commit_part(key, g.rank, g.world_size,
                                                                tokens, g.timeout)
            except BaseException:
                _give_back(tokens)
                raise
            # the state copied after the allgather: it did not change since, and the
            # previous commit's buffers are free now (promoted above, or none in flight)
            ledger.begin(key, tokens, keeper.candidate(), reply)
            self._synced = True
        else:
            self._promote(keeper.refill())  # in place: nothing in flight
            keeper.idle()
        self._ride(step)
        self._check(version, joins, self._leaves(g, keeper, [h.leaving for h in heads]))

    def _leaves(self, g: Group, keeper: Keeper, flags: list[int]) -> bool:
        """Members leaving at this commit (every rank's ``CommitHead.leaving``): all, the
        last holder's checkpoint; some on a preemption deadline, a just-in-time one of
        this commit (:mod:`~daskdist.collective.state.deadline`). Whether all interrupt."""
        durable = self._durable
        writes = durable is not None and keeper.writes_durable(g.rank)
        act = deadline.at_commit(flags, g.rank, writes)
        if writes and act.last:
            self._checkpoint_last()  # every member leaves: none would hold the state
        elif writes and act.write:
            self._settle_pending()  # the commit just sent: its acknowledged rows in the copy
            deadline.write_now(durable, self._commits, act.wait, lambda: keeper.write_durable(
                durable, self._id, self._commits, _services(), wait=False))
        if act.leave:
            deadline.announce()
        return act.interrupt

    def _head(self, g: Group, tokens: list) -> list[int]:
        """This rank's row of a commit's allgather: its :class:`CommitHead`, then its
        packed tokens in the slots the ranks agreed on."""
        ledger = self._ledger
        # the previous commit's reply, waited for at most half the group timeout: the
        # peers already wait in the allgather (rank 0's one message: its reply alone),
        # and must not time out there first
        prev = H.NONE if not ledger.in_flight else outcome(ledger.reply, g.timeout / 2)
        durable = self._durable
        leaving = deadline.flag(durable is not None and _leaving(),  # and how it leaves
                                durable is not None and self._keeper.writes_durable(g.rank),
                                None if durable is None else durable.store.seconds)
        # this rank's tokens ride the allgather when they fit the slots the ranks agreed on
        slots = self._slots[1] if self._slots[0] == g.generation else COMMIT_SLOTS_MIN
        packed = pack_tokens(tokens) if tokens else []
        used = len(packed) if packed is not None else COMMIT_SLOTS_MAX + 1
        head = CommitHead(int(bool(tokens)), membership_version(), prev, self._seq, leaving,
                          membership_joins(), used if used <= slots else -used)
        return head.encode(packed if 0 < used <= slots else [], slots)

    def _ride(self, step: Step | None) -> None:
        """Every rank's head of the next commit rides the next gradient allreduce of
        this closure's step, when this State's keeper lets it."""
        if step is not None and self._keeper.rides:
            step.ride_head(self._key, self._head)

    def _confirm_early(self, g: Group, announce: list[int]) -> list[list[int]]:
        """The commit in flight's outcome, learnt before this commit's copy travels (one
        small allgather of each rank's view of it, as the commit's own head carries,
        and the keeper's ``announce`` ints): once promoted, the commit before it is free
        and its buffers take this one's copy. Every rank's announced ints."""
        mine = ConfirmHead(outcome(self._ledger.reply, g.timeout / 2), tuple(announce))
        heads = [ConfirmHead.decode(t.tolist()) for t in g.allgather(torch.tensor(
            mine.encode(), dtype=torch.int64, device=g.wire_device))]
        self._confirm(heads[0].outcome, min(h.outcome for h in heads), [])
        return [list(h.announced) for h in heads]

    def _confirm(self, first: int, least: int, tokens: list) -> None:
        """The commit in flight's outcome as every rank saw it in an allgather (``first``:
        rank 0's, ``least``: the lowest): promoted when every rank saw it applied; else
        ``CollectiveError`` (it stays in flight, settled later; ``tokens``, the rows of
        the commit being made, go back)."""
        ledger = self._ledger
        if isinstance(ledger.reply, Told) and first in (H.OK, H.REFUSED):
            ledger.reply.ok = first == H.OK  # rank 0 sent it: its reply told all
        if least != H.OK:
            _give_back(tokens)
            raise CollectiveError(
                f"commit {tuple(ledger.key)} was not confirmed on every rank (a member "
                f"left, or its part or the scheduler's reply came late); restore() and "
                f"go on, or re-form and sync()")
        copy, _ = ledger.settle(True)
        self._promote(copy)

    def _promote(self, copy: Any) -> None:
        keeper = self._keeper
        keeper.promote(copy)
        self._commits += 1
        self._synced = True
        if self._durable is not None and self._durable.due(self._commits) \
                and keeper.writes_durable(_rank()):
            keeper.write_durable(self._durable, self._id, self._commits, _services(),
                                 wait=False)
        if not self._announced:  # once: the scheduler's record that this State committed
            services = _services()
            if services is not None:
                services.state_commits(self._id, committed=True)
            self._announced = True

    def _check(self, version: int, joins: int, leaving: bool = False) -> None:
        """Rank 0's counters against the last ones seen: a change interrupts every rank
        (``skip_sync`` when no worker joined: members only left); so do members leaving
        on their deadline (``leaving``)."""
        changed = version != self._last_version or leaving
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
        _forget(self._key)
        self._settle_pending()
        self._keeper.load()
        back = take_consumed()
        if back:
            session_services().release_tokens(back)

    def _settle_pending(self) -> None:
        """A commit in flight: promote it if the scheduler applied it, else give its
        rows back to the pool; then nothing is in flight."""
        ledger = self._ledger
        if ledger.in_flight:
            result = outcome(ledger.reply, 60.0)
            if result != H.OK:
                result = H.OK if session_services().commit_outcome(ledger.key) else H.REFUSED
            copy, back = ledger.settle(result == H.OK)
            if copy is not None:
                self._promote(copy)
            elif back:
                session_services().release_tokens(back)
        self._keeper.idle()

    @phases.timed(phases.COMMIT)  # the commit phase of a gang member (SPEC §5.1)
    def sync(self) -> None:
        """Make every rank equal to the newest commit among them, and record that as the
        last commit. Ranks that took part in a commit go back to it first; the source is
        the keeper's choice (a replica's: the rank with the most commits, ties: the
        lowest). When no rank holds a commit although commits of this State happened,
        raises ``CollectiveError`` (never a silent fresh start)."""
        g = get_group()
        _forget(self._key)
        keeper = self._keeper
        # the generation it last took part in: survivors of one generation holding the
        # same count of commits hold the same commit (they committed in lockstep)
        before = -1 if self._generation is None or not self._synced else self._generation
        renewed = self._enter(g)
        self._settle_pending()
        keeper.rewind(self._synced, renewed)
        if renewed:  # Horovod's order: back to the commit, callbacks, then the broadcast
            self._reset()
        # a rank holding no commit asks whether any happened (all lost, or retired)
        known = 0
        if self._commits == 0:
            services = _services()
            known = services.state_commits(self._id) if services is not None else 0
        # rank 0 looks for the newest complete checkpoint (it writes them too)
        newest = self._durable.newest() if self._durable is not None and g.rank == 0 else 0
        # skip_sync: this rank's last interrupt said members only left, and it holds a commit
        skip = int(self._skip and self._commits > 0)
        head = SyncHead(self._commits, self._seq, membership_version(), membership_joins(),
                        known, newest, skip, before)
        rows = [t.tolist() for t in g.allgather(torch.tensor(
            head.encode() + keeper.report(g, self._commits), dtype=torch.int64,
            device=g.wire_device))]
        heads = [SyncHead.decode(r) for r in rows]
        origin = keeper.choose(g, heads, [r[SyncHead.LEN:] for r in rows])
        if origin.kind == LOST:
            self._lost(g, origin, max(h.known for h in heads))
        record = keeper.take(g, origin, self._durable)
        if origin.kind == CHECKPOINT and record is not None:
            self._resumed(g, record)
        self._took(g, heads, origin.commits)
        self.save()
        self._ride(this_step())

    def _took(self, g: Group, heads: list[SyncHead], commits: int) -> None:
        """A sync's end on every rank: the membership counters it checks commits against
        (the group's formation, else the newest any rank saw), a commit counter above
        any rank's, and ``commits`` held."""
        version = formation_version(g.generation)
        if version is None:
            version = max(h.version for h in heads)
        joined = formation_joins(g.generation)
        if joined is None:
            joined = max(h.joins for h in heads)
        self._last_version, self._last_joins, self._skip = version, joined, False
        self._commits = commits
        self._seq = max(h.seq for h in heads)
        self._synced = True

    def _resumed(self, g: Group, record: dict) -> None:
        """This rank read a checkpoint: rank 0 takes its datasets' ledger to the
        scheduler (rows it acknowledged are never delivered again; rows acknowledged by
        later, lost commits are delivered again) and records that the State committed."""
        services = _services()
        if g.rank == 0 and services is not None:
            services.restore_ledger(self._id, record.get("ledger") or {})
            services.state_commits(self._id, committed=True)
        self._announced = True

    def _checkpoint_last(self) -> None:
        """Every member leaving (a preemption notice, a retirement of all): the newest
        commit, settled, is written now and waited for: the next job resumes from it."""
        self._settle_pending()
        if self._durable.newest() < self._commits:
            self._keeper.write_durable(self._durable, self._id, self._commits, _services(),
                                       wait=True)

    def _lost(self, g: Group, origin: Origin, known: int) -> None:
        """No member of ``g`` holds the newest commit of this State, yet the scheduler
        recorded ``known`` commits of it: every member that held it (or, ``missing``,
        some of its shards) was lost, or the sole holder retired, and no checkpoint
        holds one. The one place ``sync()`` decides what then happens (on every rank
        alike): the state is gone, so the gang fails rather than start afresh; its rows
        acknowledged by those commits would never be trained again."""
        err = CollectiveError(_lost_text(f"{type(self).__name__} {self._id!r}", g, origin,
                                         known))
        err.transient = False  # a re-run on a re-formed group would meet it again
        raise err


def begin(state: State, keeper: Keeper) -> None:
    """Start ``state`` keeping its copies with ``keeper`` (what every kind of State's
    constructor does: a State's with a replica's keeper, a ShardedState's with a shard
    keeper): the protocol's counters, and the live state saved as the committed copy."""
    own = {
        "_keeper": keeper,
        "_subject": keeper.subject,
        "_objects": keeper.subject.objects,  # the named objects: attributes of the State
        "_last_version": membership_version(),
        "_last_joins": membership_joins(),
        "_generation": None,  # the last generation it took part in
        "_skip": False,  # its last interrupt said skip_sync
        "_reset_callbacks": [],
        # (generation, int64 slots) of packed tokens in the next commit's allgather
        "_slots": (None, COMMIT_SLOTS_MIN),
        "_commits": 0,  # commits behind the saved copy
        "_synced": False,  # took part in a sync or commit
        "_ledger": RankLedger(),  # a commit in flight
        # the same on every rank and replacement: commit keys, and the scheduler's record
        # of whether this State ever committed (sync() on members holding nothing)
        "_id": (sid := mint_state_id()),
        "_key": f"state:{sid}",  # its head's place among the step's riders
        "_seq": 0,  # the last commit key's counter (never reused)
        "_announced": False,  # told the scheduler it committed
        "_durable": None,  # checkpoint_to's store (the keeper's kind)
    }
    for name, value in own.items():
        object.__setattr__(state, name, value)
    state.save()


def _lost_text(name: str, g: Group, origin: Origin, known: int) -> str:
    """Why ``sync()`` cannot go on: what nobody holds any more, and what keeps it."""
    if origin.missing:
        return (f"no member holds shards {list(origin.missing)} of commit {origin.commits} "
                f"of {name}: every member that held them (the shard's own rank and the one "
                f"keeping its copy) was lost, and no checkpoint holds an earlier commit "
                f"(going on from a fresh state would silently drop what was trained); "
                f"checkpoint_to(url, every=N) keeps one")
    return (f"no member holds the committed state of {name}: the scheduler recorded "
            f"{known} commit(s) of it, but every member that held them was lost or "
            f"retired, and the {g.world_size} members of generation {g.generation} hold "
            f"none (going on from a fresh state would silently drop what they trained, "
            f"rows acknowledged included); keep a member alive or checkpoint")


def _send_commit(step: Step | None, key: CommitKey, world: int, parts: list) -> Late:
    """Rank 0's message of every rank's part of commit ``key``, sent when the synced loop
    is asked for its next batch (the step's deferred message): its reply's future."""
    services = session_services()

    def send() -> Any:
        return services.send_commit(key, world, parts)

    return step.defer(send) if step is not None else Late.now(send)


def _forget(key: str) -> None:
    """A restore or a sync: a head gathered before serves no commit."""
    step = this_step(create=False)
    if step is not None:
        step.forget(key)


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

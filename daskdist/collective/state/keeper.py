"""The seam of an elastic State: what it keeps of the training state, and how.

:class:`~daskdist.collective.state.elastic.State` runs the protocol once, for every kind
of state: ids and commit counters, membership counters and interrupts, the commit in
flight and its outcome, rows acknowledged, reset callbacks, when durable checkpoints
are written. What differs between a replicated model and a model sharded over the
group is what a rank keeps and how it moves: a :class:`Keeper`, handed to the State by
its constructor (:func:`~daskdist.collective.state.elastic.begin`):

- ``ReplicaKeeper`` (``state/replica.py``): the whole state on every rank, one host copy;
- ``ShardKeeper`` (``sharded/keeper.py``): this rank's shard and its ring predecessor's.

A new kind (a copy of an asynchronously trained global model) is a new keeper and a
thin class that hands it to the State; the State stays as it is.

The operations, in the order a commit and a ``sync()`` call them:

- commit: :meth:`Keeper.capture` the live state; :meth:`Keeper.announce` (a keeper that
  must learn the previous commit's outcome before its copy travels: the State then
  confirms it in an allgather of its own, carrying these ints); :meth:`Keeper.stage`
  what travels before the commit's allgather; then :meth:`Keeper.candidate` (a commit
  in flight: a copy of its own) or :meth:`Keeper.refill` (none in flight: the committed
  copy, in place); :meth:`Keeper.abandon` when the commit failed on this rank;
  :meth:`Keeper.promote` a copy once its commit is confirmed; :meth:`Keeper.idle` when
  no commit is in flight any more (what only a commit in flight needs goes).
- restore: :meth:`Keeper.load`.
- sync: :meth:`Keeper.rewind`; :meth:`Keeper.report` what it holds (ints after the
  :class:`~daskdist.collective.state.heads.SyncHead`); :meth:`Keeper.choose` where the
  newest commit comes from (the same :class:`Origin` on every rank); :meth:`Keeper.take`
  it; then :meth:`Keeper.save`.
- durable: :meth:`Keeper.durable` makes its store, :meth:`Keeper.writes_durable` says
  whether this rank writes, :meth:`Keeper.write_durable` writes its part.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from daskdist.collective.group import Group
from daskdist.collective.state.heads import SyncHead

# where sync() takes the newest commit from (Origin.kind)
SAME = "same"  # every rank holds it: nothing moves
HELD = "held"  # the ranks' copies hold it
CHECKPOINT = "checkpoint"  # the newest durable checkpoint
FRESH = "fresh"  # no commit ever happened: a fresh start
LOST = "lost"  # commits happened, and no rank or checkpoint holds one


class Subject:
    """What a State trains and commits: its model, optimizer and named objects, as the
    loop has them now. The State and its keeper share it; ``objects`` is changed in
    place, never rebound."""

    __slots__ = ("model", "objects", "optimizer")

    def __init__(self, model: Any, optimizer: Any, objects: dict) -> None:
        self.model, self.optimizer, self.objects = model, optimizer, objects

    def replace_objects(self, objects: dict) -> None:
        """The named objects become ``objects`` (in place)."""
        self.objects.clear()
        self.objects.update(objects)


class Origin(NamedTuple):
    """Where ``sync()`` takes the newest commit from, the same on every rank: its kind,
    the commits it holds, the keeper's own plan for moving it (the rank to broadcast
    from; a resharding source), and, lost, the shards nobody holds."""

    kind: str
    commits: int
    plan: Any = None
    missing: tuple[int, ...] = ()


class Keeper(Protocol):
    """What a State keeps of its subject, and how it moves (see the module)."""

    subject: Subject
    rides: bool  # its commit head may ride the step's gradient allreduce

    def capture(self, g: Group) -> None:
        """The live state, as a commit copies it (before the State's reset callbacks)."""
        ...

    def announce(self, g: Group) -> list[int] | None:
        """Ints to send when the State confirms a commit in flight before this commit's
        copy travels; ``None``: no such confirmation (its copy needs none)."""
        ...

    def stage(self, g: Group, told: list[list[int]] | None) -> None:
        """What travels before the commit's allgather (``told``: every rank's announced
        ints, when the State confirmed early)."""
        ...

    def abandon(self, g: Group) -> None:
        """The commit failed on this rank: keep what it staged that other ranks, where
        it completed, may need at the next ``sync()``."""
        ...

    def candidate(self) -> Any:
        """A copy of the captured state for a commit in flight (its own buffers)."""
        ...

    def refill(self) -> Any:
        """The committed copy refilled with the captured state, in place."""
        ...

    def promote(self, copy: Any) -> None:
        """``copy`` (a candidate confirmed, or the refilled copy) is the committed one."""
        ...

    def idle(self) -> None:
        """No commit is in flight: what only a commit in flight needs goes."""
        ...

    def save(self) -> None:
        """The live state becomes the committed copy now (``State.save``)."""
        ...

    def load(self) -> None:
        """The live state back to the committed copy (``State.restore``)."""
        ...

    def rewind(self, synced: bool, renewed: bool) -> None:
        """A ``sync()`` begins: back to the committed copy as far as this keeper goes
        back before its reset callbacks (``synced``: the State took part in a sync or
        commit; ``renewed``: a re-formation it lives through)."""
        ...

    def report(self, g: Group, commits: int) -> list[int]:
        """Its part of the ``sync()``'s allgather: what it holds of ``commits``."""
        ...

    def choose(self, g: Group, heads: list[SyncHead], parts: list[list[int]]) -> Origin:
        """Where the newest commit comes from, from every rank's head and part."""
        ...

    def take(self, g: Group, origin: Origin, durable: Any) -> dict | None:
        """Every rank takes the commit ``origin`` says (a collective); a checkpoint's
        record where this rank read it (rank 0 gives its ledger to the scheduler)."""
        ...

    def durable(self, url: str, every: int) -> Any:
        """The durable store ``checkpoint_to(url, every)`` writes to."""
        ...

    def writes_durable(self, rank: int) -> bool:
        """Whether this rank writes (a part of) the durable checkpoints."""
        ...

    def write_durable(self, durable: Any, state_id: str, commits: int, services: Any,
                      wait: bool) -> None:
        """This rank's part of the committed copy to ``durable``, as commit ``commits``."""
        ...

    def nbytes(self, in_flight: Any) -> int:
        """Host bytes it keeps for commits, ``in_flight`` (a candidate) included."""
        ...

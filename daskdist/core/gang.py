"""GangBook: gang closures and collective-group generations, as a pure state machine.

A gang closure runs one member closure on every member of the collective group at
once (``Coordinator.schedule_on_all``). Gangs run one at a time, in order. A gang whose
member is lost, or whose members report a collective failure or a hosts-updated
interrupt, is *interrupted*: the group is marked broken, and once every member's
closure has ended the group is re-formed from the current workers (generation + 1)
and the gang runs again.

A member's user error on a healthy group *fails* the gang (SPEC §4.2): the group is
marked broken at once, so the scheduler tells the other members (their collective
calls raise ``CollectiveError`` instead of waiting for the group's timeout, and the
next gang runs on a re-formed group), and once every member's closure has ended the
gang fails with that error, never running again. Only a member lost meanwhile turns
it back into an interruption: a peer's death surfaces in a member as whatever the
transport raised (DDP's gloo calls raise a plain ``RuntimeError``), and the dead
member's closure ends only when the scheduler sees the loss, so a gang is never
final before it.

Loss budget (SPEC §4.1): ``max_losses`` bounds the losses of each *rank's* work, not
of the whole gang: a gang of 8 survives 8 different members dying once each, and
fails when the work of one rank killed ``max_losses`` workers (a poison pill). A
member that left as Dask expected (retired, closed) costs nothing. The result of a
gang is the values of the generation that completed it, in rank order (its length is
that generation's size): a member that left is not an error.

Repeat budget: a gang whose runs keep failing with a ``CollectiveError`` while
no worker joins or leaves (rank-dependent control flow: rank 0 calls ``allreduce``, the
others do not; a CPU tensor handed to NCCL) would fail the same way on every re-formed
group. After ``max_losses`` such runs in a row it fails with the first failure of the
last run, naming its rank and saying that it repeats. A run that saw a member lost, a
hosts-updated interrupt or any membership change (:meth:`GangBook.membership_changed`),
or a run over other members than the last one, starts the count again.

A broken generation's word travels down a tree over its ranks
(:func:`relay_children`): the scheduler tells at most ``fanout`` members, each passes
it on to as many more, so a loss costs the scheduler O(fanout) messages however wide
the group. A lost rank passes nothing on: the scheduler tells its children in its
place (:func:`tell_targets`), at the first loss and at each later one.

No Dask, no I/O: the scheduler plugin asks :meth:`GangBook.next_step` what to do
(form a group, dispatch a gang) and feeds back what happened. Member closures live
in the :class:`~daskdist.core.queue.ClosureQueue` pinned to their sessions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from daskdist.core.protocol import (
    COLLECTIVE_ERROR,
    COLLECTIVE_REPEATED,
    FAILED,
    HOSTS_UPDATED,
    READY,
    USER_ERROR,
    WORKER_LOST,
    Outcome,
)

INTERRUPTING = frozenset({COLLECTIVE_ERROR, HOSTS_UPDATED, WORKER_LOST})


def member_cid(gang_cid: str, generation: int, rank: int) -> str:
    """The id of rank ``rank``'s member closure of a gang's run on ``generation``."""
    return f"{gang_cid}@{generation}#{rank}"


@dataclass
class Gang:
    cid: str
    owner: str
    payload: Any
    attempt: int = 0
    losses: dict[int, int] = field(default_factory=dict)  # rank -> its work's worker losses
    spared: set[int] = field(default_factory=set)  # ranks whose worker left as expected
    generation: int = 0
    members: dict[str, int] = field(default_factory=dict)  # member cid -> rank
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, tuple[Any, str]] = field(default_factory=dict)
    interrupted: bool = False
    failed: int | None = None  # the rank whose user error fails this attempt
    # the repeat budget: runs in a row that failed with a collective error alone, over
    # ``sessions``; the first such error of this run; membership changed during this run
    repeats: int = 0
    sessions: tuple[str, ...] = ()
    first_collective: tuple[int, Any] | None = None
    changed: bool = False


def relay_children(rank: int, world: int, fanout: int) -> range:
    """The ranks that ``rank`` passes a broken generation's word on to: its children in
    a ``fanout``-ary tree over the ranks, rooted at the scheduler (whose children are
    ranks ``0 .. fanout-1``; rank ``r`` is node ``r + 1``). A group of at most
    ``fanout`` members is told by the scheduler alone."""
    lo = min((rank + 1) * fanout, world)
    return range(lo, min(lo + fanout, world))


def tell_targets(ranks: Iterable[int], world: int, fanout: int,
                 lost: Callable[[int], bool]) -> list[int]:
    """The ranks the scheduler tells itself so that the word, passed down the tree
    (:func:`relay_children`) by every rank it reaches, reaches every live rank below
    ``ranks``: each live one, and for a lost one (which passes nothing on) its children
    in its place. O(what it returns + fanout × the lost ranks it meets), never O(world)
    for a group wider than ``fanout``."""
    out: list[int] = []
    todo, seen = list(ranks), set()
    for r in todo:  # breadth first: grows as lost ranks hand their children on
        if r in seen:
            continue
        seen.add(r)
        if lost(r):
            todo.extend(relay_children(r, world, fanout))
        else:
            out.append(r)
    return out


@dataclass
class GroupRecord:
    """The collective group as the scheduler sees it."""

    generation: int = 0
    sessions: tuple[str, ...] = ()
    backend: str = "auto"
    timeout: float = 60.0
    broken: bool = True  # no usable group yet
    why: str = ""  # why this generation broke (what its members' collective calls say)
    ranks: dict[str, int] = field(default_factory=dict)  # session -> rank, per generation


@dataclass
class GangBook:
    """Pending and running gangs plus the current group generation."""

    max_losses: int = 3
    group: GroupRecord = field(default_factory=GroupRecord)
    pending: deque[Gang] = field(default_factory=deque)
    running: Gang | None = None
    forming: bool = False

    def submit(self, cid: str, owner: str, payload: Any) -> None:
        self.pending.append(Gang(cid, owner, payload))

    def configure(self, backend: str, timeout: float) -> None:
        self.group.backend = backend
        self.group.timeout = timeout

    # -- what to do next ---------------------------------------------------------------
    def needs_formation(self, sessions: tuple[str, ...]) -> bool:
        """Whether the group must be (re-)formed before the next gang runs."""
        return self.group.broken or self.group.sessions != sessions

    def begin_formation(self, sessions: tuple[str, ...], generation: int | None = None) -> int:
        """Start forming a new generation over ``sessions`` (in rank order).

        ``generation`` must grow; by default it is the previous one plus one.
        """
        self.forming = True
        self.group.generation = max(self.group.generation + 1, generation or 0)
        self.group.sessions = sessions
        self.group.ranks = {s: rank for rank, s in enumerate(sessions)}
        self.group.broken = True
        return self.group.generation

    def formation_done(self, generation: int, ok: bool) -> None:
        if generation == self.group.generation:
            self.group.broken = not ok
            self.group.why = "" if ok else f"generation {generation} did not form"
        self.forming = False

    def start_next(self) -> tuple[Gang, list[tuple[str, str, int]]] | None:
        """Dispatch the next gang on the (formed) group: ``[(member cid, session, rank)]``."""
        if self.running is not None or not self.pending or self.group.broken or self.forming:
            return None
        gang = self.pending.popleft()
        gang.attempt += 1
        gang.generation = self.group.generation
        gang.interrupted = False
        gang.failed = None
        if gang.sessions != self.group.sessions:  # other members: the count starts again
            gang.repeats = 0
        gang.sessions = self.group.sessions
        gang.first_collective = None
        gang.changed = False
        gang.spared.clear()
        gang.results.clear()
        gang.errors.clear()
        members = [(member_cid(gang.cid, gang.generation, rank), s, rank)
                   for rank, s in enumerate(self.group.sessions)]
        gang.members = {m: rank for m, _, rank in members}
        self.running = gang
        return gang, members

    # -- what happened -------------------------------------------------------------------
    def member_finished(self, member_cid: str, ok: bool, value: Any,
                        kind: str | None) -> Outcome | None:
        """A member closure ended; returns the gang's outcome once it is final."""
        gang = self.running
        if gang is None or member_cid not in gang.members:
            return None  # a member of an earlier attempt
        rank = gang.members.pop(member_cid)
        if ok:
            gang.results[rank] = value
            return self._maybe_final(gang)
        kind = kind or USER_ERROR
        gang.errors[rank] = (value, kind)
        if kind == COLLECTIVE_ERROR and gang.first_collective is None:
            gang.first_collective = (rank, value)
        if kind == WORKER_LOST or (gang.failed is None and (kind in INTERRUPTING
                                                             or self.group.broken)):
            gang.interrupted = True
            self._break(f"rank {rank} of gang {gang.cid} was interrupted ({kind})")
            if kind == WORKER_LOST and rank not in gang.spared:
                gang.losses[rank] = gang.losses.get(rank, 0) + 1
        elif gang.failed is None and not gang.interrupted:
            gang.failed = rank  # a user error on a healthy group: the gang fails
            self._break(f"rank {rank} of gang {gang.cid} raised an error ({kind}): "
                        "the gang fails")
        return self._maybe_final(gang)

    def session_lost(self, session: str, expected: bool = False) -> bool:
        """A member's worker left: the group is broken. True if it was a group member.

        ``expected`` (Dask retired or closed it): its rank's work is not charged a loss.
        """
        rank = self.group.ranks.get(session)
        if rank is None:
            return False
        self._break(f"the worker of rank {rank} left")
        if self.running is not None:
            self.running.interrupted = True
            if expected and self.running.generation == self.group.generation:
                self.running.spared.add(rank)
        return True

    def membership_changed(self) -> None:
        """A worker joined, left or started retiring: the running gang's run does not
        count against the repeat budget (the next run meets other members)."""
        if self.running is not None:
            self.running.changed = True

    def _break(self, why: str) -> None:
        if not self.group.broken:
            self.group.broken = True
            self.group.why = why

    def fail_pending(self, error: Any, kind: str) -> list[Outcome]:
        """Fail every gang not yet dispatched with ``error`` (the group cannot form)."""
        out = [Outcome(g.cid, FAILED, error, kind, g.attempt, g.owner) for g in self.pending]
        self.pending.clear()
        return out

    def _maybe_final(self, gang: Gang) -> Outcome | None:
        if gang.members:
            return None  # members still running
        self.running = None
        if gang.interrupted:
            worst = max(gang.losses.values(), default=0)
            if worst >= self.max_losses:
                rank = min(r for r, n in gang.losses.items() if n == worst)
                return Outcome(gang.cid, FAILED, f"the workers running rank {rank} of the "
                               f"gang were lost {worst} times", WORKER_LOST, gang.attempt,
                               gang.owner)
            repeated = self._repeated(gang)
            if repeated is not None:
                return repeated
            self.pending.appendleft(gang)  # runs again on the re-formed group
            return None
        if gang.failed is not None:
            value, kind = gang.errors[gang.failed]
            return Outcome(gang.cid, FAILED, value, kind, gang.attempt, gang.owner)
        values = [gang.results[r] for r in sorted(gang.results)]
        return Outcome(gang.cid, READY, values, None, gang.attempt, gang.owner)

    def _repeated(self, gang: Gang) -> Outcome | None:
        """Count an interrupted run against the repeat budget; the gang's failure once
        ``max_losses`` runs in a row failed with a collective error alone."""
        membership = gang.changed or gang.spared or any(
            kind in (WORKER_LOST, HOSTS_UPDATED) for _, kind in gang.errors.values())
        if membership or gang.first_collective is None:
            gang.repeats = 0
            return None
        gang.repeats += 1
        if gang.repeats < self.max_losses:
            return None
        rank, first = gang.first_collective
        summary = (f"gang {gang.cid} failed {gang.repeats} runs in a row with a collective "
                   f"error while no worker joined or left (max_worker_failures="
                   f"{self.max_losses}): the failure repeats, so running it again cannot "
                   f"help (do all ranks make the same collective calls, on tensors of the "
                   f"group's device?); rank {rank} failed first in the last run")
        return Outcome(gang.cid, FAILED, [summary, first], COLLECTIVE_REPEATED, gang.attempt,
                       gang.owner)

    def cancel_pending(self, owner: str | None = None) -> list[Gang]:
        """Drop gangs not yet dispatched (of ``owner``, or all)."""
        out = [g for g in self.pending if owner is None or g.owner == owner]
        self.pending = deque(g for g in self.pending if g not in out)
        return out

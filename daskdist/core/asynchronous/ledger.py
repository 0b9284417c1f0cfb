"""The scheduler's bookkeeping of one asynchronously trained model (pure): who holds it,
its versions, which pushes wait for durability, and what it reports.

The global model lives on a worker (the *holder*), with a *standby* copy on another;
this ledger holds no tensor. It decides what happens to the rows each push consumed:

- A push is *staged* when the holder receives it, before it applies it: its rows
  already moved from the pushing worker's session to the model's (the book does that,
  :meth:`LeaseTable.transfer_tokens`), so losing the pusher gives nothing back.
- The holder decides it: *refused* (staleness over ``max_staleness``, a bad delta):
  its rows go back; *applied* as version ``v``.
- An applied push is *durable* once a holder loss can no longer drop it: the standby
  reported a copy at a version ``>= v``, or a checkpoint at ``>= v`` is complete, or
  no other worker could keep a copy (alone, the checkpoint is the only net). Only
  then are its rows acknowledged.
- The holder lost: the newest of the standby's copy and the checkpoint is where the
  model goes on (:meth:`holder_lost` plans it, :meth:`recovered` settles it). Pushes
  applied after it are gone: their rows go back. Loading a checkpoint also restores
  its dataset ledger (rows acknowledged after it are free again). With neither, once
  a push was durable (rows acknowledged), the model *fails*: never a silent fresh
  start. Before that, nothing is lost by starting from the factory again.
- The holder's worker got a preemption deadline: it *hands over* first
  (:meth:`hand_over`): it applies nothing more, its standby takes its state with every
  push it applied, and the model moves there as after a loss, losing nothing.

So at every moment the rows acknowledged for a model are those of deltas that survive
any single loss, and when everything is durable, exactly those of the deltas in the
global model (``tests/test_async_ledger.py`` drives random schedules against it).

Versions never go back: a recovery serves ``max(newest version, origin) + 1``, and the
*incarnation* bumps, so workers' cached pulls of a lost holder's versions refetch.
Imports nothing from Dask, torch or the rest of the package.
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from daskdist.core.asynchronous.protocol import CHECKPOINT, COPY, FRESH

# a push's states
STAGED, APPLIED, DURABLE, REFUSED, RELEASED = "staged", "applied", "durable", "refused", "released"
# the model's phases
STARTING, READY, MOVING, FAILED = "starting", "ready", "moving", "failed"


@dataclass
class PushRecord:
    """One push the holder received: its rows (lease tokens) wait with it."""

    pid: str
    pusher: str  # the pushing closure's worker session
    address: str  # its worker
    tokens: list
    rows: int
    base: int  # the version it pulled
    state: str = STAGED
    version: int = 0  # the version it was applied as
    counted: bool = False  # its round is in the statistics


@dataclass
class Settle:
    """What a transition asks of the rows: pushes to acknowledge, pushes to give back,
    and a checkpoint's dataset ledger to restore (``None``: none)."""

    ack: list[PushRecord] = field(default_factory=list)
    release: list[PushRecord] = field(default_factory=list)
    restore: dict | None = None

    def __bool__(self) -> bool:
        return bool(self.ack or self.release or self.restore)


@dataclass
class Recovery:
    """How a lost holder's model goes on: from ``source`` (COPY, CHECKPOINT or FRESH) on
    ``target`` (a session; ``None``: the book picks a live member), serving
    ``version`` as incarnation ``incarnation``; ``source == ""``: it cannot (``reason``)."""

    source: str
    target: str | None
    version: int
    incarnation: int
    reason: str = ""


@dataclass
class WorkerTally:
    """One worker's rounds (decided pushes), by address."""

    rounds: int = 0
    rows: int = 0  # rows of its applied pushes
    refused: int = 0
    bytes: int = 0  # bytes its rounds moved (pull fetches and pushes)


class Paces:
    """Each worker's inner steps a second (smoothed over its rounds) and the fastest's:
    dynamic local updates scale a worker's suggested steps by its share of the fastest.
    The fastest is kept in a lazy max-heap: O(log workers) a round, whatever changes."""

    def __init__(self) -> None:
        self.of: dict[str, float] = {}
        self._fastest: list[tuple[float, str]] = []  # (-pace, worker), stale ones too

    def measured(self, address: str, steps: int, seconds: float) -> None:
        """A round of ``steps`` inner steps took ``seconds`` on worker ``address``."""
        if steps <= 0 or seconds <= 0:
            return
        old = self.of.get(address, 0.0)
        pace = steps / seconds if old == 0 else 0.5 * old + 0.5 * steps / seconds
        self.of[address] = pace
        heapq.heappush(self._fastest, (-pace, address))
        if len(self._fastest) > 4 * len(self.of) + 16:  # mostly stale entries: rebuilt
            self._fastest = [(-v, a) for a, v in self.of.items()]
            heapq.heapify(self._fastest)

    def forget(self, address: str) -> None:
        """Worker ``address`` is gone: its pace scales no one's steps any more (its heap
        entries are stale now, dropped as they surface)."""
        self.of.pop(address, None)

    def share(self, address: str) -> float:
        """``address``'s pace over the fastest worker's (1.0 when not measured)."""
        heap = self._fastest
        while heap and self.of.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)  # its worker's pace changed since
        pace = self.of.get(address, 0.0)
        if not heap or pace <= 0:
            return 1.0
        return min(1.0, pace / -heap[0][0])


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


class ModelLedger:
    """One model's holder, versions, pushes and figures (see the module doc)."""

    def __init__(self, model: str, owner: str, max_staleness: int,
                 keep: int = 65536, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.owner = owner
        self.replica = ""  # the per-worker resource of its replicas: it goes with it
        self.max_staleness = max_staleness
        self.phase = STARTING
        self.failed = ""
        self.holder: str | None = None  # session
        self.standby: str | None = None
        self.standby_version: int | None = None  # the standby's copy (None: none yet)
        self.target: str | None = None  # the session a recovery was sent to
        self.incarnation = 0
        self.served = 0  # the incarnation of the holder that served last (its copies count)
        # the past incarnations whose states the model descends from, oldest first:
        # [model id, incarnation, the newest version of theirs it holds]; only their
        # checkpoints up to that version (and any of the last holder's) may be loaded
        self.chain: list[list] = []
        self.any_checkpoint = False  # a resumed job: the newest checkpoint, whoever wrote it
        self.version = 0  # the newest version known: never goes back
        self.durable = 0  # every applied version up to this survives a holder loss
        self.checkpoint: tuple[str, int] | None = None  # (url, every)
        self.checkpointed = 0  # the newest complete checkpoint's version (0: none known)
        self.nbytes = 0  # the parameters' bytes (what a pull moves)
        self.pushes: OrderedDict[str, PushRecord] = OrderedDict()
        self.open: dict[str, PushRecord] = {}  # staged or applied, not settled
        self.keep = keep
        self.clock = clock
        # figures
        self.applied = 0
        self.refused = 0
        self.rows = 0  # rows of applied pushes
        self.released_rows = 0  # rows given back (refused, or lost with a holder)
        self.lost_rows = 0  # of them, rows of applied deltas lost with a holder
        self.holder_losses = 0
        self.handovers = 0  # moves to the standby before a holder's deadline
        self.handed: tuple[str, int] | None = None  # the last (holder, incarnation) that did
        self.workers: dict[str, WorkerTally] = {}
        self.paces = Paces()  # the workers' inner steps a second (dynamic local updates)
        self.staleness: deque[int] = deque(maxlen=4096)
        self.max_seen_staleness = 0
        self.times: deque[tuple[float, int]] = deque(maxlen=256)  # (when, version) applied
        self.scheduler_bytes = 0  # bytes of this model's messages through the scheduler

    # -- the holder's pushes ---------------------------------------------------------------
    def may_stage(self, holder: str, incarnation: int, pid: str) -> tuple[str, PushRecord | None]:
        """Whether the holder ``holder`` (of ``incarnation``) may stage push ``pid``:
        ``("", None)`` yes; ``("duplicate", record)`` it was staged before (a retried
        push: its fate is the record's); else ``(why not, None)``."""
        rec = self.pushes.get(pid)
        if rec is not None:
            return "duplicate", rec
        if self.phase == FAILED:
            return self.failed, None
        if self.phase != READY:
            return f"model {self.model} is moving to a new holder", None
        if holder != self.holder or incarnation != self.incarnation:
            return f"the caller is not the holder of model {self.model} now", None
        return "", None

    def stage(self, rec: PushRecord) -> None:
        """``rec``'s rows are the model's now (the book moved them)."""
        self.pushes[rec.pid] = self.open[rec.pid] = rec
        self._prune()

    def abandon(self, rec: PushRecord) -> None:
        """A push its worker gave up before any holder staged it (its rows went back
        from the worker's session): a later stage of it is refused."""
        rec.state = RELEASED
        self.pushes[rec.pid] = rec
        self._prune()

    def decided(self, holder: str, incarnation: int, pid: str, applied: bool, version: int,
                staleness: int, alone: bool, round_bytes: int = 0) -> Settle:
        """The holder applied push ``pid`` as ``version``, or refused it. ``alone``: no
        other worker can keep a copy, so an applied push is durable at once."""
        rec = self.pushes.get(pid)
        if rec is None or holder != self.holder or incarnation != self.incarnation:
            if rec is not None and (holder, incarnation) == self.handed:
                # decided before its holder handed over: the copy settles its rows
                self._count(rec, applied, staleness, round_bytes)
            return Settle()
        self._count(rec, applied, staleness, round_bytes)
        if rec.state != STAGED:
            return Settle()  # a standby's copy named it first
        if not applied:
            rec.state = REFUSED
            del self.open[pid]
            self.released_rows += rec.rows
            return Settle(release=[rec])
        rec.state, rec.version = APPLIED, version
        self._newer(version)
        if alone:
            self.durable = max(self.durable, version)
        return self._settle_through(self.durable)

    def _count(self, rec: PushRecord, applied: bool, staleness: int,
               round_bytes: int) -> None:
        if rec.counted:
            return
        rec.counted = True
        w = self._tally(rec.address)
        w.rounds += 1
        w.bytes += round_bytes
        if applied:
            w.rows += rec.rows
            self.applied += 1
            self.rows += rec.rows
            self.staleness.append(staleness)
            self.max_seen_staleness = max(self.max_seen_staleness, staleness)
        else:
            w.refused += 1
            self.refused += 1

    def _newer(self, version: int) -> None:
        if version > self.version:
            self.version = version
        self.times.append((self.clock(), version))

    def copied(self, standby: str, incarnation: int, version: int,
               applied: list[tuple[str, int]]) -> Settle:
        """The standby holds the holder's state at ``version``, with the pushes
        ``applied`` in it since its copy before."""
        if standby != self.standby or incarnation != self.served or self.phase == FAILED:
            return Settle()  # (while moving: the copy the lost holder sent last counts)
        self.note_applied(applied)
        self.standby_version = version
        self.durable = max(self.durable, version)
        return self._settle_through(self.durable)

    def note_applied(self, applied: list[tuple[str, int]]) -> None:
        """The holder says it applied these pushes (``(pid, version)``), maybe before its
        decisions arrive: a copy lists them, and so does a checkpoint's ledger request."""
        for pid, v in applied:
            rec = self.open.get(pid)
            if rec is not None and rec.state == STAGED:
                rec.state, rec.version = APPLIED, int(v)
                self._newer(int(v))

    def checkpointed_at(self, version: int) -> Settle:
        """A checkpoint of the model at ``version`` is complete (it holds every push
        applied up to it, and its ledger their rows)."""
        self.checkpointed = max(self.checkpointed, version)
        self.durable = max(self.durable, version)
        return self._settle_through(self.durable)

    def _settle_through(self, version: int) -> Settle:
        out = Settle()
        for pid, rec in list(self.open.items()):
            if rec.state == APPLIED and rec.version <= version:
                rec.state = DURABLE
                del self.open[pid]
                out.ack.append(rec)
        return out

    def pending_rows(self, through: int) -> list[PushRecord]:
        """Applied pushes not yet acknowledged, up to version ``through``: what a
        checkpoint at ``through`` holds beyond the rows acknowledged now."""
        return [r for r in self.open.values() if r.state == APPLIED and r.version <= through]

    # -- losses and recoveries ---------------------------------------------------------------
    def holder_lost(self, alive: Callable[[str], bool]) -> Recovery:
        """The holder's session ended: where the model goes on (``alive(session)``: a
        session is still a member). The model is *moving* until :meth:`recovered`."""
        self.holder_losses += 1
        return self._move(alive)

    def hand_over(self, holder: str, incarnation: int, version: int) -> Recovery | str:
        """The holder leaves before its worker's deadline: it applies nothing more, and
        its standby took its state at ``version`` (every push it applied). The model
        moves to the standby from that copy, losing nothing (*moving* until
        :meth:`recovered`); or why it cannot (it serves on)."""
        if self.phase != READY or holder != self.holder or incarnation != self.incarnation:
            return f"the caller is not the serving holder of model {self.model}"
        if self.standby is None or version < self.version:
            return f"model {self.model} has no standby with a copy at version {self.version}"
        self.standby_version = max(self.standby_version or 0, version)
        self.handed = (holder, incarnation)
        self.handovers += 1
        return self._move(lambda s: s == self.standby)

    def _move(self, alive: Callable[[str], bool]) -> Recovery:
        self.phase = MOVING
        self.holder = None
        self.incarnation += 1
        version = self.version + 1
        copy = self.standby_version if (self.standby is not None and alive(self.standby)) \
            else None
        if copy is not None and (self.checkpoint is None or copy >= self.checkpointed):
            self.target = self.standby
            return Recovery(COPY, self.standby, version, self.incarnation)
        if self.checkpoint is not None:
            keep = self.standby if self.standby is not None and alive(self.standby) else None
            self.target = keep
            return Recovery(CHECKPOINT, keep, version, self.incarnation)
        if self.durable == 0:
            # no push was ever durable, so no row was acknowledged: those it applied go
            # back with their pushes, and the model starts again from its factory
            self.target = keep = self.standby if self.standby is not None and alive(
                self.standby) else None
            return Recovery(FRESH, keep, version, self.incarnation)
        why = (f"every holder of asynchronous model {self.model} was lost (version "
               f"{self.version}; its standby had no copy) and no checkpoint_to was set: "
               "its global model is gone. Set am.checkpoint_to(url, every=N) to survive "
               "this; daskdist never starts it afresh silently")
        return Recovery("", None, version, self.incarnation, why)

    def lineage(self) -> list | None:
        """The checkpoints a recovery may load: ``[[model id, incarnation, the newest
        version], ...]`` (``-1``: any version); ``None``: any checkpoint (a resumed job).
        A checkpoint written by a holder whose state the model no longer descends from
        (its report lost, a copy older than it taken over) holds pushes whose rows went
        back: loading it would train them twice."""
        if self.any_checkpoint:
            return None
        return [*self.chain, [self.model, self.served, -1]]

    def reload(self) -> Recovery:
        """The owner set a checkpoint URL before anything was applied: the holder loads
        the newest checkpoint there, if any (a job resumed on a new cluster)."""
        self.any_checkpoint = True
        self.phase = MOVING
        self.incarnation += 1
        self.target = self.holder
        self.holder = None
        return Recovery(CHECKPOINT, self.target, self.version, self.incarnation)

    def aim(self, target: str) -> None:
        """The book sent the recovery to ``target``."""
        self.target = target

    def recovered(self, session: str, incarnation: int, version: int, origin: int,
                  source: str, ledger: dict, error: str = "",
                  loaded: list | None = None) -> Settle:
        """The recovery's target serves (or could not, ``error``): its content is the
        state at ``origin``, from ``source`` (a checkpoint: the one ``loaded``, ``[model
        id, incarnation]`` of its writer). Pushes applied up to ``origin`` are in it
        (acknowledged); the others are lost (given back)."""
        if self.phase not in (MOVING, STARTING) or session != self.target \
                or incarnation != self.incarnation:
            return Settle()
        if not error and source == FRESH and self.durable:
            error = (f"no checkpoint of asynchronous model {self.model} was found under "
                     f"{self.checkpoint[0] if self.checkpoint else '?'} and its holder "
                     f"was lost at version {self.version}: daskdist never starts it "
                     "afresh silently")
        if error:
            return self.fail(error)
        out = Settle()
        for pid, rec in list(self.open.items()):
            del self.open[pid]
            if rec.state == APPLIED and rec.version <= origin:
                rec.state = DURABLE
                out.ack.append(rec)
            else:
                self.lost_rows += rec.rows if rec.state == APPLIED else 0
                rec.state = RELEASED
                self.released_rows += rec.rows
                out.release.append(rec)
        if source == CHECKPOINT:
            self.durable = origin
            self.checkpointed = max(self.checkpointed, origin)
            out.restore = ledger or None
            self.chain = self._cut(loaded, origin)
        elif source == COPY:
            self.durable = max(self.durable, origin)
            self.chain = [*self.chain, [self.model, self.served, origin]]
        elif self.phase == MOVING:  # fresh: it descends from nothing
            self.chain = []
        self.any_checkpoint = False
        # a new incarnation: its standby (maybe the same worker) takes its copies anew
        self.standby, self.standby_version = None, None
        self.phase = READY
        self.holder, self.target = session, None
        self.served = incarnation
        self._newer(version)
        return out

    def _cut(self, loaded: list | None, origin: int) -> list:
        """The chain once checkpoint ``loaded`` (at ``origin``) was loaded: what it
        descends from, and it."""
        if not loaded:
            return []
        key = [str(loaded[0]), int(loaded[1])]
        out = []
        for entry in [*self.chain, [self.model, self.served, -1]]:
            if entry[:2] == key:
                break
            out.append(entry)
        else:
            out = []  # a resumed job's: what it descends from is not known here
        return [*out, [*key, origin]]

    def standby_lost(self) -> None:
        self.standby, self.standby_version = None, None

    def set_standby(self, session: str | None) -> None:
        if session != self.standby:
            self.standby, self.standby_version = session, None

    def fail(self, reason: str) -> Settle:
        """The model cannot go on (or its owner dropped it): every open push's rows go
        back."""
        self.phase, self.failed = FAILED, reason
        self.holder = self.standby = self.target = None
        out = Settle(release=list(self.open.values()))
        for rec in out.release:
            self.lost_rows += rec.rows if rec.state == APPLIED else 0
            rec.state = RELEASED
            self.released_rows += rec.rows
        self.open.clear()
        return out

    def _prune(self) -> None:
        """Keep at most ``keep`` settled pushes (for retried pushes' fates)."""
        while len(self.pushes) > self.keep:
            pid, rec = next(iter(self.pushes.items()))
            if pid in self.open:
                self.pushes.move_to_end(pid)  # an open push stays: look at the next
                if all(p in self.open for p in self.pushes):
                    return
                continue
            del self.pushes[pid]

    def _tally(self, address: str) -> WorkerTally:
        w = self.workers.get(address)
        if w is None:
            w = self.workers[address] = WorkerTally()
        return w

    def versions_per_second(self) -> float:
        if len(self.times) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.times[0], self.times[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The few counts ``status()`` carries (O(1))."""
        return {"version": self.version, "phase": self.phase, "applied": self.applied,
                "refused": self.refused, "durable": self.durable}

    def report(self, addresses: Callable[[str | None], str]) -> dict[str, Any]:
        """Everything ``am.report()`` shows (``addresses(session)``: its worker)."""
        st = list(self.staleness)
        rounds = sum(w.rounds for w in self.workers.values())
        moved = sum(w.bytes for w in self.workers.values())
        return {
            "model": self.model,
            "phase": self.phase,
            "failed": self.failed,
            "version": self.version,
            "incarnation": self.incarnation,
            "durable": self.durable,
            "holder": addresses(self.holder),
            "standby": addresses(self.standby),
            "standby_version": self.standby_version,
            "checkpoint": None if self.checkpoint is None else {
                "url": self.checkpoint[0], "every": self.checkpoint[1],
                "version": self.checkpointed},
            "versions_per_second": self.versions_per_second(),
            "staleness": {"median": float(statistics.median(st)) if st else 0.0,
                          "p90": _quantile(st, 0.9), "max": self.max_seen_staleness},
            "applied": self.applied,
            "refused": self.refused,
            "rows": self.rows,  # of applied deltas (rows - rows_lost: in the model)
            "rows_released": self.released_rows,
            "rows_lost": self.lost_rows,  # of applied deltas lost with a holder
            "holder_losses": self.holder_losses,
            "handovers": self.handovers,
            "open_pushes": len(self.open),
            "model_bytes": self.nbytes,
            "rounds": rounds,
            "bytes_per_round": moved / rounds if rounds else 0.0,
            "scheduler_bytes": self.scheduler_bytes,
            "scheduler_bytes_per_round": self.scheduler_bytes / rounds if rounds else 0.0,
            "workers": [{"address": a, "rounds": w.rounds, "rows": w.rows,
                         "refused": w.refused,
                         "bytes_per_round": w.bytes / w.rounds if w.rounds else 0.0,
                         "steps_per_second": self.paces.of.get(a, 0.0),
                         "speed_share": self.paces.share(a)}
                        for a, w in sorted(self.workers.items())],
        }

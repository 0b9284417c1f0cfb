"""Per-rank windows and stragglers, as pure bookkeeping (SPEC §5.1).

Every gang member sends one :class:`~daskdist.observe.steptimes.WindowSum` a window; the
:class:`RankTable` (one per coordinator, on the scheduler's event loop) keeps:

- per rank (:class:`RankTrack`): its last ``keep`` windows (median and p90 step time,
  mean phases and rows/s come from those), its step count, and its straggler
  :class:`Streak`;
- per window index (:class:`WindowPool`, the newest few only): every rank's own time
  and phases folded into histograms, so the ranks' medians are read in O(buckets).

A rank's window is judged once its next window arrives (by then every rank's report of
it is in): its *own time* (step time minus collective wait) against the median own time
of the ranks in that window. ``windows`` judgements in a row at ``ratio`` or more (and
``min_excess`` seconds or more above the median, so jitter on steps of microseconds is
not a straggler) start an episode; its cause is the phase among data, compute and commit
whose mean exceeds the ranks' median by the most; ``windows`` judgements in a row below
end it. A window with no step is not judged; a gap in window indices starts the count
again. Each report costs O(1) amortized, whatever the number of ranks: no scan over ranks
happens on a report (the medians of a window are computed once, when its first rank is
judged, and again only if a late report of it arrives).

Imports nothing from Dask, torch or the rest of the package.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from daskdist.observe.steptimes import (
    COMMIT,
    COMPUTE,
    DATA,
    PHASES,
    WindowSum,
    bucket,
    merge,
    quantile,
)

CAUSES = {"data": DATA, "compute": COMPUTE, "commit": COMMIT}  # what a straggler is blamed on
_POOLED = ("own", "data", "compute", "commit")  # a window's per-rank figures, histogrammed


@dataclass(frozen=True)
class Rule:
    """When a rank is a straggler: ``ratio`` x the median own time (and ``min_excess``
    seconds above it) in ``windows`` windows in a row; ``keep`` windows of each rank
    are kept for its figures."""

    ratio: float = 1.5
    windows: int = 3
    min_excess: float = 0.001
    keep: int = 3

    def __post_init__(self) -> None:
        if not self.ratio >= 1.0:
            raise ValueError(f"straggler ratio must be >= 1, got {self.ratio!r}")
        if self.windows < 1 or self.keep < 1:
            raise ValueError(f"straggler windows and keep must be >= 1, got "
                             f"{self.windows!r}, {self.keep!r}")
        if not self.min_excess >= 0.0:
            raise ValueError(f"straggler min_excess must be >= 0, got {self.min_excess!r}")


@dataclass
class Episode:
    """A straggler episode began (``kind="start"``) or ended (``"end"``)."""

    kind: str
    session: str
    rank: int
    worker: str
    own_seconds: float
    median_seconds: float
    cause: str
    since: int  # the window index the episode's first slow window had


@dataclass
class Streak:
    """One rank's straggler state: the slow (or, in an episode, fast) windows in a row."""

    above: int = 0  # judged windows in a row at the ratio or more
    below: int = 0  # judged windows in a row below it, during an episode
    straggling: bool = False
    first: int = -1  # the window index where the current run of slow windows began
    last: int | None = None  # the last window index judged
    since: int = -1  # the episode's first slow window
    cause: str = ""
    own: float = 0.0  # the last judged window's own time and the ranks' median
    median: float = 0.0

    def judge(self, index: int, own: float, median: float, excess: dict[str, float],
              rule: Rule) -> str | None:
        """Judge window ``index``: ``"start"`` when an episode begins, ``"end"`` when one
        ends, else ``None``. ``excess``: each cause's mean minus the ranks' median."""
        if self.last is not None and index <= self.last:
            return None  # judged already (a late duplicate)
        if self.last is not None and index != self.last + 1:  # a gap: count anew
            self.above = self.below = 0
        self.last = index
        slow = own >= rule.ratio * median and own - median >= rule.min_excess
        self.own, self.median = own, median
        if slow:
            if self.above == 0:
                self.first = index
            self.above += 1
            self.below = 0
            if self.straggling or self.above >= rule.windows:
                self.cause = max(CAUSES, key=lambda c: (excess.get(c, 0.0), c == "compute"))
            if not self.straggling and self.above >= rule.windows:
                self.straggling, self.since = True, self.first
                return "start"
            return None
        self.above = 0
        if self.straggling:
            self.below += 1
            if self.below >= rule.windows:
                self.straggling, self.below = False, 0
                return "end"
        return None


class WindowPool:
    """Every rank's figures of one window index, as histograms (for the ranks' medians)
    and counts (for the data bottleneck)."""

    __slots__ = ("_medians", "count", "data_heavy", "hists")

    def __init__(self) -> None:
        self.hists: dict[str, dict[int, int]] = {k: {} for k in _POOLED}
        self.count = 0  # ranks that reported steps in it
        self.data_heavy = 0  # ... of which waited on data half the time or more
        self._medians: dict[str, float] | None = None

    def add(self, w: WindowSum) -> None:
        for key, v in (("own", w.own), ("data", w.mean(DATA)), ("compute", w.mean(COMPUTE)),
                       ("commit", w.mean(COMMIT))):
            h = self.hists[key]
            b = bucket(v)
            h[b] = h.get(b, 0) + 1
        self.count += 1
        self.data_heavy += w.data_share >= 0.5
        self._medians = None

    def medians(self) -> dict[str, float]:
        """The ranks' median of each figure (computed once until the next report)."""
        if self._medians is None:
            self._medians = {k: quantile(h, 0.5) or 0.0 for k, h in self.hists.items()}
        return self._medians


@dataclass
class RankTrack:
    """What the scheduler keeps of one member session's rank."""

    session: str
    worker: str
    rank: int = -1
    generation: int = 0
    gang: str = ""
    steps: int = 0  # steps since its gang run started
    ring: deque = field(default_factory=deque)  # its last ``keep`` windows with steps
    pending: WindowSum | None = None  # its newest window, judged when the next one comes
    streak: Streak = field(default_factory=Streak)
    # seconds in each phase and rows, summed over every window since it took this rank
    # (Prometheus counters: a rank's series starts again from 0 under a new rank)
    totals: list[float] = field(default_factory=lambda: [0.0] * (len(PHASES) + 1))


class RankTable:
    """Every member's windows and straggler state, for one coordinator (see the module)."""

    def __init__(self, rule: Rule | None = None, pools: int = 4) -> None:
        self.rule = rule or Rule()
        self.tracks: dict[str, RankTrack] = {}  # session -> its rank's track
        self.pools: dict[int, WindowPool] = {}  # window index -> the ranks' figures
        self.keep_pools = max(2, pools)
        self.newest = -1  # the newest window index reported

    def add(self, session: str, worker: str, rank: int, generation: int, gang: str,
            w: WindowSum, steps: int) -> Episode | None:
        """Rank ``rank`` (session ``session`` on ``worker``) of ``gang``'s run on
        ``generation`` reports window ``w`` (``steps``: its steps since the run started).
        Judges its previous window; the episode that began or ended, if any."""
        t = self.tracks.get(session)
        if t is None:
            t = self.tracks[session] = RankTrack(session, worker)
        if (t.gang, t.generation) != (gang, generation):  # a new run: its own figures
            t.gang, t.generation, t.ring = gang, generation, deque()
            t.pending = None
        if t.rank != rank:
            t.totals = [0.0] * (len(PHASES) + 1)
        t.rank, t.worker, t.steps = rank, worker, steps
        for i, v in enumerate(w.phases):
            t.totals[i] += v
        t.totals[-1] += w.rows
        if w.steps:  # figures are the last windows it stepped in: after a run, its own
            t.ring.append(w)
            while len(t.ring) > self.rule.keep:
                t.ring.popleft()
            self._pool(w.index).add(w)
        prev, t.pending = t.pending, w
        if prev is None or prev.index >= w.index or not prev.steps:
            return None
        pool = self.pools.get(prev.index)
        if pool is None:
            return None  # too old: its medians are gone
        med = pool.medians()
        excess = {c: prev.mean(i) - med[c] for c, i in CAUSES.items()}
        kind = t.streak.judge(prev.index, prev.own, med["own"], excess, self.rule)
        if kind is None:
            return None
        s = t.streak
        return Episode(kind, session, rank, worker, s.own, s.median, s.cause, s.since)

    def _pool(self, index: int) -> WindowPool:
        pool = self.pools.get(index)
        if pool is None:
            pool = self.pools[index] = WindowPool()
            if index > self.newest:
                self.newest = index
                floor = index - self.keep_pools + 1
                for old in [i for i in self.pools if i < floor]:  # at most a few
                    del self.pools[old]
        return pool

    def drop(self, session: str) -> None:
        """A session ended: its track goes."""
        self.tracks.pop(session, None)

    # -- what the report shows ------------------------------------------------------------
    def entry(self, t: RankTrack, rank: int) -> dict[str, Any]:
        """The report's entry of a rank (SPEC §5.1): figures over its kept windows."""
        ring = list(t.ring)
        steps = sum(w.steps for w in ring)
        seconds = sum(w.seconds for w in ring)
        hist = merge(w.hist for w in ring)
        last = next((w for w in reversed(ring) if w.steps), None)
        out: dict[str, Any] = {
            "rank": rank,
            "worker": t.worker,
            "steps": t.steps,
            "step_seconds": {"median": quantile(hist, 0.5) or 0.0,
                             "p90": quantile(hist, 0.9) or 0.0},
            "phases": {name: (sum(w.phases[i] for w in ring) / steps if steps else 0.0)
                       for i, name in enumerate(PHASES)},
            "data_share": last.data_share if last is not None else 0.0,
            "rows_per_second": (sum(w.rows for w in ring) / seconds) if seconds > 0 else 0.0,
        }
        computing, reading = sum(w.computing for w in ring), sum(w.reading for w in ring)
        if computing or reading:  # it reads a Dask collection: where its data waits go
            out["data_source"] = "computing" if computing >= reading else "reading"
        return out

    @staticmethod
    def median(t: RankTrack) -> float:
        """A rank's median step time over its kept windows (0 without steps)."""
        return quantile(merge(w.hist for w in t.ring), 0.5) or 0.0

    def straggler(self, t: RankTrack, rank: int, window: float) -> dict[str, Any] | None:
        """The report's straggler entry of a rank in an episode, else ``None``."""
        s = t.streak
        if not s.straggling:
            return None
        return {"rank": rank, "worker": t.worker, "own_seconds": s.own,
                "median_seconds": s.median, "cause": s.cause, "since": s.since * window}

    def bottleneck(self, world: int) -> str | None:
        """``"data"`` when at least half the ranks waited on data half their step time or
        more in the last window (the newest every rank reported, else the one before)."""
        pool = self.pools.get(self.newest)
        if pool is not None and pool.count < world:
            pool = self.pools.get(self.newest - 1) or pool
        if pool is None or not pool.count:
            return None
        return "data" if 2 * pool.data_heavy >= pool.count else None


__all__ = ["CAUSES", "Episode", "RankTable", "RankTrack", "Rule", "Streak",
           "WindowPool"]

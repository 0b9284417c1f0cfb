"""RankBook: what the gang members measure, on the scheduler (SPEC §5.1), and its handlers.

Each member of a running gang sends a :class:`~daskdist.core.protocol.RankWindow` once a
window on its stream (``daskdist-rank-window``). The book folds it into the pure
:class:`~daskdist.observe.stragglers.RankTable` (per-rank figures, stragglers) and
:class:`~daskdist.observe.hangs.HangWatch` (no step for ``daskdist.observe.hang-after``),
O(1) per report whatever the number of ranks. A straggler episode or a hang becomes a
*notice* that clients long-poll (``daskdist_rank_notices``) and log; a hang first
collects every member's stack of its gang thread (the worker answers from its event
loop, so a blocked closure does not stop it), and the stacks stay in the report until
the next step. Clients read the report (``daskdist_rank_report``), collect stacks on
demand (``daskdist_rank_stacks``); a member whose collective call timed out asks which
ranks are stuck where (``daskdist_rank_stuck``).

Runs on the scheduler's event loop (it owns everything here); imports nothing from Dask:
it reaches workers through Dask's scheduler object the plugin gives it (``scheduler``).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections import deque
from typing import Any, Protocol

from daskdist import config
from daskdist.core import checks, protocol
from daskdist.core.membership import Membership
from daskdist.core.protocol import OWNER, SESSION, Route
from daskdist.observe.hangs import HangWatch, odd_ranks
from daskdist.observe.steptimes import WindowSum
from daskdist.observe.stragglers import Episode, RankTable, Rule


class RankCoordinator(Protocol):
    """What the book asks its coordinator (the scheduler's ``CoordinatorState``)."""

    name: str
    closed: bool
    members: Membership  # the shared membership: sessions by id, the poll interval

    def group_sessions(self) -> tuple[str, ...]:
        """The current group generation's sessions, in rank order."""

logger = logging.getLogger(__name__)

NOTICES = 64  # notices kept for clients that poll late (the newest)
RECENT = 1.0  # seconds a stack collection is reused by a caller that asks again


def _secs(x: float) -> str:
    return f"{x:.3g} s"


def rule_from_config() -> Rule:
    """The straggler rule of ``daskdist.observe`` (a bad setting names its key)."""
    ratio = checks.number(float(config.get("observe.straggler-ratio")),
                            "daskdist.observe.straggler-ratio", 1.0, 1e6)
    windows = checks.integer(config.integer("observe.straggler-windows"),
                               "daskdist.observe.straggler-windows", 1, 10_000)
    return Rule(ratio=ratio, windows=windows,
                min_excess=config.seconds("observe.straggler-min-excess"))


class RankBook:
    """One coordinator's per-rank figures, stragglers, hangs and stacks (see the module)."""

    def __init__(self, co: RankCoordinator) -> None:
        self.co = co
        enabled = bool(config.get("observe.enabled", True))
        # the window length every member uses (it hears it when it registers; 0: off)
        self.window = config.seconds("observe.window") if enabled else 0.0
        if enabled and not self.window > 0:
            raise ValueError(f"daskdist.observe.window must be positive, got "
                             f"{config.get('observe.window')!r}")
        self.table = RankTable(rule_from_config())
        self.hang = HangWatch(config.seconds("observe.hang-after"))
        self.stacks_timeout = config.seconds("observe.stacks-timeout")
        self.scheduler: Any = None  # Dask's scheduler: its rpc to workers, NVML metrics
        self.notices: deque[dict] = deque(maxlen=NOTICES)
        self.seq = 0  # notices posted so far (the next one's number)
        self._posted = asyncio.Event()  # set (and replaced) at each notice
        self.stacks: dict[int, str] | None = None  # the last collection, until a step
        self._stacks_at = 0.0  # when it was collected (time.monotonic())
        self._collecting: asyncio.Task | None = None
        self._collected: tuple[float, dict] | None = None  # (when, what) of the last
        self._tasks: set[asyncio.Task] = set()  # hang collections under way

    # -- a member's window (its stream) ----------------------------------------------------
    def on_window(self, worker: str, window: Any) -> None:
        """A member's window report (one-way, on its stream: a bad one is logged and
        dropped, never raised, since an error would close the worker's stream)."""
        op = "daskdist-rank-window"
        try:
            w = protocol.rank_window(window, op)
            checks.text(worker, f"{op}: worker")
        except (TypeError, ValueError) as e:
            logger.warning("daskdist[%s]: %s from %s dropped: %s", self.co.name, op,
                           worker, e)
            return
        member = self.co.members.members.get(w.session)
        if member is None or member.address != worker:
            return  # an ended session's (fenced), or not this worker's: dropped
        ws = WindowSum(w.index, w.steps, w.seconds, list(w.phases), w.rows, dict(w.hist),
                       w.partitions[0], w.partitions[1])
        episode = self.table.add(w.session, worker, w.rank, w.generation, w.gang, ws, w.total)
        if episode is not None:
            self._episode(episode)
        run, now = (w.gang, w.generation), time.monotonic()
        if self.stacks is not None and w.steps and now - w.since_step > self._stacks_at:
            self.stacks = None  # kept until the next step
        if w.ended:
            self.hang.ended(run)
            return
        if self.hang.report(run, w.steps, w.since_step, now) == "hang":
            task = asyncio.ensure_future(self._hung(w.since_step))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def session_ended(self, session: str) -> None:
        self.table.drop(session)

    def _episode(self, ep: Episode) -> None:
        if ep.kind == "start":
            self._post("straggler", f"straggler: rank {ep.rank} ({ep.worker}): "
                       f"{_secs(ep.own_seconds)} a step against the median "
                       f"{_secs(ep.median_seconds)}; cause: {ep.cause}", rank=ep.rank,
                       worker=ep.worker, cause=ep.cause)
        else:
            logger.info("daskdist[%s]: rank %d (%s) is no longer a straggler", self.co.name,
                        ep.rank, ep.worker)

    def _post(self, kind: str, message: str, **fields: Any) -> None:
        """A notice for every client that polls (and the scheduler's log)."""
        self.notices.append({"seq": self.seq, "kind": kind, "message": message, **fields})
        self.seq += 1
        logger.info("daskdist[%s]: %s", self.co.name, message)
        self._posted.set()
        self._posted = asyncio.Event()

    async def _hung(self, since: float) -> None:
        """No step for ``hang-after``: every member's stack, and a notice naming the ranks
        whose place differs from the most common one."""
        got = await self.collect()
        if not self.hang.fired:
            return  # a step came meanwhile: no hang any more
        self._keep(got)
        self._post("hang", f"no step for {_secs(since)}; " + _places(got),
                   ranks=odd_ranks(got["wheres"], got["waiting"])[0])

    # -- stacks --------------------------------------------------------------------------
    async def collect(self) -> dict:
        """Every member's stack of its gang thread, now (one collection at a time: callers
        meanwhile, or within ``RECENT`` s after, share it). Each member answers from its
        event loop within ``daskdist.observe.stacks-timeout``, or is left out."""
        done = self._collected
        if done is not None and time.monotonic() - done[0] < RECENT:
            return done[1]
        if self._collecting is None or self._collecting.done():
            self._collecting = asyncio.ensure_future(self._collect())
        return await asyncio.shield(self._collecting)

    def _keep(self, got: dict) -> None:
        """The report shows these stacks until a step ends after they were taken."""
        self.stacks, self._stacks_at = dict(got["stacks"]), got["at"]

    async def _collect(self) -> dict:
        sessions, members = self.co.group_sessions(), self.co.members.members
        rpc = self.scheduler.rpc if self.scheduler is not None else None
        at = time.monotonic()

        async def one(rank: int, session: str) -> tuple[int, str, Any]:
            m = members.get(session)
            if m is None or rpc is None:
                return rank, "", None
            try:
                got = await asyncio.wait_for(rpc(m.address).daskdist_gang_stack(
                    name=self.co.name), self.stacks_timeout)
            except Exception as e:  # noqa: BLE001 - gone or stuck: left out
                logger.debug("daskdist: no stack from %s: %r", m.address, e)
                got = None
            return rank, m.address, got

        answers = await asyncio.gather(*(one(r, s) for r, s in enumerate(sessions)))
        out: dict[str, Any] = {"stacks": {}, "wheres": {}, "waiting": {}, "workers": {},
                               "at": at}
        for rank, address, got in answers:
            if isinstance(got, dict) and isinstance(got.get("stack"), str):
                out["stacks"][rank] = got["stack"]
                out["wheres"][rank] = str(got.get("where", ""))
                out["waiting"][rank] = bool(got.get("waiting"))
                out["workers"][rank] = address
        self._collected = (time.monotonic(), out)
        return out

    # -- handlers ------------------------------------------------------------------------
    def report(self, limit: int | None = None) -> dict:
        """The report of SPEC §5.1 (``ranks``, ``stragglers``, ``bottleneck``, ``stacks``)
        over the current generation, in rank order, and the window length. ``limit``: the
        stragglers and the slowest ranks only, at most that many (the dashboard)."""
        if limit is not None:
            limit = checks.integer(limit, "daskdist_rank_report: limit", 1, 1 << 30)
        table, window = self.table, self.window
        sessions = self.co.group_sessions()
        ranked = [(r, t) for r, s in enumerate(sessions) if (t := table.tracks.get(s))]
        if limit is not None and len(ranked) > limit:
            def slow(item: tuple) -> tuple:
                t = item[1]
                return (t.streak.straggling, t.ring[-1].own if t.ring else 0.0, -item[0])
            ranked = sorted(heapq.nlargest(limit, ranked, key=slow), key=lambda x: x[0])
        ranks, stragglers = [], []
        for r, t in ranked:
            entry = table.entry(t, r)
            gpu = self._gpu(t.worker)
            if gpu:
                entry["gpu"] = gpu
            ranks.append(entry)
            s = table.straggler(t, r, window)
            if s is not None:
                stragglers.append(s)
        return {"ranks": ranks, "stragglers": stragglers,
                "bottleneck": table.bottleneck(len(sessions)) if sessions else None,
                "stacks": dict(self.stacks) if self.stacks else None, "window": window}

    def totals(self) -> list[tuple[int, str, list[float], float, bool]]:
        """``(rank, worker, [phase seconds..., rows] so far, median step time, straggler)``
        of every rank of the current generation (Prometheus)."""
        out = []
        for r, s in enumerate(self.co.group_sessions()):
            t = self.table.tracks.get(s)
            if t is not None:
                out.append((r, t.worker, list(t.totals), self.table.median(t),
                            t.streak.straggling))
        return out

    async def notices_since(self, since: int | None = None,
                            timeout: float | None = None) -> dict:
        """Long-poll: the notices from number ``since`` on (``None``: none, only the
        number the next one will have), waiting up to ``timeout`` seconds (default
        ``daskdist.scheduler.poll-interval``) while there are none."""
        op = "daskdist_rank_notices"
        since = checks.optional(checks.integer, since, f"{op}: since", 0, 2**62)
        timeout = checks.optional(checks.number, timeout, f"{op}: timeout", 0.0, 3600.0)
        if since is None:
            return {"seq": self.seq, "items": []}
        if since >= self.seq and not self.co.closed:
            with contextlib.suppress(asyncio.TimeoutError):  # none came: the poll ends
                await asyncio.wait_for(self._posted.wait(), self.co.members.poll_base
                                       if timeout is None else timeout)
        items = [n for n in self.notices if n["seq"] >= since]
        return {"seq": self.seq, "items": items}

    async def stacks_now(self, owner: str, token: str) -> list:
        """An owner asks for every member's stack now: ``[(rank, stack), ...]``; they stay
        in the report until the next step."""
        got = await self.collect()
        self._keep(got)
        return sorted(got["stacks"].items())

    async def stuck(self, session: str) -> str | dict:
        """A member whose collective call timed out asks where the ranks are: a sentence
        naming the ranks that stand out and where each is (``""``: no member answered)."""
        got = await self.collect()
        return _places(got) if got["wheres"] else ""

    def close(self) -> None:
        self._posted.set()
        for task in list(self._tasks):
            task.cancel()

    def _gpu(self, address: str) -> dict | None:
        """The worker's GPU use and memory from Dask's NVML heartbeat metrics, if any."""
        ws = getattr(self.scheduler, "workers", {}).get(address)
        metrics = getattr(ws, "metrics", None) or {}
        nested = metrics.get("gpu") if isinstance(metrics.get("gpu"), dict) else {}
        util = metrics.get("gpu_utilization", nested.get("utilization"))
        used = metrics.get("gpu_memory_used", nested.get("memory-used"))
        if util is None and used is None:
            return None
        return {"utilization": util, "memory_used": used,
                "memory_total": metrics.get("gpu-memory-total")}


def _places(got: dict) -> str:
    """Which ranks stand out and where each rank is, from a stack collection."""
    wheres, workers = got["wheres"], got["workers"]
    odd, common = odd_ranks(wheres, got["waiting"])
    if not wheres:
        return "no member answered with its stack"
    if not odd:
        return f"every rank is in {common}"
    named = "; ".join(f"rank {r} ({workers.get(r, '?')}) is in {wheres[r]}" for r in odd)
    rest = sorted(set(wheres) - set(odd))
    return f"{named}; ranks {', '.join(map(str, rest))} are in {common}"


# The rank book's routes (the plugin registers each on the named coordinator's book,
# protocol.book_handler), and its stream route (a member's window; no reply: it checks
# the window's session against the worker whose stream it came on).
RANK_ROUTES = {
    "daskdist_rank_report": Route(RankBook.report),
    "daskdist_rank_notices": Route(RankBook.notices_since, {"closed": True}),
    "daskdist_rank_stacks": Route(RankBook.stacks_now, caller=OWNER),
    "daskdist_rank_stuck": Route(RankBook.stuck, "", SESSION),
}
RANK_STREAM_ROUTES = {"daskdist-rank-window": Route(RankBook.on_window, None)}

"""The scheduler's rank book (SPEC §5.1) driven directly, without Dask: members' windows
in, a straggler's notice and a hang's stacks out; what it refuses and drops."""

from __future__ import annotations

import asyncio
import logging

import dask
import pytest

from daskdist.core.protocol import SESSION_ENDED, RankWindow
from daskdist.observe.steptimes import bucket
from daskdist.plugins.scheduler.state import CoordinatorState
from tests.conftest import route

pytestmark = pytest.mark.timeout(60)

WORLD = 3


class Worker:
    """What the book asks a member's worker: the stack of its gang thread."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.asked = 0

    async def daskdist_gang_stack(self, name: str) -> dict:
        self.asked += 1
        where = "blocked (t.py:3)" if self.rank == 1 else "train (t.py:9)"
        return {"session": f"s{self.rank}", "rank": self.rank, "waiting": self.rank != 1,
                "stack": f'  File "t.py", line 1, in {where.split()[0]}\n', "where": where}


class Scheduler:
    def __init__(self) -> None:
        self.workers_rpc = {f"w{r}": Worker(r) for r in range(WORLD)}
        self.workers: dict = {}

    def rpc(self, address: str) -> Worker:
        return self.workers_rpc[address]


def group_of(world: int = WORLD) -> tuple[CoordinatorState, Scheduler]:
    co = CoordinatorState("t")
    for r in range(world):
        co.start_session(f"s{r}", f"w{r}", 1, "cpu", "", lambda a: False, 0.0)
    co.gangs.begin_formation(tuple(f"s{r}" for r in range(world)))
    co.gangs.formation_done(co.gangs.group.generation, True)
    sched = Scheduler()
    co.rank_book.scheduler = sched
    return co, sched


def window(rank: int, index: int, steps: int = 10, since: float = 0.01, wait: float = 0.09,
           ended: bool = False) -> tuple:
    step = 0.1
    return tuple(RankWindow(f"s{rank}", "g", 1, rank, index, steps, steps * step,
                            [0.0, steps * wait, 0.0, steps * (step - wait)], 8 * steps,
                            [(bucket(step), steps)] if steps else [], steps * (index + 1),
                            since, [0.0, 0.0], ended))


def test_a_straggler_is_one_notice_and_the_report_names_it():
    async def run() -> None:
        co, _ = group_of()
        book = co.rank_book
        for index in range(5):
            for r in range(WORLD):
                book.on_window(f"w{r}", window(r, index, wait=0.0 if r == 2 else 0.09))
        assert [n["kind"] for n in book.notices] == ["straggler"]
        assert book.notices[0]["message"].startswith("straggler: rank 2 (w2): 0.1 s a step")
        assert (await book.notices_since(None))["seq"] == 1
        assert [n["seq"] for n in (await book.notices_since(0, timeout=0.0))["items"]] == [0]
        report = book.report()
        assert [s["rank"] for s in report["stragglers"]] == [2]
        assert report["window"] == 10.0 and report["stacks"] is None
        assert [r["rank"] for r in book.report(limit=1)["ranks"]] == [2]
        assert [t[0] for t in book.totals()] == [0, 1, 2]

    asyncio.run(run())


def test_windows_of_another_worker_or_an_ended_session_and_bad_ones_are_dropped():
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("daskdist.observe.book")

    async def run() -> None:
        co, _ = group_of()
        book = co.rank_book
        book.on_window("w1", window(0, 0))  # session s0 is w0's
        book.on_window("w0", ("nonsense",))  # logged, never raised (the worker's stream)
        assert not book.table.tracks
        assert [m for m in logged if "dropped" in m]
        co.end_session("s0")
        book.on_window("w0", window(0, 1))
        assert not book.table.tracks
        assert await route(co, "daskdist_rank_stuck")(session="s0") == SESSION_ENDED

    logger.addHandler(handler)
    try:
        asyncio.run(run())
    finally:
        logger.removeHandler(handler)


def test_a_hang_collects_the_stacks_names_the_odd_rank_and_a_step_clears_them():
    async def run() -> None:
        with dask.config.set({"daskdist.observe.hang-after": "30s"}):
            co, sched = group_of()
        book = co.rank_book
        for r in range(WORLD):
            book.on_window(f"w{r}", window(r, 0, steps=0, since=40.0))
        for _ in range(1000):  # the collection runs on this loop (10 s on a busy machine)
            if book.notices:
                break
            await asyncio.sleep(0.01)
        (notice,) = book.notices
        assert notice["kind"] == "hang" and notice["ranks"] == [1]
        assert "rank 1 (w1) is in blocked (t.py:3); ranks 0, 2 are in train (t.py:9)" in \
            notice["message"]
        assert sorted(book.report()["stacks"]) == [0, 1, 2]
        assert await book.stuck("s0") == notice["message"].split("; ", 1)[1]
        assert max(w.asked for w in sched.workers_rpc.values()) == 1  # shared, recent
        book.on_window("w0", window(0, 1, steps=2, since=0.0))  # a step now: stacks go
        assert book.report()["stacks"] is None
        book.on_window("w0", window(0, 2, ended=True))
        assert book.hang.run == ()

    asyncio.run(run())


def test_a_ranks_gpu_comes_from_dasks_nvml_heartbeat_metrics():
    from types import SimpleNamespace

    async def run() -> None:
        co, sched = group_of()
        sched.workers = {"w0": SimpleNamespace(metrics={  # Dask's SystemMonitor's names
            "gpu_utilization": 87, "gpu_memory_used": 3 * 2**30, "gpu-memory-total": 2**34}),
            "w1": SimpleNamespace(metrics={"cpu": 10.0})}
        for r in range(WORLD):
            co.rank_book.on_window(f"w{r}", window(r, 0))
        ranks = co.rank_book.report()["ranks"]
        assert ranks[0]["gpu"] == {"utilization": 87, "memory_used": 3 * 2**30,
                                   "memory_total": 2**34}
        assert "gpu" not in ranks[1] and "gpu" not in ranks[2]  # no NVML there

    asyncio.run(run())

"""The scheduler's batch-inference book, driven through its routes on a coordinator's
state (no Dask, no workers): a job registers its engine and defines its lease table,
queues its closures (tagged with its dataset) while rows are free, commits the first
attempt and refuses a duplicate or a fenced one, hands a lost attempt's unit to the
finalization, finalizes once every row is committed, resumes from a ledger, attaches a
second start (its owner holding the job too, which is cancelled once no owner holding
it is left), and fails naming the unit once the lease table says the input cannot
complete."""

from __future__ import annotations

import asyncio

import pytest

from daskdist.core.protocol import (
    READY,
    SESSION_ENDED,
    DatasetDef,
    InferenceJobDef,
    LeaseToken,
    Outcome,
    UnitReport,
)
from daskdist.plugins.scheduler.inference.jobs import JOB_OWNER
from daskdist.plugins.scheduler.state import CoordinatorState
from tests.conftest import route

pytestmark = pytest.mark.timeout(60)

DS = "r-input"  # the job's lease table dataset
OWNER = {"owner": "me", "token": "t"}


def make() -> CoordinatorState:
    co = CoordinatorState("t")
    co.closure_book.add_owner("me", None, "t")
    for i in (1, 2):
        co.start_session(f"s{i}", f"w{i}", 1, "cpu", "", lambda a: False, 0.0)
    return co


def job_def(name: str = "j", committed=(), units: int = 0) -> list:
    """A job over 6 units of 10 rows (as a client sends it)."""
    dataset = DatasetDef(DS, name, [[10, 6]])
    return list(InferenceJobDef(name, "/out", "fp", list(dataset), "r", b"engine",
                                [b"run", None], [b"finish", None],
                                [list(r) for r in committed], None, units, 10 * units))


def unit(co: CoordinatorState, session: str, rows, attempt: str = "c#1") -> dict:
    """``session`` leased ``rows`` (already) and asks to commit them."""
    report = UnitReport("j", attempt, [list(LeaseToken.of(DS, 0, [list(rows)]))],
                        f"/out/_daskdist/staging/{attempt}.staged", rows[1] - rows[0], [],
                        f"rows {rows}")
    return route(co, "daskdist_infer_unit")(session=session, report=list(report))


def take(co: CoordinatorState, session: str, rows) -> tuple:
    """One job closure dispatched to ``session``: it leases ``rows`` and asks to commit
    them (its attempt: the closure's id and attempt); the closure and the reply."""
    (c,) = co.queue.dispatch(session, 1)
    assert co.leases.acquire(session, DS, 0, rows[1] - rows[0]) == [rows]
    return c, unit(co, session, rows, f"{c.cid}#{c.attempt}")


def end(co: CoordinatorState, session: str, closures, ok: bool = True) -> None:
    """The closures (dispatched to ``session``) report they ended."""
    co.closure_book.apply_results(session, [
        Outcome(c.cid, READY if ok else "FAILED", None, None if ok else "user-error",
                c.attempt) for c in closures])


def progress(co: CoordinatorState, name: str = "j") -> dict:
    return asyncio.run(route(co, "daskdist_infer_progress")(job=name))


def test_a_job_queues_commits_and_finalizes():
    co = make()
    info = route(co, "daskdist_infer_start")(**OWNER, job=job_def())
    assert info["state"] == "running" and not info["attached"]
    assert co.resources["r"] == b"engine" and co.leases.progress(DS, 0)["total"] == 60
    queued = [co.queue.closures[c] for c in co.queue.closures]
    assert len(queued) == 4  # 2 members x closures-per-worker
    assert {c.tag for c in queued} == {DS} and {c.owner for c in queued} == {JOB_OWNER + "j"}
    # the first committer wins; a duplicate, or rows not leased to the caller, never
    c1, won = take(co, "s1", (0, 10))
    assert won["commit"] and won["file"] == f"part-{0:016x}.parquet"
    assert won["record"]["rows"] == [[0, 10]]
    assert unit(co, "s2", (0, 10), "x#1") == {"commit": False,
                                              "why": "rows committed already (a duplicate run)"}
    assert not unit(co, "s2", (10, 20), "x#2")["commit"]  # not leased to s2
    end(co, "s1", [c1])  # published by its attempt
    # s2 wins a unit, then its worker is lost before publishing it: orphaned
    c2, won = take(co, "s2", (10, 20))
    assert won["commit"]
    assert co.leases.acquire("s2", DS, 0, 10) == [(20, 30)]
    co.end_session("s2")
    assert unit(co, "s2", (20, 30), "x#3") == SESSION_ENDED  # fenced
    assert co.leases.progress(DS, 0)["free"] == 40  # its leased rows came back
    for a in range(20, 60, 10):
        c, won = take(co, "s1", (a, a + 10))
        assert won["commit"]
        end(co, "s1", [c])
    p = progress(co)
    assert (p["state"], p["units"], p["rows"]) == ("finalizing", 6, 60)
    finals = [c for c in co.queue.closures if "-f" in c]
    assert len(finals) == 1 and co.queue.closures[finals[0]].payload == [b"finish", None]
    plan = route(co, "daskdist_infer_plan")(session="s1", job="j")
    assert plan["finalize"] and [r["first"] for r in plan["orphans"]] == [10]
    route(co, "daskdist_infer_finalized")(session="s1", job="j", ok=True)
    p = progress(co)
    assert p["state"] == "complete" and "r" not in co.resources  # engines released
    assert not co.queue.errors  # its closures' errors are the job's, never an owner's
    assert co.status()["inference"]["j"]["rows"] == 60


def test_a_finalization_that_fails_is_tried_again_then_fails_the_job():
    co = make()
    route(co, "daskdist_infer_start")(**OWNER, job=job_def(committed=[(0, 60)], units=6))
    assert progress(co)["state"] == "finalizing"  # every row committed before: at once
    for tries in range(3):  # a finalizing closure queued again after each failure
        assert sum("-f" in cid for cid in co.queue.closures) == tries + 1
        route(co, "daskdist_infer_finalized")(session="s1", job="j", ok=False,
                                              error="PermissionError: read-only")
    assert not co.queue.closures  # failed: the job's closures cancelled
    p = progress(co)
    assert p["state"] == "failed" and "read-only" in p["error"] and "3 times" in p["error"]


def test_a_resumed_job_leases_only_what_is_missing_and_a_second_start_attaches():
    co = make()
    info = route(co, "daskdist_infer_start")(**OWNER, job=job_def(committed=[(0, 30)],
                                                                  units=3))
    assert (info["resumed_units"], info["resumed_rows"], info["rows"]) == (3, 30, 30)
    assert co.leases.acquire("s1", DS, 0, 10) == [(30, 40)]
    assert not unit(co, "s1", (0, 10), "x#1")["commit"]  # committed by an earlier run
    again = route(co, "daskdist_infer_start")(**OWNER, job=job_def())
    assert again["attached"] and again["rows"] == 30
    other = job_def()
    other[2] = "another fingerprint"
    with pytest.raises(ValueError, match="running over another source"):
        route(co, "daskdist_infer_start")(**OWNER, job=other)
    route(co, "daskdist_infer_cancel")(**OWNER, job="j")
    assert progress(co)["state"] == "cancelled" and not co.queue.closures


def test_a_unit_failing_max_worker_failures_times_fails_the_job_naming_it():
    co = make()
    route(co, "daskdist_infer_start")(**OWNER, job=job_def())
    assert co.leases.acquire("s1", DS, 0, 10) == [(0, 10)]
    assert co.leases.acquire("s2", DS, 0, 50, least=50) == [(10, 60)]  # the rest elsewhere
    for attempt in range(3):
        rows = [(0, 10)]
        if attempt:  # deferred: served again once no other row is free
            assert co.leases.acquire("s1", DS, 0, 10) == rows
        co.leases.release("s1", DS, 0, rows, failure=(
            "a.parquet row group 0", "a.parquet row group 0, rows [0, 10): predict raised "
            "ZeroDivisionError: boom"))
        report = UnitReport("j", f"c#{attempt}", [], "", 0, [], "a.parquet row group 0",
                            "boom")
        route(co, "daskdist_infer_unit")(session="s1", report=list(report))
    end(co, "s1", co.queue.dispatch("s1", 1))  # a closure ends: the input cannot complete
    p = progress(co)
    assert p["state"] == "failed" and "a.parquet row group 0, rows [0, 10)" in p["error"]
    assert "ZeroDivisionError: boom" in p["error"] and "3 times" in p["error"]
    assert p["workers"][0]["failures"] == 3 and "r" not in co.resources


def test_a_unit_read_ahead_always_meets_a_closure():
    """Every free row leased (s1 read them ahead) and the closures spent idle elsewhere:
    the last one out is replaced, and the queue routes it to s1, which holds the rows."""
    co = make()
    route(co, "daskdist_infer_start")(**OWNER, job=job_def())
    idle = co.queue.dispatch("s2", 100)  # prefetched by s2's worker, then s1 leases all
    assert len(idle) == 4
    assert co.leases.acquire("s1", DS, 0, 60, least=60) == [(0, 60)]
    end(co, "s2", idle[:3])
    assert not co.queue.closures.keys() - {c.cid for c in idle}  # one still out: no more
    end(co, "s2", idle[3:])
    assert len(co.queue.closures) == 1  # the last one out, replaced
    assert co.queue.dispatch("s2", 1) == []  # set aside: s2 holds none of the rows
    (c,) = co.queue.dispatch("s1", 1)
    assert c.tag == DS


def test_closures_failing_in_a_row_fail_the_job_naming_why():
    """An engine that cannot be built (its model's factory raised) fails every closure
    before it runs: after max_worker_failures in a row the job fails, saying why."""
    from daskdist.core.protocol import INPUT_ERROR
    from daskdist.errors import InputError, dump_error

    co = make()
    route(co, "daskdist_infer_start")(**OWNER, job=job_def())
    payload = dump_error(InputError("per-worker dataset r could not be built: OSError: "
                                    "no weights"))
    for n in range(3):
        (c,) = co.queue.dispatch("s1", 1)
        co.closure_book.apply_results("s1", [Outcome(c.cid, "FAILED", payload, INPUT_ERROR,
                                                     c.attempt)])
        assert progress(co)["state"] == ("failed" if n == 2 else "running")
    p = progress(co)
    assert "failed 3 times in a row" in p["error"] and "no weights" in p["error"]
    assert not co.queue.errors and "r" not in co.resources


def test_a_job_runs_while_an_owner_holds_it_and_is_cancelled_with_the_last():
    """The owners' rule: a second owner's same start attaches and holds the job too; the
    job goes on when the owner that started it is dropped, and is cancelled (its queued
    closures and engine with it) when the last one holding it is."""
    co = make()
    co.closure_book.add_owner("you", None, "u")
    route(co, "daskdist_infer_start")(**OWNER, job=job_def())
    assert route(co, "daskdist_infer_start")(owner="you", token="u", job=job_def())["attached"]
    co.drop_owner("me")  # closed: "you" holds the job still
    assert progress(co)["state"] == "running" and co.queue.closures and "r" in co.resources
    co.drop_owner("you")
    p = progress(co)
    assert p["state"] == "cancelled" and "every owner holding it" in p["error"]
    assert not co.queue.closures and "r" not in co.resources

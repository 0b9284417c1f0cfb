"""The scheduler's book of asynchronous models with a real coordinator state and lease
table, no cluster: the roles it gives, the rows a staged push takes from its worker's
session (a loss of that worker no longer frees them), acknowledged once a standby's
copy holds the push (on the pusher's worker's count), given back when refused, and an
abandoned push released from its worker's session in one step and fenced; a holder
with a preemption deadline hands the model to its standby losing nothing, a standby
with one is replaced ahead of it, and no worker with a deadline takes a role; a
keep-alive owner's model outlives its client and goes with the owner."""

from __future__ import annotations

import asyncio
import time

import dask.config
import pytest

from daskdist.core.asynchronous.protocol import (
    HOLDER,
    NONE,
    STANDBY,
    AsyncRole,
    Copied,
    Decision,
    Ready,
)
from daskdist.core.protocol import LeaseToken
from daskdist.plugins.scheduler.state import CoordinatorState
from tests.conftest import route
from tests.tables import check_leases, leased_to

pytestmark = pytest.mark.timeout(60)


def roles(sent: list) -> list[tuple[str, AsyncRole]]:
    return [(a, AsyncRole._make(m["role"])) for a, m in sent if m["op"] == "daskdist-async-role"]


@pytest.fixture
def book():
    """A coordinator of three members and a served model held by the first."""
    sent: list = []
    co = CoordinatorState("t", send=lambda address, msg: sent.append((address, msg)))
    co.closure_book.add_owner("me", None, "tok")
    for i in range(3):
        co.start_session(f"s{i}", f"w{i}", 1, "cpu", "", lambda a: False, 0.0)
    co.leases.define("ds", [(10, 10)])

    async def create():
        task = asyncio.ensure_future(route(co, "daskdist_async_create")(
            owner="me", token="tok", model="m", spec=b"spec", max_staleness=1,
            replica="resource-m"))
        await asyncio.sleep(0.01)
        address, role = roles(sent)[-1]
        assert role.role == HOLDER and role.spec == b"spec"
        co.async_book.on_ready(role.session, tuple(Ready("m", role.session, 0, 0, 0, "fresh",
                                                         40, {}, [])))
        return await task

    info = asyncio.run(create())
    return co, sent, info


def lease(co, session: str, rows: int = 10) -> list:
    got = co.leases.acquire(session, "ds", 0, rows)
    return [tuple(LeaseToken.of("ds", 0, got))]


def stage(co, holder: str, pid: str, pusher: str, tokens: list, steps: int = 3,
          seconds: float = 0.1) -> dict:
    return route(co, "daskdist_async_stage")(
        session=holder, stage=["m", 0, pid, pusher, f"w{pusher[-1]}", tokens, 0, steps,
                               seconds])


def test_a_holder_and_a_standby_on_two_members(book):
    co, sent, info = book
    assert info["holder"] == "w0" and info["standby"] == "w1" and info["version"] == 0
    kinds = [(a, r.role, r.source) for a, r in roles(sent)]
    assert ("w1", STANDBY, "same") in kinds and ("w0", HOLDER, "same") in kinds


def test_a_push_is_answered_with_its_workers_pace_this_round_included(book):
    """Dynamic local updates: the answer to a worker's first push already scales its
    next round by the pace that round measured, against the fastest worker's; a pace
    that changes moves the answer (the fastest kept as paces change); a lost worker's
    pace goes with it."""
    co, _, _ = book
    assert stage(co, "s0", "p1", "s1", lease(co, "s1"), 50, 0.5)["speed"] == 1.0
    assert stage(co, "s0", "p2", "s2", lease(co, "s2"), 50, 1.5)["speed"] == \
        pytest.approx(1 / 3)
    # the fast worker slows (smoothed: from 100 to 60 steps/s), still the fastest: the
    # slow one's share is of 60 now, not of the 100 it was
    assert stage(co, "s0", "p3", "s1", lease(co, "s1"), 50, 2.5)["speed"] == 1.0
    assert stage(co, "s0", "p4", "s2", lease(co, "s2"), 50, 1.5)["speed"] == \
        pytest.approx((100 / 3) / 60)
    assert co.async_book.models["m"].paces.share("w1") == 1.0
    co.end_session("s1")  # the fastest is lost: the slow one is the fastest left
    assert stage(co, "s0", "p5", "s2", lease(co, "s2"), 50, 1.5)["speed"] == 1.0


def test_a_staged_push_outlives_its_worker_and_is_acknowledged_at_the_copy(book):
    co, sent, _ = book
    tokens = lease(co, "s2")
    assert stage(co, "s0", "p1", "s2", tokens)["staged"]
    assert leased_to(co.leases, "s2", "ds", 0) == []  # the model's now
    co.end_session("s2")  # the pusher is lost: its rows stay with the push
    assert leased_to(co.leases, "async:m", "ds", 0) == [(0, 10)]
    co.async_book.on_decided("s0", tuple(Decision("m", "s0", 0, "p1", True, 1, 0, "", 80)))
    assert co.leases.progress("ds", 0)["acknowledged"] == 0  # not durable yet
    co.async_book.on_copied("s1", tuple(Copied("m", "s1", 0, 1, [["p1", 1]])))
    assert co.leases.progress("ds", 0)["acknowledged"] == 10
    check_leases(co.leases)
    report = co.async_book.report("m")
    assert report["rows"] == 10 and report["durable"] == 1 and report["open_pushes"] == 0


def test_a_push_durable_after_its_dataset_is_dropped_is_settled_without_a_warning(
        book, caplog):
    """A dataset's handle dropped (the driver moved on) while a push of its rows waits
    for the copy: its rows count nowhere, which is no loss worth a warning; a push whose
    dataset lives and whose rows cannot be acknowledged still warns."""
    co, sent, _ = book
    assert stage(co, "s0", "p1", "s2", lease(co, "s2"))["staged"]
    co.async_book.on_decided("s0", tuple(Decision("m", "s0", 0, "p1", True, 1, 0, "", 80)))
    co.forget_datasets(["ds"])
    with caplog.at_level("WARNING", logger="daskdist"):
        co.async_book.on_copied("s1", tuple(Copied("m", "s1", 0, 1, [["p1", 1]])))
    assert not [r for r in caplog.records if "could not be acknowledged" in r.message]
    assert co.async_book.report("m")["durable"] == 1

    co.leases.define("ds2", [(10, 10)])
    tokens = [tuple(LeaseToken.of("ds2", 0, co.leases.acquire("s2", "ds2", 0, 10)))]
    assert stage(co, "s0", "p2", "s2", tokens)["staged"]
    co.async_book.on_decided("s0", tuple(Decision("m", "s0", 0, "p2", True, 2, 0, "", 80)))
    co.leases.release_tokens("async:m", tokens)  # the rows taken from under the push
    with caplog.at_level("WARNING", logger="daskdist"):
        co.async_book.on_copied("s1", tuple(Copied("m", "s1", 0, 2, [["p2", 2]])))
    assert [r for r in caplog.records if "could not be acknowledged" in r.message]


def test_the_model_goes_with_its_replicas_resource_and_its_open_rows_go_back(book):
    """The client's handle dropped: its replicas' resource is released, and with it the
    model: its holder and standby are told to let it go, a staged push's rows are free
    again; another resource's release leaves it be."""
    co, sent, _ = book
    assert stage(co, "s0", "p1", "s2", lease(co, "s2"))["staged"]
    co.resources_released(["resource-other"])
    assert "m" in co.async_book.models
    sent.clear()
    co.resources_released(["resource-m"])
    assert "m" not in co.async_book.models and not co.async_book.by_replica
    assert sorted((a, r.role) for a, r in roles(sent)) == [("w0", NONE), ("w1", NONE)]
    p = co.leases.progress("ds", 0)
    assert p["leased"] == 0 and p["free"] == 100
    check_leases(co.leases)


def test_a_refused_push_gives_its_rows_back(book):
    co, sent, _ = book
    tokens = lease(co, "s2")
    assert stage(co, "s0", "p1", "s2", tokens)["staged"]
    co.async_book.on_decided("s0", tuple(Decision("m", "s0", 0, "p1", False, 0, 3,
                                                  "stale", 80)))
    p = co.leases.progress("ds", 0)
    assert p["leased"] == 0 and p["free"] == 100
    assert co.async_book.report("m")["refused"] == 1
    # a retry of it is a duplicate: its fate, never a second application
    assert stage(co, "s0", "p1", "s2", tokens)["duplicate"]["applied"] is False
    check_leases(co.leases)


def test_an_abandoned_push_is_released_from_its_session_and_fenced(book):
    co, sent, _ = book
    tokens = lease(co, "s2")
    reply = route(co, "daskdist_async_abandon")(session="s2", model="m", pid="p9",
                                                 tokens=tokens)
    assert reply == {"staged": False, "released": 10}
    # a holder staging it later (the push was on its way) finds it given up
    assert stage(co, "s0", "p9", "s2", tokens)["duplicate"]["applied"] is False
    # once staged, the book has its fate: abandoning it gives nothing back
    tokens = lease(co, "s2")
    assert stage(co, "s0", "p10", "s2", tokens)["staged"]
    assert route(co, "daskdist_async_abandon")(session="s2", model="m", pid="p10",
                                               tokens=tokens) == {"staged": True}
    assert leased_to(co.leases, "async:m", "ds", 0) != []
    check_leases(co.leases)


def test_only_the_holder_stages_and_a_lost_holder_moves_the_model(book):
    co, sent, _ = book
    tokens = lease(co, "s2")
    assert "refused" in stage(co, "s1", "p1", "s2", tokens)  # the standby is no holder
    assert stage(co, "s0", "p1", "s2", tokens)["staged"]
    co.async_book.on_copied("s1", tuple(Copied("m", "s1", 0, 0, [])))
    co.end_session("s0")
    address, role = roles(sent)[-1]
    assert (address, role.role, role.source, role.incarnation) == ("w1", HOLDER, "copy", 1)
    assert route(co, "daskdist_async_where")(session="s2", model="m")["phase"] == "moving"
    co.async_book.on_ready("s1", tuple(Ready("m", "s1", 1, 2, 0, "copy", 40, {}, [])))
    assert co.leases.progress("ds", 0)["free"] == 100  # the push was not in the copy
    where = route(co, "daskdist_async_where")(session="s2", model="m")
    assert where["holder"] == "w1" and where["phase"] == "ready" and where["version"] == 2
    # the new holder gets a standby of its own incarnation
    address, role = roles(sent)[-1]
    assert (address, role.role, role.standby) == ("w1", HOLDER, "w2")
    assert [r for a, r in roles(sent) if a == "w2" and r.role == STANDBY][-1].incarnation == 1
    check_leases(co.leases)


def test_a_coordinator_closed_while_a_model_is_made_is_an_answer_not_an_error():
    sent: list = []
    co = CoordinatorState("t", send=lambda address, msg: sent.append((address, msg)))
    co.closure_book.add_owner("me", None, "tok")
    co.start_session("s0", "w0", 1, "cpu", "", lambda a: False, 0.0)

    async def create_then_close():
        task = asyncio.ensure_future(route(co, "daskdist_async_create")(
            owner="me", token="tok", model="m", spec=b"spec", max_staleness=1,
            replica="resource-m"))
        await asyncio.sleep(0.01)
        co.drop_owner("me")  # its client pressed Ctrl-C: the owner goes
        return await task

    reply = asyncio.run(create_then_close())
    assert "its coordinator closed" in reply["closed"]
    assert [r.role for _, r in roles(sent)] == ["holder", "none"]


def test_a_standby_with_a_deadline_is_replaced_ahead_of_it(book):
    """The standby's worker gets a deadline within the horizon: the model gets another
    standby now (the holder is told to copy to it), the old one drops its copy; with no
    other member left to take it, a standby with a deadline keeps its copy."""
    co, sent, _ = book
    before = len(sent)
    co.preempt_book.notice("s1", time.time() + 60, "a test")
    got = [(a, r.role, r.standby) for a, r in roles(sent[before:])]
    assert ("w1", NONE, "") in got and ("w2", STANDBY, "") in got
    assert ("w0", HOLDER, "w2") in got
    assert co.async_book.models["m"].standby == "s2"
    before = len(sent)
    co.preempt_book.notice("s2", time.time() + 60, "a test")  # no member left to take it
    assert roles(sent[before:]) == [] and co.async_book.models["m"].standby == "s2"


def test_a_holder_with_a_deadline_hands_the_model_to_its_standby_losing_nothing(book):
    co, sent, _ = book
    tokens = lease(co, "s2")
    assert stage(co, "s0", "p1", "s2", tokens)["staged"]
    co.preempt_book.notice("s0", time.time() + 60, "a test")  # its worker told the book
    hand_over = route(co, "daskdist_async_hand_over")
    # a copy taken by another worker than the book's standby, or a caller that is not
    # the holder, moves nothing: the holder serves on
    assert "kept" in hand_over(session="s0", model="m", incarnation=0, version=1,
                               standby="w2")
    assert "kept" in hand_over(session="s1", model="m", incarnation=0, version=1,
                               standby="w1")
    # the holder applied p1 (its decision still on its way), its standby took version 1
    assert hand_over(session="s0", model="m", incarnation=0, version=1,
                     standby="w1") == {"moved": "w1"}
    address, role = roles(sent)[-1]
    assert (address, role.role, role.source, role.incarnation) == ("w1", HOLDER, "copy", 1)
    # late: counted, not settled
    co.async_book.on_decided("s0", tuple(Decision("m", "s0", 0, "p1", True, 1, 0, "", 80)))
    co.async_book.on_copied("s1", tuple(Copied("m", "s1", 0, 1, [["p1", 1]])))
    co.async_book.on_ready("s1", tuple(Ready("m", "s1", 1, 2, 1, "copy", 40, {}, [])))
    assert co.leases.progress("ds", 0)["acknowledged"] == 10  # p1 is in the new holder
    report = co.async_book.report("m")
    assert (report["handovers"], report["holder_losses"], report["rows_lost"]) == (1, 0, 0)
    assert report["applied"] == 1 and report["phase"] == "ready" and report["version"] == 2
    # its new standby is the worker without a deadline
    address, role = roles(sent)[-1]
    assert (address, role.role, role.standby) == ("w1", HOLDER, "w2")
    check_leases(co.leases)


def test_a_keep_alive_owners_model_outlives_its_client_and_goes_with_the_owner():
    sent: list = []
    co = CoordinatorState("t", send=lambda address, msg: sent.append((address, msg)))
    co.add_owner("me", "client-a", "tok", keep_alive=True)
    co.start_session("s0", "w0", 1, "cpu", "", lambda a: False, 0.0)

    async def create_then_leave():
        task = asyncio.ensure_future(route(co, "daskdist_async_create")(
            owner="me", token="tok", model="m", spec=b"spec", max_staleness=1,
            replica="resource-m"))
        await asyncio.sleep(0.01)
        co.async_book.on_ready("s0", tuple(Ready("m", "s0", 0, 0, 0, "fresh", 40, {}, [])))
        await task
        with dask.config.set({"daskdist.coordinator.keep-alive-timeout": "200ms"}):
            co.client_away("client-a", True)  # its kernel restarted
        assert co.owners_of("client-a", kept=False) == []  # nothing is dropped now
        assert co.status()["async_models"]["m"]["phase"] == "ready"
        deadline = time.monotonic() + 10
        while "m" in co.status()["async_models"]:  # nobody attached in time
            assert time.monotonic() < deadline, co.status()
            await asyncio.sleep(0.02)

    asyncio.run(create_then_leave())
    assert [r.role for _, r in roles(sent)] == ["holder", "none"]

"""CoordinatorState's session start, stop, draining and error raising, without Dask:
the scheduler plugin's handlers only look the coordinator up and call these."""

from __future__ import annotations

import asyncio
import time

import dask
import pytest

from daskdist.core.protocol import (
    CANCELLED,
    FAILED,
    HOSTS_UPDATED,
    PENDING,
    READY,
    UNSTARTED,
    USER_ERROR,
    CommitKey,
    Outcome,
)
from daskdist.plugins.scheduler.closures import GANG_OWNER
from daskdist.plugins.scheduler.polls import Outbox
from daskdist.plugins.scheduler.state import CoordinatorState
from tests.conftest import route
from tests.tables import check_queue


def make(sent: list | None = None) -> CoordinatorState:
    out = [] if sent is None else sent
    return CoordinatorState("t", send=lambda address, msg: out.append((address, msg)))


def not_retiring(address: str) -> bool:
    return False


def start(co: CoordinatorState, session: str, address: str, slots: int = 1,
          retiring=not_retiring) -> dict:
    return co.start_session(session, address, slots, "cpu", "", retiring, 0.0)


# -- session start and stop ---------------------------------------------------------------

def test_start_session_takes_the_lowest_free_index_and_a_lease():
    sent: list = []
    co = make(sent)
    # "observe": the window gang members sum their steps in (daskdist.observe.window)
    assert start(co, "s1", "w1") == {"index": 0, "num_workers": 1, "version": 1,
                                      "joins": 1, "renew": 1.0, "observe": 10.0, "warm": []}
    reply = start(co, "s2", "w2")
    assert reply["index"] == 1 and reply["num_workers"] == 2
    with dask.config.set({"daskdist.observe.enabled": False}):  # members measure nothing
        assert start(make([]), "s3", "w3")["observe"] == 0.0
    assert co.members.renew("s1", 1.0) and co.members.renew("s2", 1.0)
    co.stop_session("s1")
    assert start(co, "s3", "w3")["index"] == 0  # a replacement reuses the lost index
    assert start(co, "s4", "w4")["index"] == 2
    check_queue(co.queue)


def test_group_members_hear_of_membership_changes_once_per_interval():
    """Joins and leaves reach the group's members (what State.commit() compares) in one
    message per membership-interval, however many there were; other workers read the
    version from their exchange replies."""
    sent: list = []
    co = make(sent)
    for s, w in (("s1", "w1"), ("s2", "w2")):
        start(co, s, w)
    _formed_group(co, ("s1", "s2"))
    sent.clear()

    async def run() -> None:
        for i in range(5):  # a burst of joins within one interval
            start(co, f"j{i}", f"wj{i}")
        assert not [m for _, m in sent if m["op"] == "daskdist-membership"]
        await until(lambda: any(m["op"] == "daskdist-membership" for _, m in sent))

    asyncio.run(run())
    # addressed to each member's own session, with the joins count (skip_sync)
    told = [(a, m["session"], m["version"], m["joins"])
            for a, m in sent if m["op"] == "daskdist-membership"]
    v, j = co.members.version, co.members.joins
    assert told == [("w1", "s1", v, j), ("w2", "s2", v, j)] and j == 7


def test_a_new_session_of_the_same_worker_ends_the_old_one():
    co = make()
    start(co, "old", "w1")
    co.queue.put("o-0", "me", b"")
    assert [c.cid for c in co.queue.dispatch("old", 1)] == ["o-0"]
    assert start(co, "new", "w1")["index"] == 0
    assert "old" not in co.members and not co.members.renew("old", 1.0)  # fenced
    assert co.workers_lost == 0  # a restart of the plugin, not a loss
    assert [c.cid for c in co.queue.dispatch("new", 1)] == ["o-0"]  # put back


def test_a_retiring_worker_joins_draining():
    co = make()
    start(co, "s1", "w1", retiring=lambda address: address == "w1")
    co.queue.put("o-0", "me", b"")
    assert co.queue.dispatch("s1", 1) == []
    assert co.members.members["s1"].draining


def test_stop_session_applies_its_last_results_then_ends_it():
    co = make()
    co.outboxes["me"] = Outbox(None)
    start(co, "s1", "w1")
    co.queue.put("o-0", "me", b"")
    co.queue.put("o-1", "me", b"")
    co.queue.dispatch("s1", 1)
    co.stop_session("s1", [Outcome("o-0", READY, b"v", None, 1)])
    assert co.outboxes["me"].items == [Outcome("o-0", READY, b"v", None, 1, "me")]
    assert "s1" not in co.members and co.workers_lost == 0
    co.stop_session("s1")  # twice: nothing happens
    assert co.queue.queued == 1


# -- draining -------------------------------------------------------------------------------

def test_retiring_worker_gets_no_new_work_and_leaves_the_group_at_its_next_commit():
    co = make()
    start(co, "s1", "w1")
    start(co, "s2", "w2")
    co.gangs.begin_formation(("s1", "s2"))
    for i in range(3):
        co.queue.put(f"o-{i}", "me", b"")
    version = co.members.version
    co.worker_status_changed("w1", "closing_gracefully")
    assert co.members.members["s1"].draining
    assert co.queue.dispatch("s1", 3) == []
    assert co.members.version == version + 1  # a group member retires: commits see it
    co.worker_status_changed("w1", "running")  # Dask gave the retirement up
    assert not co.members.members["s1"].draining
    assert co.members.version == version + 1  # still in the group: nothing to rejoin
    assert len(co.queue.dispatch("s1", 3)) == 3
    co.gangs.begin_formation(("s2",))  # a group formed without w1 while it retired
    co.worker_status_changed("w1", "closing_gracefully")
    assert co.members.version == version + 1  # not a member: leaving changes nothing
    co.worker_status_changed("w1", "running")
    assert co.members.version == version + 2  # back in service: joins at the next commit


def test_a_retired_worker_the_group_left_ends_without_a_membership_change():
    """A retirement re-forms the group once; the retired worker's session
    ending later is no second change for the group's members (no second interrupt)."""
    co = make()
    for i in range(3):
        start(co, f"s{i}", f"w{i}")
    co.gangs.begin_formation(("s0", "s1", "s2"))
    version = co.members.version
    co.worker_status_changed("w0", "closing_gracefully")  # rank 0 retires
    assert co.members.version == version + 1
    co.gangs.begin_formation(("s1", "s2"))  # the survivors re-formed without it
    co.worker_removed("s0", expected=True)
    assert "s0" not in co.members and co.members.leaves == 1
    assert co.members.version == version + 1  # its retirement was the change
    co.stop_session("s2")  # a group member leaving is one
    assert co.members.version == version + 2
    co.worker_status_changed("w1", "closing_gracefully")  # retiring, still in the group
    co.end_session("s1")
    assert co.members.version == version + 4  # retirement and leave: the group changed


def test_a_memory_pause_drains_without_changing_the_group():
    co = make()
    start(co, "s1", "w1")
    co.gangs.begin_formation(("s1",))
    co.queue.put("o-0", "me", b"")
    version = co.members.version
    co.worker_status_changed("w1", "paused")
    assert co.queue.dispatch("s1", 1) == [] and co.members.version == version
    co.worker_status_changed("w1", "running")
    assert len(co.queue.dispatch("s1", 1)) == 1 and co.members.version == version
    co.worker_status_changed("unknown-worker", "closing")  # not a member: no-op
    assert co.members.version == version


async def until(cond, seconds: float = 5.0) -> None:
    """Let the loop run until ``cond()`` holds (at most ``seconds``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


# -- raising an error -------------------------------------------------------------------------

def test_raise_error_waits_for_in_flight_then_cancels_the_queue():
    async def main():
        co = make()
        co.closure_book.add_owner("me", None, "t")
        start(co, "s", "w", slots=2)
        assert await co.closure_book.raise_error("me") == {"error": None, "cancelled": []}
        for i in range(4):
            co.queue.put(f"o-{i}", "me", b"")
        co.queue.dispatch("s", 2)
        co.closure_book.apply_results("s", [Outcome("o-0", FAILED, b"boom", USER_ERROR, 1)])
        co.gangs.submit("g-0", "me", b"")
        task = asyncio.ensure_future(co.closure_book.raise_error("me", timeout=5))
        await until(lambda: co.closure_book.hold)
        assert not task.done() and co.closure_book.hold == ["me"]  # o-1 still runs: held meanwhile
        co.closure_book.apply_results("s", [Outcome("o-1", READY, b"ok", None, 1)])
        got = await asyncio.wait_for(task, 5)
        assert got["error"] == ("o-0", b"boom", USER_ERROR)
        assert sorted(got["cancelled"]) == [("me", "g-0"), ("me", "o-2"), ("me", "o-3")]
        assert not co.closure_book.hold and co.queue.errors == {}
        cancelled = {d.cid for d in co.outboxes["me"].items if d.state == CANCELLED}
        assert cancelled == {"o-2", "o-3", "g-0"}
        assert await co.closure_book.raise_error("me") == {"error": None, "cancelled": []}

    asyncio.run(main())


def test_raise_error_times_out_and_unpauses():
    async def main():
        co = make()
        co.closure_book.add_owner("me", None, "t")
        start(co, "s", "w", slots=2)
        co.queue.put("o-0", "me", b"")
        co.queue.put("o-1", "me", b"")
        co.queue.dispatch("s", 2)
        co.closure_book.apply_results("s", [Outcome("o-0", FAILED, b"boom", USER_ERROR, 1)])
        assert await co.closure_book.raise_error("me", timeout=0.05) == {"timeout": True}
        # still there for the next raise
        assert not co.closure_book.hold and "me" in co.queue.errors
        co.closure_book.apply_results("s", [Outcome("o-1", READY, b"ok", None, 1)])
        got = await co.closure_book.raise_error("me", timeout=5)
        assert got["error"][0] == "o-0" and got["cancelled"] == []

    asyncio.run(main())


def test_an_owners_error_is_raised_to_it_alone_and_holds_only_its_work():
    """Two owners share a coordinator (two notebooks, one name): B's error is B's; A's
    closures run while B's raise waits, and A's raise finds nothing."""
    async def main():
        co = make()
        co.closure_book.add_owner("a", None, "ta")
        co.closure_book.add_owner("b", None, "tb")
        start(co, "s", "w", slots=2)
        co.queue.put("b-0", "b", b"")
        co.queue.put("b-1", "b", b"")
        co.queue.dispatch("s", 2)
        co.closure_book.apply_results("s", [Outcome("b-0", FAILED, b"KeyError", USER_ERROR, 1)])
        assert [o.cid for o in co.outboxes["b"].items] == ["b-0"]
        assert co.outboxes["a"].items == [] and not co.outboxes["a"].event.is_set()
        raising = asyncio.ensure_future(co.closure_book.raise_error("b", timeout=5))
        await until(lambda: co.closure_book.hold == ["b"])
        co.queue.put("a-0", "a", b"")
        co.queue.put("b-2", "b", b"")  # queued while b's raise waits: cancelled
        assert [c.cid for c in co.queue.dispatch("s", 5)] == ["a-0"]
        assert await co.closure_book.raise_error("a") == {"error": None, "cancelled": []}
        co.closure_book.apply_results("s", [Outcome("a-0", READY, b"ok", None, 1),
                               Outcome("b-1", READY, b"ok", None, 1)])
        got = await asyncio.wait_for(raising, 5)
        assert got == {"error": ("b-0", b"KeyError", USER_ERROR), "cancelled": [("b", "b-2")]}

    asyncio.run(main())


def test_a_memory_pause_keeps_the_group_and_gives_prefetched_work_back():
    """A paused member stays a candidate of the next generation (no re-formation on
    pause or unpause) and is asked to give back what it had not started."""
    sent: list = []
    co = make(sent)
    start(co, "s1", "w1")
    start(co, "s2", "w2")
    co.gangs.begin_formation(("s1", "s2"))
    co.worker_status_changed("w1", "paused")
    assert co.active_sessions() == ("s1", "s2")
    assert ("w1", {"op": "daskdist-steal", "name": "t", "n": 2**31}) in sent
    co.worker_status_changed("w1", "running")
    assert co.active_sessions() == ("s1", "s2")


def test_drop_owner_cancels_its_queue_and_releases_its_resources_only():
    sent: list = []
    co = make(sent)
    co.closure_book.add_owner("a", None, "ta")
    co.closure_book.add_owner("b", None, "tb")
    start(co, "s", "w")
    co.resource_book.add("a", "ra", b"spec")
    co.resource_book.add("b", "rb", b"spec")
    co.queue.put("a-0", "a", b"")
    co.queue.put("a-1", "a", b"")
    co.queue.put("b-0", "b", b"")
    co.queue.dispatch("s", 1)
    co.closure_book.apply_results("s", [Outcome("a-0", READY, b"v", None, 1)])
    unread = co.drop_owner("a")
    assert [o.cid for o in unread] == ["a-0"]  # finished before the close: still its value
    assert "a" not in co.outboxes and co.queue.queued == 1 and set(co.resources) == {"rb"}
    assert ("w", {"op": "daskdist-release", "name": "t", "rids": ["ra"]}) in sent


def test_closing_an_owner_ends_its_raise_and_keeps_its_work_held():
    """close() while join() waits in a raise for a long closure: the raise ends at once,
    and the closed owner's closures stay held (its prefetched ones never start)."""
    async def main():
        co = make()
        co.closure_book.add_owner("me", None, "t")
        start(co, "s", "w", slots=2)
        for i in range(3):
            co.queue.put(f"me-{i}", "me", b"")
        co.queue.dispatch("s", 3)
        co.closure_book.apply_results("s", [Outcome("me-0", FAILED, b"boom", USER_ERROR, 1)])
        raising = asyncio.ensure_future(co.closure_book.raise_error("me"))
        await until(lambda: co.closure_book.hold == ["me"])
        co.drop_owner("me")
        got = await asyncio.wait_for(raising, 5)
        assert got["error"] is None
        # me-1 runs on; me-2 was prefetched: it must not start
        assert co.closure_book.hold == ["me"]
        co.closure_book.apply_results("s", [Outcome("me-2", PENDING, None, UNSTARTED, 1),
                               Outcome("me-1", READY, b"late", None, 1)])
        assert co.queue.unfinished("me") == 0
        assert co.closure_book.hold == [] and co.closure_book.dropped == set()

    asyncio.run(main())


# -- gangs and commits ----------------------------------------------------------------------

def _formed_group(co: CoordinatorState, sessions: tuple[str, ...]) -> None:
    generation = co.gangs.begin_formation(sessions)
    co.gangs.formation_done(generation, True)


def _running_gang(sent: list) -> tuple[CoordinatorState, object, list]:
    co = make(sent)
    for s, w in (("s1", "w1"), ("s2", "w2"), ("s3", "w3")):
        start(co, s, w)
    _formed_group(co, ("s1", "s2", "s3"))
    co.gangs.submit("g", "me", b"")
    gang, members = co.gangs.start_next()
    for cid, session, _ in members:
        co.queue.put(cid, GANG_OWNER, b"", pinned=session)
        co.queue.dispatch(session, 1)
    sent.clear()
    return co, gang, members


def test_a_members_user_error_tells_the_peers_at_once_why():
    sent: list = []
    co, gang, members = _running_gang(sent)
    cid, session, _ = members[1]
    co.closure_book.apply_results(session, [Outcome(cid, FAILED, b"err", USER_ERROR, 1)])
    told = [(a, m) for a, m in sent if m["op"] == "daskdist-peer-lost"]
    assert sorted(a for a, _ in told) == ["w1", "w2", "w3"]
    assert all(m["generation"] == gang.generation and "rank 1" in m["reason"]
               for _, m in told)


def test_a_broken_generations_members_are_told_once_however_many_leave():
    """The first loss tells every survivor (peer-lost, with the counters);
    later losses in the same generation (a node's other workers) send nothing, and the
    next generation's members hear its own first loss again."""
    sent: list = []
    co = make(sent)
    for i in range(5):
        start(co, f"s{i}", f"w{i}")
    _formed_group(co, tuple(f"s{i}" for i in range(5)))
    sent.clear()
    co.worker_removed("s0", expected=False)  # rank 0
    told = [(a, m["session"], m["version"]) for a, m in sent]
    assert [m["op"] for _, m in sent] == ["daskdist-peer-lost"] * 4
    assert told == [(f"w{i}", f"s{i}", co.members.version) for i in range(1, 5)]
    sent.clear()
    co.worker_removed("s3", expected=False)
    co.end_session("s2")
    co.flush()  # no membership message either: the next formation carries the counters
    assert sent == [] and co.members.version == co.members.joins + 3
    _formed_group(co, ("s1", "s4"))
    start(co, "s5", "w5")  # a join: the formed group's members hear it
    assert [(a, m["op"]) for a, m in sent] == [("w1", "daskdist-membership"),
                                               ("w4", "daskdist-membership")]
    sent.clear()
    co.end_session("s4")  # the new generation's first loss: told at once
    assert [(a, m["op"]) for a, m in sent] == [("w1", "daskdist-peer-lost")]


def test_a_wide_groups_loss_is_told_down_a_tree_in_fanout_messages():
    """Beyond ``relay-fanout`` members the scheduler tells the tree's top and
    a lost rank's children; the others hear from their parents (the init named them)."""
    sent: list = []
    with dask.config.set({"daskdist.collective.relay-fanout": 2}):
        co = make(sent)
    for i in range(7):
        start(co, f"s{i}", f"w{i}")
    _formed_group(co, tuple(f"s{i}" for i in range(7)))
    sent.clear()
    co.worker_removed("s0", expected=False)  # rank 0: its children 2 and 3 in its place
    assert [(a, m["op"], m["session"]) for a, m in sent] == [
        ("w1", "daskdist-peer-lost", "s1"), ("w2", "daskdist-peer-lost", "s2"),
        ("w3", "daskdist-peer-lost", "s3")]  # 4, 5 hear from rank 1, 6 from rank 2
    assert all(m["version"] == co.members.version for _, m in sent)
    sent.clear()
    co.worker_removed("s2", expected=False)  # it may have died before passing it on
    assert [(a, m["session"]) for a, m in sent] == [("w6", "s6")]
    sent.clear()
    co.worker_removed("s5", expected=False)  # a leaf: no one below it
    assert sent == []


def test_an_interruption_every_rank_raises_tells_no_one():
    """HostsUpdatedInterrupt comes from every rank at the same commit: a word to the
    peers could only turn a rank's interrupt still in its allgather into an error."""
    sent: list = []
    co, _gang, members = _running_gang(sent)
    cid, session, _ = members[0]
    co.closure_book.apply_results(session, [Outcome(cid, FAILED, b"err", HOSTS_UPDATED, 1)])
    assert co.gangs.group.broken
    assert not [m for _, m in sent if m["op"] == "daskdist-peer-lost"]


def test_a_commit_whose_parts_do_not_all_come_expires_refused():
    co = make()
    for s, w in (("s1", "w1"), ("s2", "w2")):
        start(co, s, w)
    _formed_group(co, ("s1", "s2"))
    key = CommitKey("state", co.gangs.group.generation, 1)

    async def run():
        ok = await co.group_book.gang_commit_part("s1", key, 0, 2, [], 0.05)  # s2's part never came
        late = await co.group_book.gang_commit_part("s2", key, 1, 2, [], 5.0)
        return ok, late

    assert asyncio.run(run()) == (False, False)
    assert co.group_book.commit_outcome("s1", key) is False and not co.group_book.commit_events


def test_a_commit_part_waits_at_most_the_groups_timeout_and_checks_its_tokens():
    """A part's caller cannot keep a commit open past the group's own timeout (it asked
    for a day: refused after the group's 0.2 s), nor send tokens that are not a list
    of lease tokens (a TypeError naming them; a malformed one refuses the commit)."""
    import time

    co = make()
    for s, w in (("s1", "w1"), ("s2", "w2")):
        start(co, s, w)
    _formed_group(co, ("s1", "s2"))
    co.gangs.configure("gloo", 0.2)
    part = route(co, "daskdist_gang_commit_part")
    key = list(CommitKey("state", co.gangs.group.generation, 1))

    async def run():
        t0 = time.monotonic()
        ok = await part(session="s1", key=key, rank=0, world=2, tokens=[], timeout=86400.0)
        return ok, time.monotonic() - t0

    ok, waited = asyncio.run(run())
    assert ok is False and waited < 5.0
    with pytest.raises(TypeError, match="tokens must be a list"):
        asyncio.run(part(session="s1", key=key, rank=0, world=2, tokens="abc", timeout=1.0))
    with pytest.raises(ValueError, match="timeout must be in"):
        asyncio.run(part(session="s1", key=key, rank=0, world=2, tokens=[], timeout=-1.0))
    bad = list(CommitKey("state", co.gangs.group.generation, 2))
    assert asyncio.run(part(session="s1", key=bad, rank=0, world=1,
                            tokens=[["lease", "ds", "x", []]], timeout=1.0)) is False


def test_forgetting_a_dataset_forgets_its_counters():
    """The dashboard's per-dataset row counts go with the dataset (its handle released,
    its owner closed): nothing kept per dataset grows with the datasets ever made."""
    co = make()
    co.closure_book.add_owner("me", None, "t")
    start(co, "s1", "w1")
    for rid in ("dataset-a", "dataset-b"):
        co.resource_book.add("me", rid, b"spec")
        co.leases.define(rid, [(10, 2)], owner="me")
        assert co.leases.ack("s1", rid, 0, co.leases.acquire("s1", rid, 0, 20))
        co.leases.define(rid + ".1", [(5, 1)])
    assert set(co.stats.dataset_rows) == {"dataset-a", "dataset-b"}
    co.resource_book.release(["dataset-a"])
    assert set(co.stats.dataset_rows) == {"dataset-b"}
    assert set(co.leases.datasets) == {"dataset-b", "dataset-b.1"}
    co.drop_owner("me")
    assert co.stats.dataset_rows == {} and co.leases.datasets == {}


def test_a_non_member_leaving_refuses_no_open_commit():
    co = make()
    for s, w in (("s1", "w1"), ("s2", "w2"), ("s3", "w3")):
        start(co, s, w)
    _formed_group(co, ("s1", "s2"))
    key = CommitKey("state", co.gangs.group.generation, 1)

    async def run():
        part = asyncio.ensure_future(co.group_book.gang_commit_part("s1", key, 0, 2, [], 5.0))
        while key not in co.group_book.commit_events:  # s1's part is in, waiting for s2's
            await asyncio.sleep(0)
        co.end_session("s3", expected=False)  # not in the group
        assert not part.done()
        return await co.group_book.gang_commit_part("s2", key, 1, 2, [], 5.0), await part

    assert asyncio.run(run()) == (True, True)
    assert co.group_book.state_commits("s1", "state") == 1  # the book knows this State committed



# -- work per event that does not grow with the cluster ----------------------------

def test_membership_index_is_the_lowest_free_and_sessions_are_found_by_address():
    import random

    from daskdist.core.membership import Membership

    m = Membership()
    rng = random.Random(0)
    live: dict[str, str] = {}
    for k in range(400):
        if live and rng.random() < 0.45:
            session = rng.choice(sorted(live))
            m.leave(session)
            del live[session]
        else:
            used = {x.index for x in m.members.values()}
            member, _ = m.join(f"s{k}", f"w{k}")
            assert member.index == min(set(range(len(used) + 1)) - used)
            live[f"s{k}"] = f"w{k}"
        for session, address in live.items():
            assert m.session_of(address) == session
    assert m.session_of("nobody") is None


def test_liveness_expires_in_renewal_order_even_when_clocks_come_out_of_order():
    from daskdist.core.membership import LivenessTable

    t = LivenessTable(timeout=10)
    for i, s in enumerate("abcde"):
        t.add(s, float(i))
    t.renew("a", 20.0)
    t.renew("c", 15.0)  # older than the newest renewal: the order is restored lazily
    assert t.expire(13.5) == ["b", "d"]
    assert t.expire(25.5) == ["e", "c"]
    assert t.expire(31.0) == ["a"] and len(t) == 0


class _Comm:
    def closed(self) -> bool:
        return False


def test_a_put_wakes_one_long_poll_per_closure():
    """N idle workers long-poll; one queued closure wakes one of them (not all N), and a
    paused worker's long-poll is never the one woken."""
    co = make()
    book = co.closure_book
    co.closure_book.add_owner("me", None, "t")
    for i in range(6):
        start(co, f"s{i}", f"w{i}")
    co.members.poll_base = 30.0

    async def run():
        polls = {f"s{i}": asyncio.ensure_future(book.exchange(_Comm(), f"s{i}", [], [], 1, True))
                 for i in range(6)}
        await until(lambda: len(book.polls.waiters) == 6)
        co.worker_status_changed("w0", "paused")
        await until(lambda: len(book.polls.waiters) == 5 and len(book.polls.idle_waiters) == 1)
        book.put("me", "t", [("me-0", (b"f", None), 0)])
        await until(lambda: sum(p.done() for p in polls.values()) == 1)
        for _ in range(20):
            await asyncio.sleep(0)
        done = [s for s, p in polls.items() if p.done()]
        assert len(done) == 1 and done != ["s0"]
        assert [d[0] for d in polls[done[0]].result()["closures"]] == ["me-0"]
        co.close()
        await asyncio.gather(*polls.values())

    asyncio.run(run())
    check_queue(co.queue)


def test_a_gang_commit_in_one_message_from_rank_0():
    """Every rank's part in one message (daskdist_gang_commit: each rank's tokens packed
    as the commit's allgather carries them): applied at once when rank 0 sends every
    part and each rank's rows are leased to its session; refused from another rank,
    with a part missing, a row its rank does not hold, a dataset key defined nowhere or
    a malformed part."""
    from daskdist.core.leases.commits import pack_tokens
    from daskdist.core.protocol import LeaseToken, dataset_key

    co = make()
    for s, w in (("s1", "w1"), ("s2", "w2")):
        start(co, s, w)
    _formed_group(co, ("s1", "s2"))
    co.leases.define("ds", [(10, 4)])
    r1 = co.leases.acquire("s1", "ds", 0, 20)
    r2 = co.leases.acquire("s2", "ds", 0, 20)
    gen = co.gangs.group.generation
    book = co.group_book

    def packed(r, a, b):
        return pack_tokens([LeaseToken.of("ds", 0, [(r[0][0] + a, r[0][0] + b)])])

    def parts(a, b):
        return [packed(r1, a, b), packed(r2, a, b)]

    assert book.gang_commit("s2", ["st", gen, 1], 2, parts(0, 5)) is False  # not rank 0
    assert book.gang_commit("s1", ["st", gen, 2], 2, parts(0, 5)[:1]) is False  # a part short
    assert book.gang_commit("s1", ["st", gen, 3], 2, [[], packed(r1, 0, 1)]) is False  # s1's rows
    unknown = [dataset_key("other"), 0, 1, r1[0][0], r1[0][0] + 1]
    assert book.gang_commit("s1", ["st", gen, 5], 2, [unknown, []]) is False  # no such dataset
    assert book.gang_commit("s1", ["st", gen, 6], 2, [packed(r1, 0, 5)[:-1], []]) is False
    assert book.gang_commit("s1", ["st", gen, 7], 2, [["x", 0, 1, 0, 1], []]) is False
    assert co.leases.progress("ds", 0)["acknowledged"] == 0
    assert book.gang_commit("s1", ["st", gen, 4], 2, parts(0, 5)) is True
    assert co.leases.progress("ds", 0)["acknowledged"] == 10
    assert book.gang_commit("s1", ["st", gen, 4], 2, parts(5, 10)) is True  # decided: kept
    assert co.leases.progress("ds", 0)["acknowledged"] == 10
    assert co.group_book.state_commits("s1", "st") == 1


def _s2_holds_the_tail(sent: list):
    """A coordinator of sessions s1 and s2, an owner "me", and dataset "ds" whose rows
    are all leased to s2 (the epoch's tail): ``(co, s2's rows)``."""
    co = make(sent)
    co.closure_book.add_owner("me", None, "t")
    for s, w in (("s1", "w1"), ("s2", "w2")):
        start(co, s, w)
    co.leases.define("ds", [(10, 2)])
    rows = []
    while co.leases.progress("ds", 0)["free"]:
        rows += co.leases.acquire("s2", "ds", 0, 20)
    return co, rows


def test_a_tail_closure_goes_to_the_worker_holding_its_datasets_rows():
    """A closure reading a dynamic dataset (Submission.dataset) at the epoch's tail (no
    free rows; s2 holds the last leased rows): s1's exchange sets it aside, steals
    nothing from s2 and gets the untagged closure behind it; s2's takes it; once s2's
    rows are acknowledged, anyone would."""
    sent: list = []
    co, rows = _s2_holds_the_tail(sent)
    book = co.closure_book
    book.put("me", "t", [("me-0", (b"f", None), 0, "ds"), ("me-1", (b"f", None), 0, ""),
                         ("me-2", (b"f", None), 0, "ds")])

    async def run():
        got = await book.exchange(_Comm(), "s1", [], [], 5, False)
        assert [d[0] for d in got["closures"]] == ["me-1"]
        got = await book.exchange(_Comm(), "s1", [], ["me-1"], 5, True)  # idle, blocks
        assert got["closures"] == [] and book.polls.steals == 0
        got = await book.exchange(_Comm(), "s2", [], [], 5, False)  # a fair share: 1
        assert [d[0] for d in got["closures"]] == ["me-0"]
        got = await book.exchange(_Comm(), "s2", [], ["me-0"], 5, False)
        assert [d[0] for d in got["closures"]] == ["me-2"]

    co.members.poll_base = 0.05
    asyncio.run(run())
    assert not [m for _, m in sent if m.get("op") == "daskdist-steal"]
    co.leases.ack("s2", "ds", 0, rows)
    assert co.leases.takes("ds", "s1")
    check_queue(co.queue)


def test_a_closure_set_aside_at_the_tail_wakes_a_waiting_worker_once_the_epoch_completes():
    """s2 holds the epoch's last rows, so a closure reading the dataset is set aside for
    it; s1 waits idle in its long-poll. When s2's rows are acknowledged (the epoch
    complete) s1's long-poll gets the closure at once, not after the poll interval."""
    co, rows = _s2_holds_the_tail([])
    book = co.closure_book
    book.put("me", "t", [("me-0", (b"f", None), 0, "ds")])
    co.members.poll_base = 30.0

    async def run():
        assert (await book.exchange(_Comm(), "s1", [], [], 5, False))["closures"] == []
        waiting = asyncio.ensure_future(book.exchange(_Comm(), "s1", [], [], 5, True))
        deadline = time.monotonic() + 5
        while "s1" not in book.polls.parked:  # s1 parks in its long-poll
            assert time.monotonic() < deadline and not waiting.done()
            await asyncio.sleep(0)
        t0 = time.monotonic()
        co.leases.ack("s2", "ds", 0, rows)
        got = await asyncio.wait_for(waiting, 5)
        assert [d[0] for d in got["closures"]] == ["me-0"]
        assert time.monotonic() - t0 < 1.0

    asyncio.run(run())
    check_queue(co.queue)


def test_a_closure_reading_a_per_worker_iterator_names_its_dataset():
    """The client tags a closure whose argument is a dataset's per-worker iterator with
    the dataset's id (Submission.dataset), whichever argument it is; else ''."""
    from daskdist.client.closures import ResourceHandle, _dataset_read

    ds = ResourceHandle("ds-1", "dataset")
    it = ResourceHandle("it-1", "iterator", parent=ds)
    other = ResourceHandle("r-1", "resource")
    assert _dataset_read((1, it), {}) == "ds-1"
    assert _dataset_read((), {"batches": it, "x": other}) == "ds-1"
    assert _dataset_read((other, ds), None) == ""
    assert _dataset_read((), {}) == ""


def test_every_session_route_answers_an_ended_session_with_one_reply():
    """A call naming a session that ended (or never was) gets the route's one reply,
    SESSION_ENDED (a commit's: refused), checked by the route before its method runs;
    the live session's replies are as they were, and its lease renewed."""
    from daskdist.core.protocol import OWNER_OR_SESSION, SESSION, SESSION_ENDED, CommitKey
    from daskdist.plugins.scheduler.plugin import BOOK_ROUTES

    co = make()
    co.closure_book.add_owner("me", None, "t")
    start(co, "live", "w1")
    start(co, "gone", "w2")
    co.leases.define("ds", [(10, 4)])
    co.end_session("gone")
    key = list(CommitKey("st", 1, 1))
    ds = dict(dataset_id="ds", epoch=0)
    calls = {
        "daskdist_lease_acquire": dict(**ds, rows=5),
        "daskdist_lease_release": dict(**ds, ranges=[[0, 1]]),
        "daskdist_unit_length": dict(**ds, unit=0, length=10),
        "daskdist_dataset_define": dict(dataset=["d2", "", [[5, 1]], 0, None, False,
                                                 False, None]),
        "daskdist_dataset_helpers": {},
        "daskdist_dataset_ledger": dict(state="st"),
        "daskdist_restore_ledger": dict(state="st", ledger={}),
        "daskdist_checkpoint_written": dict(state="st", url="u", commits=1, seconds=0.1,
                                            nbytes=1),
        "daskdist_commit_outcome": dict(key=key),
        "daskdist_state_commits": dict(state="st"),
        "daskdist_gang_commit": dict(key=key, world=1, parts=[[]]),
        "daskdist_get_resource": dict(rid="r"),
        "daskdist_report": dict(results=[]),
        "daskdist_renew": {},
        "daskdist_session_ready": {},
        "daskdist_infer_unit": dict(report=["none", "c#1", [], "", 0, [], "u", "", b""]),
        "daskdist_infer_plan": dict(job="none"),
        "daskdist_infer_finalized": dict(job="none", ok=True),
        "daskdist_preemption": dict(deadline=2e9, reason="a test"),
        "daskdist_async_where": dict(model="m"),
        "daskdist_async_stage": dict(stage=["m", 0, "p", "s", "w", [], 0, 1, 0.1]),
        "daskdist_async_ledger": dict(model="m", version=0, applied=[]),
        "daskdist_async_abandon": dict(model="m", pid="p", tokens=[]),
        "daskdist_async_hand_over": dict(model="m", incarnation=0, version=0, standby="w"),
    }
    sessions = {op for table in BOOK_ROUTES.values() for op, r in table.items()
                if r.caller in (SESSION, OWNER_OR_SESSION)}
    assert sessions == set(calls) | {"daskdist_exchange", "daskdist_gang_commit_part",
                                     "daskdist_rank_stuck"}
    assert asyncio.run(route(co, "daskdist_rank_stuck")(session="gone")) == SESSION_ENDED
    for op, kw in calls.items():
        ended = next(t[op] for t in BOOK_ROUTES.values() if op in t).ended
        assert route(co, op)(session="gone", **kw) == ended, op
        assert route(co, op)(session="never-a-member", **kw) == ended, op
    assert asyncio.run(route(co, "daskdist_exchange")(
        comm=_Comm(), session="gone", results=[], held=[], want=1,
        block=False)) == SESSION_ENDED
    live = {op: route(co, op)(session="live", **kw) for op, kw in calls.items()}
    assert live["daskdist_lease_acquire"]["lease"] and live["daskdist_lease_release"] == 1
    assert live["daskdist_renew"] == {"ok": True}
    assert live["daskdist_commit_outcome"] is False
    assert live["daskdist_state_commits"] == 0 and live["daskdist_checkpoint_written"] is None
    assert "hold" in live["daskdist_report"] and live["daskdist_get_resource"] is None
    assert "closures" in asyncio.run(route(co, "daskdist_exchange")(
        comm=_Comm(), session="live", results=[], held=[], want=1, block=False))
    assert all(reply != SESSION_ENDED for reply in live.values())


def test_the_worker_side_recognises_the_ended_reply_in_one_place():
    """SessionServices._reply: SESSION_ENDED ends the services (later calls are refused
    at once) and gives the call's "nothing", or raises CollectiveError for a call that
    needs the session (elastic commits); any other reply passes as it is."""
    from daskdist.core.protocol import SESSION_ENDED
    from daskdist.errors import CollectiveError
    from daskdist.plugins.worker.services import SessionServices

    class _Worker:
        address = "tcp://w:1"

    services = SessionServices(_Worker(), "t", "s1")
    assert services._reply({"lease": [[0, 5]]}, None) == {"lease": [[0, 5]]}
    assert services._reply(3, 0) == 3 and not services.ended
    assert services._reply(SESSION_ENDED, 0) == 0 and services.ended
    fresh = SessionServices(_Worker(), "t", "s2")
    with pytest.raises(CollectiveError, match="ended"):
        fresh._reply(SESSION_ENDED)
    assert fresh.ended
    assert fresh.acquire("ds", 0, 5) is None and fresh.release("ds", 0, [(0, 5)]) == 0


def test_a_session_that_joins_with_resources_to_build_warms_out_of_the_group():
    """With per-worker resources registered, a joining session warms: it runs closures,
    but stays out of the group and the membership counters (the members' commits do not
    interrupt) until it says it built them; then it counts as a join."""
    co = make()
    co.closure_book.add_owner("me", None, "t")
    start(co, "s1", "w1")
    co.resource_book.add("me", "resource-a", b"spec")
    co.resource_book.add("me", "iterator-b", b"spec")
    before = co.members.counters()
    reply = start(co, "s2", "w2")
    assert reply["warm"] == ["resource-a"]  # built ahead; an iterator is not
    assert co.members.counters() == before and co.active_sessions() == ("s1",)
    assert (co.status()["workers"], co.status()["warming"]) == (2, 1)
    assert route(co, "daskdist_session_ready")(session="gone") is None  # its ended reply
    route(co, "daskdist_session_ready")(session="s2")
    assert co.status()["warming"] == 0
    after = co.members.counters()
    assert after == {"version": before["version"] + 1, "joins": before["joins"] + 1}
    assert co.active_sessions() == ("s1", "s2")
    route(co, "daskdist_session_ready")(session="s2")  # once only
    assert co.members.counters() == after
    co.end_session("s2")
    assert co.members.counters()["version"] == after["version"] + 1
    start(co, "s3", "w3")  # a warming session that ends before it is ready
    assert co.status()["warming"] == 1
    co.end_session("s3")
    assert co.status()["warming"] == 0

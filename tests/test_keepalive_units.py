"""What the scheduler keeps for a keep-alive owner (``core.lifetime.keepalive``), and its keep
book on a CoordinatorState driven without Dask: outcomes kept until read, their bytes
against ``keep-results`` (the owner's queue held past it), attaching to the owner."""

from __future__ import annotations

import dask
import pytest
from hypothesis import given
from hypothesis import strategies as st

from daskdist.core.lifetime.keepalive import (
    OVERHEAD,
    KeptResults,
    gang_of,
    next_seq,
    seq_of,
    size_of,
)
from daskdist.core.protocol import CANCELLED, READY, Outcome
from daskdist.plugins.scheduler.state import CoordinatorState
from tests.conftest import route

CIDS = st.builds(lambda g, n: f"owner-{'g' if g else ''}{n}", st.booleans(),
                 st.integers(0, 30))
EVENTS = st.lists(st.one_of(
    st.tuples(st.just("add"), CIDS, st.binary(max_size=64)),
    st.tuples(st.just("read"), CIDS, st.just(b"")),
    st.tuples(st.just("received"), CIDS, st.just(b"")),
    st.tuples(st.just("attached"), st.just(""), st.sampled_from([b"", b"1"]))),
    max_size=80)


@given(EVENTS, st.integers(0, 2000))
def test_kept_results_hold_what_no_client_received_and_count_its_bytes(events, limit):
    changes = []
    kept = KeptResults(limit, on_full=changes.append)
    model: dict[str, bytes] = {}
    received: dict[str, None] = {}  # kept ids the attached client received, oldest first
    attached = True
    let_go = 0
    for op, cid, value in events:
        if op == "add":
            kept.add(Outcome(cid, READY, value))
            model[cid] = value
        elif op == "read":
            assert kept.read([cid, f"{cid}#2"]) == (1 if cid in model else 0)
            model.pop(cid, None)
            received.pop(cid, None)
        elif op == "received":
            kept.received([cid])
            if cid in model:
                received[cid] = None
        else:
            attached = bool(value)
            kept.set_attached(attached)
        # past the bound, an attached client's received values go, oldest first
        while attached and received and sum(OVERHEAD + len(v) for v in model.values()) \
                > limit:
            gone = next(iter(received))
            del received[gone], model[gone]
            let_go += 1
        nbytes = sum(OVERHEAD + len(v) for v in model.values())
        assert kept.nbytes == nbytes and kept.let_go == let_go
        assert [o.cid for o in kept.unread()] == list(model)  # arrival order
        assert kept.full == (nbytes > limit and not attached)  # the queue waits
    # on_full is told each change, alternating, starting with True
    assert changes == [i % 2 == 0 for i in range(len(changes))]
    assert kept.high == max([-1, *(seq_of(c) for op, c, _ in events if op == "add")])


@given(st.lists(CIDS, max_size=20), st.integers(-1, 10))
def test_next_seq_is_above_every_id_and_the_floor(cids, floor):
    n = next_seq(cids, floor)
    assert n > floor and all(n > seq_of(c) for c in cids)
    assert n - 1 in {floor, *(seq_of(c) for c in cids)}


def test_ids_and_sizes():
    assert seq_of("ab12-7") == 7 and seq_of("ab12-g7") == 7 and seq_of("ab12-g7@3#0") is None
    assert gang_of("ab12-g7#2") == "ab12-g7" and gang_of("ab12-7") == "ab12-7"
    assert size_of([b"ab", b"cde", None]) == 5 and size_of(None) == 0
    with pytest.raises(ValueError, match="keep-results"):
        KeptResults(-1)


def make() -> tuple[CoordinatorState, list]:
    sent: list = []
    return CoordinatorState("t", send=lambda address, msg: sent.append(msg)), sent


def test_a_keep_alive_owners_values_stay_until_read_and_attach_hands_them_over():
    co, sent = make()
    with dask.config.set({"daskdist.coordinator.keep-results": "1KiB"}):
        co.add_owner("old", "client-a", "secret", keep_alive=True)
    co.closure_book.add_owner("plain", "client-a", "other")
    box = co.outboxes["old"]
    co.queue.put("old-0", "old", [b"f", None])
    co.queue.put("old-1", "old", [b"f", None])
    co.gangs.submit("old-g2", "old", [b"f", None])
    co.closure_book.deliver([Outcome("old-3", READY, b"x" * 10, owner="old"),
                             Outcome("old-4", CANCELLED, owner="old")])
    box.ack(2)  # delivered to its client: still kept, not read
    assert [o.cid for o in box.kept.unread()] == ["old-3", "old-4"]
    route(co, "daskdist_read")(owner="old", token="secret", cids=["old-4"])
    assert [o.cid for o in box.kept.unread()] == ["old-3"]
    with pytest.raises(PermissionError):
        route(co, "daskdist_read")(owner="old", token="wrong", cids=["old-3"])
    # past keep-results with no client: the owner's queue is held until one attaches
    box.kept.set_attached(False)
    co.closure_book.deliver([Outcome("old-5", READY, b"y" * 2000, owner="old")])
    assert "old" in co.queue.held

    reply = co.keep_book.attach("client-b")
    assert reply["owner"] == "old" and reply["token"] != "secret"
    assert reply["closures"] == ["old-0", "old-1"] and reply["gangs"] == ["old-g2"]
    assert [Outcome._make(o).cid for o in reply["kept"]] == ["old-3", "old-5"]
    assert reply["seq"] == 6  # above every id it used
    assert box.client == "client-b" and not box.items
    # attached: its queue goes on; past the bound, what the new client received (in the
    # reply) goes, oldest first
    assert "old" not in co.queue.held
    assert box.kept.unread() == [] and box.kept.let_go == 2
    with pytest.raises(PermissionError):  # the previous client acts for it no more
        co.closure_book.owner_box("old", "secret")
    co.drop_owner("old")
    with pytest.raises(LookupError, match="'t' has no keep_alive owner"):
        co.keep_book.attach("client-c")


def test_preemption_deadlines_take_a_worker_out_of_the_next_formation():
    co, sent = make()
    for s, w in (("s0", "w0"), ("s1", "w1")):
        co.start_session(s, w, 1, "cpu", "", lambda a: False, 0.0)
    assert co.active_sessions() == ("s0", "s1")
    import time

    far, near = time.time() + 3600, time.time() + 30
    route(co, "daskdist_preemption")(session="s0", deadline=far, reason="worker lifetime")
    assert co.active_sessions() == ("s0", "s1")  # beyond the horizon: known only
    route(co, "daskdist_preemption")(session="s0", deadline=near, reason="SIGUSR1")
    route(co, "daskdist_preemption")(session="s0", deadline=far, reason="later")  # ignored
    assert co.active_sessions() == ("s1",)
    listed = co.status()["preemptions"]
    assert [(p["worker"], p["reason"], p["deadline"]) for p in listed] == [
        ("w0", "SIGUSR1", near)]
    co.closure_book.add_owner("o", None, "tok")
    route(co, "daskdist_notify_preemption")(owner="o", token="tok", worker="w1",
                                            deadline=near)
    assert sent[-1] == {"op": "daskdist-preemption", "name": "t", "deadline": near,
                        "reason": "notify_preemption"}
    with pytest.raises(ValueError, match="'w9' is not a worker"):
        route(co, "daskdist_notify_preemption")(owner="o", token="tok", worker="w9",
                                                deadline=near)
    with pytest.raises(TypeError, match="deadline"):
        route(co, "daskdist_preemption")(session="s1", deadline="soon", reason="x")
    co.stop_session("s0")
    assert co.status()["preemptions"] == []  # an ended session's is forgotten
    co.close()

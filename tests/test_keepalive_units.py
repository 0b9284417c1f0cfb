"""What the scheduler keeps for a keep-alive owner (``core.keepalive``), and its keep
book on a CoordinatorState driven without Dask: outcomes kept until read, their bytes
against ``keep-results`` (the owner's queue held past it), attaching to the owner."""

from __future__ import annotations

import dask
import pytest
from hypothesis import given
from hypothesis import strategies as st

from daskdist.core.keepalive import OVERHEAD, KeptResults, gang_of, next_seq, seq_of, size_of
from daskdist.core.protocol import CANCELLED, READY, Outcome
from daskdist.plugins.scheduler.state import CoordinatorState
from tests.conftest import route

CIDS = st.builds(lambda g, n: f"owner-{'g' if g else ''}{n}", st.booleans(),
                 st.integers(0, 10**6))
EVENTS = st.lists(st.tuples(st.sampled_from(["add", "read"]), CIDS,
                            st.binary(max_size=64)), max_size=60)


@given(EVENTS, st.integers(0, 2000))
def test_kept_results_count_their_bytes_and_say_when_full(events, limit):
    changes = []
    kept = KeptResults(limit, on_full=changes.append)
    model: dict[str, bytes] = {}
    for op, cid, value in events:
        if op == "add":
            kept.add(Outcome(cid, READY, value))
            model[cid] = value
        else:
            assert kept.read([cid, f"{cid}#2"]) == (1 if cid in model else 0)
            model.pop(cid, None)
        assert kept.nbytes == sum(OVERHEAD + len(v) for v in model.values())
        assert [o.cid for o in kept.unread()] == [c for c in kept.outcomes]
        assert set(kept.outcomes) == set(model)
        assert kept.full == (kept.nbytes > limit)
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
        co.closure_book.add_owner("old", "client-a", "secret")
        co.keep_book.keep("old")
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
    # past keep-results: the owner's queue is held, and released once values are read
    co.closure_book.deliver([Outcome("old-5", READY, b"y" * 2000, owner="old")])
    assert "old" in co.queue.held
    route(co, "daskdist_read")(owner="old", token="secret", cids=["old-5"])
    assert "old" not in co.queue.held

    reply = co.keep_book.attach("client-b")
    assert reply["owner"] == "old" and reply["token"] != "secret"
    assert reply["closures"] == ["old-0", "old-1"] and reply["gangs"] == ["old-g2"]
    assert [Outcome._make(o).cid for o in reply["kept"]] == ["old-3"]
    assert reply["seq"] == 6  # above every id it used
    assert box.client == "client-b" and not box.items
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

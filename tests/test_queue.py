"""Unit tests of the pure closure queue and membership state machines."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from daskdist.core.membership import Membership
from daskdist.core.protocol import (
    CANCELLED,
    FAILED,
    INPUT_ERROR,
    READY,
    RUNNING,
    USER_ERROR,
    WORKER_LOST,
)
from daskdist.core.queue import ClosureQueue
from tests.tables import check_queue


def make(n: int, q: ClosureQueue | None = None, owner: str = "o") -> ClosureQueue:
    q = q or ClosureQueue()
    for i in range(n):
        q.put(f"{owner}-{i}", owner, f"payload{i}")
    return q


def test_dispatch_is_fifo_and_bounded():
    q = make(5)
    q.add_session("s")
    got = q.dispatch("s", 3)
    assert [c.cid for c in got] == ["o-0", "o-1", "o-2"]
    assert all(c.state == RUNNING and c.attempt == 1 for c in got)
    assert q.inflight == 3 and q.queued == 2
    assert [c.cid for c in q.dispatch("s", 10)] == ["o-3", "o-4"]
    assert q.dispatch("s", 10) == []


def test_tagged_closures_go_to_the_sessions_the_router_names():
    """At a dataset's tail (the router: only s2 holds its rows), s1 takes the untagged
    closures behind the tagged ones and sets those aside; s2 takes them first, in order;
    once the router lets anyone take them, s1 does; cancelling reaches them too."""
    q = ClosureQueue()
    holders = {"ds": {"s2"}}
    q.router = lambda tag, session: session in holders[tag]
    for s in ("s1", "s2"):
        q.add_session(s)
    for i in range(6):
        q.put(f"o-{i}", "o", b"p", tag="ds" if i in (0, 1, 3, 5) else None)
    assert [c.cid for c in q.dispatch("s1", 1)] == ["o-2"]  # o-0, o-1 set aside
    check_queue(q)
    assert q.queued == 5 and q.backlog == 5
    assert [c.cid for c in q.dispatch("s2", 3)] == ["o-0", "o-1", "o-3"]
    assert [c.cid for c in q.dispatch("s1", 5)] == ["o-4"]  # o-5 set aside
    check_queue(q)
    holders["ds"] = {"s1", "s2"}  # free rows again, or none held: anyone
    assert [c.cid for c in q.dispatch("s1", 5)] == ["o-5"]
    assert q.queued == 0 and q.backlog == 0
    check_queue(q)
    holders["ds"] = {"s2"}
    q.put("o-6", "o", b"p", tag="ds")
    q.put("o-7", "o", b"p", tag="ds")
    assert q.dispatch("s1", 5) == [] and q.backlog == 2
    cancelled = q.cancel_pending("o")
    assert sorted(o.cid for o in cancelled) == ["o-6", "o-7"]
    assert q.queued == 0 and q.backlog == 0 and q.dispatch("s2", 5) == []
    check_queue(q)


def test_unknown_or_draining_session_gets_nothing():
    q = make(2)
    assert q.dispatch("nobody", 5) == []
    q.add_session("s")
    q.drain_session("s")
    assert q.dispatch("s", 5) == []
    q.add_session("t")
    assert len(q.dispatch("t", 5)) == 2


def test_finish_ready_is_final_once_and_forgotten():
    q = make(1)
    q.add_session("s")
    (c,) = q.dispatch("s", 1)
    out = q.finish("s", c.cid, True, b"result")
    assert out.state == READY and out.value == b"result" and out.attempt == 1
    assert q.finish("s", c.cid, True, b"again") is None  # duplicate refused
    assert q.counters.refused == 1 and q.counters.done == 1
    assert q.unfinished() == 0 and c.cid not in q.closures


def test_finish_from_wrong_session_is_fenced():
    q = make(1)
    q.add_session("a")
    q.add_session("b")
    (c,) = q.dispatch("a", 1)
    assert q.finish("b", c.cid, True, b"x") is None
    assert q.closures[c.cid].state == RUNNING


def test_session_loss_puts_back_at_head_in_order_and_counts():
    q = make(4)
    q.add_session("a")
    q.add_session("b")
    q.dispatch("a", 2)  # o-0, o-1
    assert q.remove_session("a") == []
    assert q.counters.recovered == 2
    got = q.dispatch("b", 4)
    assert [c.cid for c in got] == ["o-0", "o-1", "o-2", "o-3"]
    # one slot: o-0 was executing (a failed attempt), o-1 only prefetched
    assert [c.attempt for c in got[:2]] == [2, 1]
    assert [q.closures[c].worker_failures for c in ("o-0", "o-1")] == [1, 0]
    # a late finish from the lost session is refused
    assert q.finish("a", "o-0", True, b"late") is None


def test_only_executing_leases_count_worker_failures():
    q = ClosureQueue(max_worker_failures=1)
    make(5, q)
    q.add_session("s", slots=2)
    q.dispatch("s", 5)
    q.finish("s", "o-0", True, b"")
    outs = q.remove_session("s")
    # o-1 and o-2 were executing on the two threads; o-3, o-4 waited in the prefetch
    assert sorted(o.cid for o in outs) == ["o-1", "o-2"]
    assert all(o.kind == WORKER_LOST for o in outs)
    assert q.queued == 2 and all(q.closures[c].attempt == 0 for c in ("o-3", "o-4"))


def test_a_planned_departure_counts_no_failure():
    """Retirement, a graceful close, a plugin re-registration: closures go back, started
    or not, without counting toward max_worker_failures (SPEC §2.4)."""
    q = ClosureQueue(max_worker_failures=1)
    make(3, q)
    for n in range(3):
        q.add_session(f"s{n}", slots=2)
        q.dispatch(f"s{n}", 3)
        q.observe(f"s{n}", held=["o-0", "o-1", "o-2"], started=["o-0", "o-1"])
        assert q.remove_session(f"s{n}", expected=True) == []
    # the two that started were attempts (ctx.attempt grows), but no failures
    assert [(c.worker_failures, c.attempt) for c in q.closures.values()] == [
        (0, 3), (0, 3), (0, 0)]
    assert q.queued == 3


def test_only_closures_the_worker_said_started_count():
    """An unplanned loss counts for what the worker said had started, never for what
    it said it held unstarted; for what it had no time to report, the oldest its free
    threads would have started."""
    q = ClosureQueue(max_worker_failures=1)
    make(4, q)
    q.add_session("s", slots=2)
    q.dispatch("s", 4)
    # both threads run: o-0 and o-1; o-2, o-3 wait in the prefetch, unstarted
    q.observe("s", held=["o-0", "o-1", "o-2", "o-3"], started=["o-0", "o-1"])
    outs = q.remove_session("s")
    assert [o.cid for o in outs] == ["o-0", "o-1"] and outs[0].kind == WORKER_LOST
    assert [(q.closures[c].worker_failures, q.closures[c].attempt)
            for c in ("o-2", "o-3")] == [(0, 0)] * 2
    q.add_session("t", slots=2)
    assert [c.cid for c in q.dispatch("t", 2)] == ["o-2", "o-3"]
    q.observe("t", held=["o-2"], started=["o-2"])  # o-3 came after: not reported
    outs = q.remove_session("t")  # the free thread may have started o-3
    assert sorted(o.cid for o in outs) == ["o-2", "o-3"]


def test_a_closure_reported_waiting_with_a_thread_free_may_have_started():
    """Received, not started, but a thread was free: it may start right after the
    message left, so a loss still counts it (and keeps its attempt)."""
    q = ClosureQueue(max_worker_failures=1)
    make(3, q)
    q.add_session("s", slots=2)
    q.dispatch("s", 3)
    q.observe("s", held=["o-0", "o-1", "o-2"], started=["o-0"])  # o-1: a free thread's
    outs = q.remove_session("s")
    assert sorted(o.cid for o in outs) == ["o-0", "o-1"]
    assert (q.closures["o-2"].worker_failures, q.closures["o-2"].attempt) == (0, 0)
    q.add_session("t", slots=1)
    q.dispatch("t", 1)
    q.observe("t", held=["o-2"], started=[])
    assert q.remove_session("t", expected=True) == []
    assert q.closures["o-2"].attempt == 1  # planned: no failure, but it may have run


def test_a_poison_pill_reported_unstarted_behind_a_finishing_closure_is_caught():
    """The worker said the pill was waiting (prefetched) behind a closure that then
    finished; the pill started and killed the worker before it could say so. A pill
    that killed workers before is charged wherever it stands, so it fails before any
    of the closures that happened to finish just before it."""
    q = ClosureQueue(max_worker_failures=3)
    q.put("pill", "o", b"")
    q.add_session("s0", slots=1)
    q.dispatch("s0", 1)
    q.remove_session("s0")  # it starts at once: unreported, the free thread's
    outs = []
    for n in (1, 2):
        q.put(f"done-{n}", "o", b"")
        q._queue.remove(f"done-{n}")
        q._queue.appendleft(f"done-{n}")
        q.add_session(f"s{n}", slots=1)
        q.dispatch(f"s{n}", 2)
        q.observe(f"s{n}", held=[f"done-{n}", "pill"], started=[f"done-{n}"])
        outs = q.remove_session(f"s{n}")
    assert [o.cid for o in outs] == ["pill"] and outs[0].kind == WORKER_LOST
    assert [q.closures[f"done-{n}"].worker_failures for n in (1, 2)] == [1, 1]


def test_a_stopping_sessions_final_word_is_exact():
    """A session that stops (its plugin torn down) says exactly what started: the rest
    never ran, whatever threads were free."""
    q = make(3)
    q.add_session("s", slots=2)
    q.dispatch("s", 3)
    q.observe("s", held=(), started=["o-1"], final=True)
    assert q.remove_session("s", expected=True) == []
    assert [q.closures[c].attempt for c in ("o-0", "o-1", "o-2")] == [0, 1, 0]


def test_a_poison_pill_behind_an_unreported_result_is_still_caught():
    q = ClosureQueue(max_worker_failures=3)
    q.put("pill", "o", b"")
    for n in range(3):
        q.put(f"ok-{n}", "o", b"")
    # worker 1 dies running the pill (first in line)
    q.add_session("s0", slots=1)
    q.dispatch("s0", 1)
    q.remove_session("s0")
    # then twice the pill stands second, behind a finished closure not yet reported
    for n in (1, 2):
        q.put(f"done-{n}", "o", b"")
        q.add_session(f"s{n}", slots=1)
        q._queue.remove(f"done-{n}")
        q._queue.appendleft(f"done-{n}")  # it runs first; its result never gets out
        assert [c.cid for c in q.dispatch(f"s{n}", 2)] == [f"done-{n}", "pill"]
        outs = q.remove_session(f"s{n}")
    assert [o.cid for o in outs] == ["pill"] and outs[0].kind == WORKER_LOST
    assert q.closures["done-1"].worker_failures == 1  # blamed once, still queued


def test_worker_lost_limit_fails_closure_and_records_error():
    q = ClosureQueue(max_worker_failures=2)
    make(1, q)
    for n in range(2):
        q.add_session(f"s{n}")
        q.dispatch(f"s{n}", 1)
        outs = q.remove_session(f"s{n}")
    assert len(outs) == 1 and outs[0].state == FAILED and outs[0].kind == WORKER_LOST
    assert q.errors == {"o": outs[0]}


def test_user_error_retries_then_fails():
    q = make(1)
    q.closures["o-0"].retries = 2
    q.add_session("s")
    for attempt in (1, 2):
        (c,) = q.dispatch("s", 1)
        assert c.attempt == attempt
        assert q.finish("s", c.cid, False, b"err") is None
    (c,) = q.dispatch("s", 1)
    out = q.finish("s", c.cid, False, b"err", USER_ERROR)
    assert out.state == FAILED and out.attempt == 3 and q.counters.retried == 2


def test_input_error_is_not_retried():
    q = ClosureQueue()
    q.put("x-0", "x", b"", retries=5)
    q.add_session("s")
    q.dispatch("s", 1)
    out = q.finish("s", "x-0", False, b"e", INPUT_ERROR)
    assert out.state == FAILED and out.kind == INPUT_ERROR


def test_first_error_kept_and_cancel_pending():
    q = make(5)
    q.add_session("s")
    a, b = q.dispatch("s", 2)
    first = q.finish("s", a.cid, False, b"first")
    q.finish("s", b.cid, False, b"second")
    assert q.errors == {"o": first}
    cancelled = q.cancel_pending()
    assert [o.cid for o in cancelled] == ["o-2", "o-3", "o-4"]
    assert all(o.state == CANCELLED for o in cancelled)
    assert q.take_error("o") is first and q.errors == {} and q.unfinished() == 0


def test_cancel_pending_by_owner_keeps_others():
    q = make(2, owner="a")
    make(2, q, owner="b")
    out = q.cancel_pending("a")
    assert {o.cid for o in out} == {"a-0", "a-1"}
    q.add_session("s")
    assert [c.cid for c in q.dispatch("s", 5)] == ["b-0", "b-1"]


def test_holding_an_owner_blocks_only_its_dispatch():
    q = make(2, owner="a")
    make(2, q, owner="b")
    q.add_session("s")
    q.held.add("a")
    assert [c.cid for c in q.dispatch("s", 1)] == ["b-0"]  # b's closures may go
    assert [c.cid for c in q.dispatch("s", 5)] == ["b-1"]
    assert q.dispatch("s", 5) == []  # a's are held
    q.held.discard("a")
    assert [c.cid for c in q.dispatch("s", 5)] == ["a-0", "a-1"]  # still in order


def test_errors_are_kept_per_owner():
    q = make(2, owner="a")
    make(2, q, owner="b")
    q.add_session("s", slots=4)
    q.dispatch("s", 4)
    err_b = q.finish("s", "b-0", False, b"b's", USER_ERROR)
    q.finish("s", "a-0", True, b"")
    assert q.errors == {"b": err_b} and q.take_error("a") is None
    assert q.inflight_of("a") == 1 and q.inflight_of("b") == 1
    err_a = q.finish("s", "a-1", False, b"a's", USER_ERROR)
    assert q.take_error("a") is err_a and q.take_error("b") is err_b


def test_reconcile_puts_back_what_the_session_does_not_hold():
    q = make(3)
    q.add_session("s")
    q.dispatch("s", 3)
    assert q.reconcile("s", ["o-1"]) == 2
    assert (q.closures["o-1"].state, q.closures["o-1"].session) == (RUNNING, "s")
    q.add_session("t")
    got = q.dispatch("t", 3)
    assert [c.cid for c in got] == ["o-0", "o-2"]
    assert [c.attempt for c in got] == [1, 1]  # never received: not an attempt


def test_pinned_closures_only_go_to_their_session():
    q = ClosureQueue()
    q.put("p-0", "o", b"", pinned="b")
    q.put("p-1", "o", b"")
    q.add_session("a")
    q.add_session("b")
    assert [c.cid for c in q.dispatch("a", 5)] == ["p-1"]
    assert [c.cid for c in q.dispatch("b", 5)] == ["p-0"]


def test_duplicate_put_ignored_and_negative_retries_rejected():
    q = make(1)
    assert q.put("o-0", "o", b"other") is False
    assert q.queued == 1
    with pytest.raises(ValueError, match="retries"):
        q.put("z", "o", b"", retries=-1)


def test_membership_indices_are_dense_and_reused():
    m = Membership()
    a, _ = m.join("sa", "tcp://a")
    b, _ = m.join("sb", "tcp://b")
    c, _ = m.join("sc", "tcp://c")
    assert (a.index, b.index, c.index) == (0, 1, 2)
    m.leave("sb")
    d, _ = m.join("sd", "tcp://d")
    assert d.index == 1  # the lowest free index
    assert [x.session for x in m.by_index()] == ["sa", "sd", "sc"]
    # a new session on the same address replaces the old one and takes its index
    v = m.version
    e, replaced = m.join("se", "tcp://a")
    assert replaced.session == "sa" and e.index == 0 and m.version == v + 2
    assert m.drain("tcp://d") == "sd" and m.members["sd"].draining


class QueueMachine(RuleBasedStateMachine):
    """Random put / dispatch / finish / fail / lose / cancel / raise sequences."""

    def __init__(self):
        super().__init__()
        self.q = ClosureQueue(max_worker_failures=3)
        self.n = 0
        self.sessions: list[str] = []
        self.nsess = 0
        self.finals: dict[str, str] = {}
        self.put_ids: set[str] = set()

    def _record(self, outcomes):
        for o in outcomes:
            assert o.cid not in self.finals, f"{o.cid} final twice"
            self.finals[o.cid] = o.state

    @rule(retries=st.integers(0, 2))
    def put(self, retries):
        cid = f"o-{self.n}"
        self.n += 1
        assert self.q.put(cid, "o", b"", retries)
        self.put_ids.add(cid)

    @rule(slots=st.integers(1, 3))
    def add_session(self, slots):
        s = f"s{self.nsess}"
        self.nsess += 1
        self.q.add_session(s, slots)
        self.sessions.append(s)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 10), n=st.integers(1, 4))
    def dispatch(self, i, n):
        s = self.sessions[i % len(self.sessions)]
        for c in self.q.dispatch(s, n):
            assert c.state == RUNNING and c.session == s

    @precondition(lambda self: self.q.inflight)
    @rule(i=st.integers(0, 1000), ok=st.booleans(), kind=st.sampled_from([USER_ERROR, INPUT_ERROR]))
    def finish(self, i, ok, kind):
        running = sorted((c.cid, c.session) for c in self.q.closures.values() if c.state == RUNNING)
        cid, s = running[i % len(running)]
        out = self.q.finish(s, cid, ok, b"v", kind)
        if out is not None:
            self._record([out])
        # a second report of the same run is always refused
        assert self.q.finish(s, cid, ok, b"v", kind) is None

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 10))
    def lose_session(self, i):
        s = self.sessions.pop(i % len(self.sessions))
        self._record(self.q.remove_session(s))

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 10))
    def reconcile_nothing_held(self, i):
        self.q.reconcile(self.sessions[i % len(self.sessions)], [])

    @rule()
    def raise_error(self):
        # the scheduler raises an owner's error only with none of its closures in flight
        if "o" in self.q.errors and self.q.inflight_of("o") == 0:
            self._record(self.q.cancel_pending("o"))
            self.q.take_error("o")

    @invariant()
    def consistent(self):
        check_queue(self.q)
        live = set(self.q.closures)
        assert live.isdisjoint(self.finals)
        assert live | set(self.finals) == self.put_ids
        assert self.q.inflight == sum(1 for c in self.q.closures.values() if c.state == RUNNING)
        assert self.q.queued + self.q.inflight == len(live)

    def teardown(self):
        # drain: every worker leaves, then a fresh one runs what is left; everything
        # ends exactly once in a final state
        for s in self.sessions:
            self._record(self.q.remove_session(s))
        self.q.add_session("final")
        for _ in range(100):
            for c in self.q.dispatch("final", 1000):
                out = self.q.finish("final", c.cid, True, b"v")
                if out is not None:
                    self._record([out])
            if not self.q.closures:
                break
        assert set(self.finals) == self.put_ids
        assert set(self.finals.values()) <= {READY, FAILED, CANCELLED}


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_wait_event_reports_set_or_timeout():
    """The long-polls' wait: True as soon as the event is set, False after the timeout."""
    import asyncio

    from daskdist.plugins.scheduler.polls import wait_event

    async def scenario():
        ev = asyncio.Event()
        assert await wait_event(ev, 0.01) is False
        asyncio.get_running_loop().call_later(0.01, ev.set)
        assert await wait_event(ev, 10) is True
        assert await wait_event(ev, 0) is True  # already set: no wait at all

    asyncio.run(scenario())


def test_steal_victim_is_the_session_with_most_prefetched():
    q = make(20)
    q.add_session("a", slots=1)
    q.add_session("b", slots=2)
    q.add_session("idle", slots=1)
    q.dispatch("a", 5)  # 1 running + 4 prefetched
    q.dispatch("b", 9)  # 2 running + 7 prefetched
    assert q.prefetched("a") == 4 and q.prefetched("b") == 7 and q.prefetched("idle") == 0
    assert q.steal_victim("idle") == ("b", 4)  # half, rounded up
    assert q.steal_victim("b") == ("a", 2)


def test_stolen_closures_go_back_at_the_head_unstarted():
    q = make(6)
    q.add_session("busy", slots=1)
    q.add_session("idle", slots=1)
    q.dispatch("busy", 6)
    assert q.steal_victim("idle") == ("busy", 3)
    assert q.put_back("busy", ["o-5", "o-4", "o-3"]) == 3  # the worker's newest pending
    got = q.dispatch("idle", 10)
    assert [c.cid for c in got] == ["o-3", "o-4", "o-5"]
    assert all(c.attempt == 1 and c.worker_failures == 0 for c in got)
    assert q.steal_victim("idle") == ("busy", 1)
    check_queue(q)


def test_no_victim_without_prefetched_closures():
    q = make(2)
    q.add_session("a", slots=2)
    q.add_session("b", slots=1)
    q.dispatch("a", 2)
    assert q.steal_victim("b") is None


def test_protocol_types_travel_as_plain_lists():
    """Named message types are wire-compatible with the positional tuples they replace."""
    from distributed.protocol import dumps, loads

    from daskdist.core.protocol import FAILED, Dispatch, Outcome

    msg = {"closures": [Dispatch("o-1", [b"fn", None], 2, False)],
           "results": [Outcome("o-0", FAILED, b"err", USER_ERROR, 1,
                               tokens=[("lease", "d", 0, [(0, 4)])])]}
    back = loads(dumps(msg))
    d = Dispatch._make(back["closures"][0])
    assert (d.cid, list(d.payload), d.attempt, d.gang) == ("o-1", [b"fn", None], 2, False)
    cid, state, value, kind = back["results"][0][:4]  # positional unpacking still works
    assert (cid, state, value, kind) == ("o-0", FAILED, b"err", USER_ERROR)
    assert Outcome._make(back["results"][0]).tokens[0][0] == "lease"

"""Preemption deadlines, pure: what a worker with one judges closures by
(``core.lifetime.deadlines.DurationBook``), the cloud notices' bodies, the signals
setting, and the just-in-time commit's decisions (``collective.state.deadline``) as
every rank takes them from a commit's flags."""

from __future__ import annotations

import datetime
import email.utils
import json
import time

import dask
import pytest
from hypothesis import given
from hypothesis import strategies as st

from daskdist.collective.state import deadline as jit
from daskdist.context import WorkerContext
from daskdist.core.lifetime import deadlines
from daskdist.core.lifetime.deadlines import DurationBook, acting, earliest
from daskdist.core.protocol import Preemption
from daskdist.plugins.worker.deadlines import signal_leads
from daskdist.plugins.worker.pollers import make_poller
from daskdist.session.preemption import forget_preemption, set_preemption
from daskdist.session.scope import ClosureScope, closure_scope

RUNS = st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 100)), max_size=40)


@given(RUNS, st.floats(0, 100), st.floats(0, 200), st.floats(0, 10))
def test_a_worker_starts_a_closure_only_if_it_ends_before_the_deadline(runs, unknown, left,
                                                                       margin):
    book = DurationBook(keep=3, unknown=unknown)
    for key, seconds in runs:
        book.add(key, seconds)
    for key in "abcd":
        mine = [s for k, s in runs if k == key][-3:]
        expected = max(mine) if mine else unknown
        assert book.expected(key) == expected
        fits = book.fits(key, 1000.0, 1000.0 + left, margin)
        assert fits == (1000.0 + expected + margin <= 1000.0 + left)
        if not fits:  # refused: no more work is asked for, so it is not handed back here
            assert not book.takes_more(1000.0, 1000.0 + left, margin)
    if not runs:
        assert book.longest() >= 0


def test_deadlines_near_and_earliest():
    assert acting(100.0, 40.0, 60.0) and not acting(100.0, 39.0, 60.0)
    a, b = Preemption(10.0, "a"), Preemption(5.0, "b")
    assert earliest(None, a) == a and earliest(a, b) == b and earliest(b, a) == b
    assert earliest(a, Preemption(10.0, "tie")) == a
    with pytest.raises(ValueError):
        DurationBook(keep=0)


def test_cloud_notices():
    assert deadlines.aws_deadline(json.dumps({"action": "terminate",
                                              "time": "2017-09-18T08:22:00Z"})) == \
        datetime.datetime(2017, 9, 18, 8, 22, tzinfo=datetime.timezone.utc).timestamp()
    assert deadlines.aws_deadline("<html>404 - Not Found</html>") is None
    assert deadlines.aws_deadline(json.dumps({"action": "stop"})) is None
    at = 1_800_000_000.0
    rfc = email.utils.format_datetime(
        datetime.datetime.fromtimestamp(at, datetime.timezone.utc), usegmt=True)
    events = {"Events": [{"EventType": "Freeze", "NotBefore": rfc},
                         {"EventType": "Preempt", "NotBefore": rfc},
                         {"EventType": "Terminate", "NotBefore": ""}]}
    assert deadlines.azure_deadline(json.dumps(events), at + 5) == at
    events["Events"] = events["Events"][2:]  # started already: no NotBefore
    assert deadlines.azure_deadline(json.dumps(events), 42.0) == 42.0
    assert deadlines.azure_deadline(json.dumps({"Events": []}), 1.0) is None
    assert deadlines.azure_deadline("not json", 1.0) is None
    assert deadlines.gcp_deadline("TRUE", 7.0) == 37.0
    assert deadlines.gcp_deadline("FALSE", 7.0) is None


def test_signal_leads_and_pollers_are_checked_naming_the_setting():
    import signal

    assert signal_leads({"USR1": 120, "SIGUSR2": "2m"}) == {
        int(signal.SIGUSR1): ("SIGUSR1", 120.0), int(signal.SIGUSR2): ("SIGUSR2", 120.0)}
    assert signal_leads({}) == {} and signal_leads(None) == {}
    for bad, why in (({"TERM": 5}, "graceful leave"), ({"KILL": 5}, "not a signal"),
                     ({"NOPE": 5}, "not a signal"), ({"USR1": "soon"}, "duration"),
                     ([5], "must map")):
        with pytest.raises(ValueError, match=f"daskdist.preemption.signals.*{why}"):
            signal_leads(bad)
    with pytest.raises(ValueError, match="daskdist.preemption.pollers.*'ibm'"):
        make_poller("ibm")
    with dask.config.set({"daskdist.preemption.endpoints.gcp": "http://x/preempted"}):
        assert make_poller("gcp").headers == {"Metadata-Flavor": "Google"}


FLAGS = st.lists(st.sampled_from([jit.STAY, jit.RETIRING, jit.LEAVING,
                                  jit.LEAVING_UNWRITTEN]), min_size=1, max_size=6)


@given(FLAGS, st.booleans())
def test_every_rank_takes_the_same_decision_at_a_commit(flags, writes):
    acts = [jit.at_commit(flags, rank, writes) for rank in range(len(flags))]
    leaving = [f in (jit.LEAVING, jit.LEAVING_UNWRITTEN) for f in flags]
    for rank, act in enumerate(acts):
        assert (act.last, act.write, act.interrupt) == (acts[0].last, acts[0].write,
                                                        acts[0].interrupt)
        assert act.leave == leaving[rank]
        assert act.wait == (act.write and writes and leaving[rank])
    assert acts[0].last == all(flags)
    assert acts[0].interrupt == any(leaving)
    # a just-in-time write when a member leaves on its deadline and every writer fits
    assert acts[0].write == (any(leaving) and jit.LEAVING_UNWRITTEN not in flags
                             and not all(flags))


def test_a_ranks_flag_reads_its_workers_deadline():
    ctx = WorkerContext(0, 1, "cpu", "tcp://w:1")
    with closure_scope(ClosureScope(ctx)):
        assert jit.flag(False, True, 1.0) == jit.STAY and jit.flag(True, True, 1.0) == \
            jit.RETIRING
        try:
            set_preemption("tcp://w:1", Preemption(time.time() + 3600, "worker lifetime"))
            assert jit.flag(False, True, 1.0) == jit.STAY  # beyond the horizon
            set_preemption("tcp://w:1", Preemption(time.time() + 30, "SIGUSR1"))
            assert ctx.preemption.reason == "SIGUSR1"
            assert jit.flag(False, True, 1.0) == jit.LEAVING
            assert jit.flag(False, True, None) == jit.LEAVING  # no estimate: tried
            assert jit.flag(False, True, 60.0) == jit.LEAVING_UNWRITTEN  # would not end
            assert jit.flag(False, False, 60.0) == jit.LEAVING  # it writes nothing
        finally:
            forget_preemption("tcp://w:1")
    assert ctx.preemption is None


def test_listeners_hear_every_notice_and_a_failing_one_stops_none():
    from daskdist.session import preemption

    heard = []

    def broken(address, notice):
        raise RuntimeError("a listener's bug")

    gone = [preemption.on_preemption(broken),
            preemption.on_preemption(lambda address, notice: heard.append((address, notice)))]
    try:
        set_preemption("tcp://w:2", Preemption(1.0, "x"))
        assert heard == [("tcp://w:2", Preemption(1.0, "x"))]
    finally:
        for unregister in gone:
            unregister()
        forget_preemption("tcp://w:2")
    set_preemption("tcp://w:2", Preemption(2.0, "y"))
    forget_preemption("tcp://w:2")
    assert len(heard) == 1

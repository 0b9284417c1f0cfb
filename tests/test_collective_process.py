"""ProcessGroupState (collective/bootstrap.py): this process's membership, lost
generations, waiting calls, stores and graveyard, on a fresh instance (no torch call)."""

from __future__ import annotations

import pytest

from daskdist.collective.bootstrap import PROCESS, ProcessGroupState, ProcessMembership
from daskdist.errors import CollectiveError


def member(generation: int) -> ProcessMembership:
    return ProcessMembership(0, 2, generation, "gloo", "cpu", 5.0)


def test_join_check_and_leave():
    st = ProcessGroupState()
    assert st.current() is None and st.highest_generation() == 0
    with pytest.raises(CollectiveError, match="gone"):
        st.check(1)
    assert st.join(member(3))
    assert st.check(3).generation == 3 and st.highest_generation() == 3
    with pytest.raises(CollectiveError, match="replaced by generation 3"):
        st.check(2)
    st.keep_store(3, "store-3")
    st.keep_store(4, "store-4")  # drops older generations' stores
    assert st.stores == {4: "store-4"} and st.store(3) is None
    assert st.highest_generation() == 4
    with st.waiting() as wake:
        left = st.leave(keep_store=None)
        assert wake.is_set()  # teardown wakes every waiting call
    assert left.generation == 3 and left.broken == "the group was destroyed"
    assert st.current() is None and st.stores == {} and not st.waiters


def test_a_lost_generation_breaks_its_member_and_refuses_to_form():
    st = ProcessGroupState()
    assert st.join(member(2))
    with st.waiting() as wake:
        st.mark_lost(2, "peer gone")
        assert wake.is_set()
    assert st.is_lost(2) and st.is_lost(1) and not st.is_lost(3)
    with pytest.raises(CollectiveError, match="broken: peer gone"):
        st.check(2)
    assert not st.join(member(2))  # a formation that lost a peer meanwhile
    assert st.current().generation == 2  # unchanged
    assert st.join(member(5)) and st.highest_generation() == 5


def test_break_group_only_breaks_that_generation():
    st = ProcessGroupState()
    st.join(member(4))
    st.break_group(3, "old")
    assert st.check(4)
    st.break_group(4, "allreduce failed")
    assert st.current().broken == "allreduce failed"
    st.break_group(4, "again")  # the first reason stays
    assert st.current().broken == "allreduce failed"


class _Work:
    def __init__(self, done):
        self.done = done

    def is_completed(self):
        if self.done is None:
            raise RuntimeError("broken work")
        return self.done


def test_graveyard_keeps_unfinished_work_only():
    st = ProcessGroupState()
    st.bury("pg1", _Work(False))
    st.bury("pg2", _Work(True))
    st.bury("pg3", _Work(None))
    st.prune_graveyard()
    assert [pg for pg, _ in st.graveyard] == ["pg1"]


def test_one_state_per_process():
    from daskdist.collective import bootstrap, group

    assert isinstance(PROCESS, ProcessGroupState)
    assert bootstrap.PROCESS is PROCESS and group.PROCESS is PROCESS


class _Slow:
    """An object whose destructor takes ``seconds`` and records the thread it ran in."""

    def __init__(self, seconds: float, ran: list):
        self.seconds, self.ran = seconds, ran

    def __del__(self):
        import threading
        import time

        time.sleep(self.seconds)
        self.ran.append(threading.current_thread().name)


def test_the_reaper_runs_destructors_off_the_callers_thread_and_its_thread_ends():
    import time

    from daskdist.collective.bootstrap import Reaper

    reaper, ran = Reaper(idle=0.05), []
    reaper.take([_Slow(0.2, ran), None, _Slow(0.2, ran)])
    assert ran == []  # the caller did not run the destructors (each records when done)
    deadline = time.monotonic() + 10
    while reaper.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == ["daskdist-reaper", "daskdist-reaper"] and not reaper.alive()
    reaper.take([_Slow(0.0, ran)])  # a later hand-over starts the thread again
    deadline = time.monotonic() + 10
    while (len(ran) < 3 or reaper.alive()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ran) == 3 and not reaper.alive()


def test_stores_let_go_and_finished_graves_go_to_the_reaper():
    from daskdist.collective import bootstrap

    ran: list = []
    st = ProcessGroupState()
    st.keep_store(1, _Slow(0.0, ran))
    st.keep_store(2, "store-2")  # generation 1's store goes to the reaper
    st.bury(_Slow(0.0, ran), _Work(True))
    st.prune_graveyard()
    st.leave(keep_store=None)
    import time

    deadline = time.monotonic() + 10
    while (len(ran) < 2 or bootstrap.REAPER.alive()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == ["daskdist-reaper", "daskdist-reaper"] and st.stores == {}

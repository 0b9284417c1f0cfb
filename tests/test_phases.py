"""A gang member's step clock (``daskdist.observe.phases``), in this process: phases
nested count once for the outermost, other threads' data is not the gang's, steps are
synced batches (else commits), windows roll by the wall clock, rows are counted once, and
the stack of a thread names the user's function it is in."""

from __future__ import annotations

import threading

import pytest

from daskdist.observe import phases, stacks
from daskdist.observe.steptimes import COLLECTIVE, COMMIT, COMPUTE, DATA

pytestmark = pytest.mark.timeout(60)


class Clocks:
    """A monotonic clock and a wall clock the test moves."""

    def __init__(self) -> None:
        self.t = 0.0
        self.wall = 1000.0

    def tick(self, dt: float) -> None:
        self.t += dt
        self.wall += dt


def recorder(clocks: Clocks, window: float = 10.0) -> phases.Recorder:
    return phases.Recorder(window, "co", "s0", "g", 1, 0, clock=lambda: clocks.t,
                           wall=lambda: clocks.wall)


def test_nested_phases_count_once_and_steps_split_their_time(monkeypatch):
    c = Clocks()
    rec = recorder(c)
    times = iter([0.0, 0.05, 0.06, 0.08])  # outermost phases only read the clock
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(times))
    with phases.recording(rec):
        phases.step(phases.SYNCED)  # the first batch asked for: the clock starts
        with phases.phase(DATA) as p:  # 0 .. 0.05: synced, its loader and allreduce inside
            with phases.phase(DATA) as inner:
                inner.rows(999)  # the inner loader's count is not the step's
            with phases.phase(COLLECTIVE):
                pass
            p.rows(32)
        with phases.phase(COMMIT):  # 0.06 .. 0.08
            pass
        c.tick(0.1)
        phases.step(phases.SYNCED)
        phases.step(phases.COMMITTED)  # a commit inside a synced loop is no step
    (w,) = rec.roll(final=True)
    assert w.steps == 1 and w.rows == 32 and rec.total == 1
    assert w.phases[DATA] == pytest.approx(0.05) and w.phases[COLLECTIVE] == 0.0
    assert w.phases[COMMIT] == pytest.approx(0.02)
    assert w.phases[COMPUTE] == pytest.approx(0.03)
    assert phases.active() is None


def test_commits_are_the_steps_of_a_loop_without_synced():
    c = Clocks()
    rec = recorder(c)

    @phases.timed(COMMIT, ends_step=True)
    def commit() -> None:
        c.tick(0.01)

    with phases.recording(rec):
        for _ in range(3):
            c.tick(0.09)
            commit()
    (w,) = rec.roll(final=True)
    assert w.steps == 3 and w.seconds == pytest.approx(0.3)


def test_windows_roll_with_the_wall_clock_and_an_idle_one_is_reported():
    c = Clocks()
    c.wall = 1009.5
    rec = recorder(c)
    with phases.recording(rec):
        phases.step(phases.SYNCED)
        c.tick(0.2)
        phases.step(phases.SYNCED)  # ends in window 100
        c.tick(0.5)
        phases.step(phases.SYNCED)  # ends in window 101: 100 closes
        assert [w.index for w in rec.roll()] == [100]
        c.tick(20.0)  # a hung step: windows close without steps
        assert [(w.index, w.steps) for w in rec.roll()] == [(101, 1)]
        assert rec.since_step() == pytest.approx(20.0)
        assert [(w.index, w.steps) for w in rec.roll(final=True)] == [(103, 0)]


@pytest.mark.parametrize("threads", [1, 2])
def test_only_the_gang_threads_data_counts_and_other_threads_collectives_do(threads):
    """Another closure's loader on a second thread of the worker is not the gang's data;
    a collective called from another thread (autograd's, for a CUDA backward's DDP hook)
    is the gang's."""
    c = Clocks()
    rec = recorder(c)
    go = threading.Barrier(threads + 1)

    def other() -> None:
        go.wait()
        with phases.phase(DATA) as p:
            p.rows(10)
        with phases.phase(COLLECTIVE):
            pass

    with phases.recording(rec):
        phases.step(phases.SYNCED)
        others = [threading.Thread(target=other) for _ in range(threads)]
        for t in others:
            t.start()
        go.wait()
        for t in others:
            t.join()
        c.tick(1.0)
        phases.step(phases.SYNCED)
    (w,) = rec.roll(final=True)
    assert w.phases[DATA] == 0.0 and w.rows == 0
    assert w.phases[COLLECTIVE] > 0.0


def test_a_second_gang_in_the_process_records_nothing_and_hooks_are_idle_without_one():
    c = Clocks()
    with phases.recording(recorder(c)) as first, phases.recording(recorder(c)) as second:
        assert first is not None and second is None
    with phases.phase(DATA) as p:
        p.rows(3)
    assert phases.stuck() == ""


@pytest.mark.parametrize("batch,rows", [
    ({"x": [[1, 2], [3, 4]]}, 2), ([["a", "b", "c"]], 3), ((), 0), (object(), 0),
])
def test_batch_rows_of_plain_structures(batch, rows):
    assert phases.batch_rows(batch) == rows


def test_batch_rows_of_tensors():
    torch = pytest.importorskip("torch")
    assert phases.batch_rows({"x": torch.zeros(5, 3), "y": torch.zeros(5)}) == 5
    assert phases.batch_rows((torch.zeros(7, 2), torch.zeros(7))) == 7


def _blocked_here(ev: threading.Event) -> None:
    ev.wait(30)


def test_a_threads_stack_names_the_users_function_it_is_in():
    ev = threading.Event()
    t = threading.Thread(target=_blocked_here, args=(ev,))
    t.start()
    try:
        got = None
        for _ in range(200):
            got = stacks.thread_stack(t.ident)
            if got and "_blocked_here" in got[1]:
                break
            ev.wait(0.01)
        stack, where = got
        assert where.startswith("_blocked_here (test_phases.py:")
        assert "in _blocked_here" in stack and "threading.py" in stack
    finally:
        ev.set()
        t.join()
    assert stacks.thread_stack(t.ident) is None

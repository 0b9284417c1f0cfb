"""Coordinator semantics on a real LocalCluster with worker processes (SPEC §2)."""

from __future__ import annotations

import os
import threading
import time

import pytest

import daskdist as dd
from tests.conftest import THREADS, wait_for_workers, wait_until


@pytest.fixture(scope="module", params=THREADS, ids=lambda n: f"threads{n}")
def threads(request) -> int:
    """Every coordinator guarantee holds at 1 and 2 threads per worker."""
    return request.param


def square(x):
    return x * x


def whoami(x=None):
    ctx = dd.get_worker_context()
    return {
        "x": x,
        "index": ctx.worker_index,
        "num_workers": ctx.num_workers,
        "device": str(ctx.device),
        "address": ctx.address,
        "attempt": ctx.attempt,
        "pid": os.getpid(),
    }


def fail(msg="boom"):
    raise ValueError(msg)


def sleep_and_return(t, value=None):
    time.sleep(t)
    return value


def flaky_until(attempt_ok):
    attempt = dd.get_worker_context().attempt
    if attempt < attempt_ok:
        raise RuntimeError(f"flaky on attempt {attempt}")
    return attempt


def reported_device():
    """The device this worker binds (what its plugin reports): cuda:0 with a GPU."""
    from daskdist.collective import bind_device

    return str(bind_device())


def test_schedule_fetch_and_worker_context(coord, client):
    rvs = [coord.schedule(whoami, args=(i,)) for i in range(20)]
    coord.join()
    assert coord.done()
    out = [rv.fetch() for rv in rvs]
    assert [o["x"] for o in out] == list(range(20))
    workers = set(client.scheduler_info(n_workers=-1)["workers"])
    pids = set(client.run(os.getpid).values())
    devices = client.run(reported_device)
    for o in out:
        assert o["index"] in (0, 1)
        assert o["num_workers"] == 2
        assert o["device"] == devices[o["address"]]
        assert o["address"] in workers
        assert o["attempt"] == 1
        assert o["pid"] in pids and o["pid"] != os.getpid()
    # indices are dense and belong to distinct workers
    by_index = {}
    for o in out:
        by_index.setdefault(o["index"], set()).add(o["address"])
    assert all(len(a) == 1 for a in by_index.values())
    assert all(rv.status == dd.RemoteValueStatus.READY and rv.done() for rv in rvs)
    assert rvs[0].exception() is None


def test_fetch_nested_structure(coord):
    a, b, c = (coord.schedule(square, args=(i,)) for i in (2, 3, 4))
    got = coord.fetch({"a": a, "rest": [b, (c, "plain")], "n": 7})
    assert got == {"a": 4, "rest": [9, (16, "plain")], "n": 7}


def test_done_is_nonblocking_and_join_waits(coord):
    rvs = [coord.schedule(sleep_and_return, args=(0.3, i)) for i in range(4)]
    assert coord.done() is False
    coord.join()
    assert coord.done() is True
    assert [rv.fetch() for rv in rvs] == [0, 1, 2, 3]


def test_bad_closures_raise_typeerror_and_queue_nothing(coord):
    before = coord.status()["scheduled"]
    with pytest.raises(TypeError, match="callable"):
        coord.schedule(42)
    lock = threading.Lock()
    with pytest.raises(TypeError, match="pickled"):
        coord.schedule(lambda: lock)
    rv = coord.schedule(square, args=(2,))
    with pytest.raises(TypeError, match="RemoteValue"):
        coord.schedule(square, args=([rv],))
    with pytest.raises(TypeError, match="RemoteValue"):
        coord.schedule(square, kwargs={"x": {"nested": rv}})
    with pytest.raises(TypeError, match="args"):
        coord.schedule(square, args=5)
    assert rv.fetch() == 4
    assert coord.status()["scheduled"] == before + 1


def test_user_error_raised_once_cancels_queue_and_clears(coord):
    bad = coord.schedule(fail, args=("first",))
    slow = [coord.schedule(sleep_and_return, args=(0.2, i)) for i in range(30)]
    with pytest.raises(ValueError, match="first") as info:
        coord.join()
    # the remote traceback is chained
    assert isinstance(info.value.__cause__, dd.errors.RemoteTraceback)
    assert "fail" in str(info.value.__cause__)
    # when join raised, nothing was executing any more
    status = coord.status()
    assert status["running"] == 0 and status["queued"] == 0
    with pytest.raises(ValueError, match="first"):
        bad.fetch()
    assert bad.status == dd.RemoteValueStatus.FAILED
    wait_until(lambda: all(rv.done() for rv in slow), 10, "every closure final")
    states = [rv.status for rv in slow]
    assert dd.RemoteValueStatus.CANCELLED in states
    assert set(states) <= {dd.RemoteValueStatus.READY, dd.RemoteValueStatus.CANCELLED}
    cancelled = [rv for rv in slow if rv.status == dd.RemoteValueStatus.CANCELLED]
    with pytest.raises(dd.CancelledError):
        cancelled[0].fetch()
    # the error was cleared: work continues
    assert coord.schedule(square, args=(5,)).fetch() == 25
    coord.join()
    assert coord.done()


def test_error_raised_by_next_schedule_and_done(coord):
    coord.schedule(fail, args=("via-schedule",))
    wait_until(lambda: coord._error_pending, 10, "the error to arrive")
    with pytest.raises(ValueError, match="via-schedule"):
        coord.schedule(square, args=(1,))
    assert coord.schedule(square, args=(3,)).fetch() == 9
    coord.schedule(fail, args=("via-done",))
    with pytest.raises(ValueError, match="via-done"):
        wait_until(lambda: coord.done() and False, 10, "done() to raise")
    assert coord.done() is True


def test_retries_rerun_user_errors(coord):
    assert coord.schedule(flaky_until, args=(3,), retries=2).fetch() == 3
    rv = coord.schedule(flaky_until, args=(3,), retries=1)
    with pytest.raises(RuntimeError, match="attempt 2"):
        rv.fetch()
    with pytest.raises(RuntimeError, match="attempt 2"):
        coord.join()
    assert coord.status()["retried"] >= 3


def test_timeouts(coord):
    rv = coord.schedule(sleep_and_return, args=(1.5, "late"))
    with pytest.raises(TimeoutError):
        rv.fetch(timeout=0.05)
    with pytest.raises(TimeoutError):
        coord.join(timeout=0.2)
    assert not rv.done()  # join gave up before the 1.5 s closure ended
    assert rv.fetch(timeout=30) == "late"
    coord.join(timeout=30)


def test_status_running_while_executing(coord):
    rv = coord.schedule(sleep_and_return, args=(1.0, 1))
    wait_until(lambda: rv.status == dd.RemoteValueStatus.RUNNING, 10, "RUNNING")
    assert rv.fetch() == 1 and rv.status == dd.RemoteValueStatus.READY


def make_resource(ctx):
    return {"index": ctx.worker_index, "pid": os.getpid(), "built_at": time.time()}


def use_resource(res):
    ctx = dd.get_worker_context()
    assert res["index"] == ctx.worker_index
    return res["pid"], res["built_at"], os.getpid()


def test_per_worker_resource_built_once_per_worker(coord):
    res = coord.create_per_worker_resource(make_resource)
    out = coord.fetch([coord.schedule(use_resource, args=(res,)) for _ in range(20)])
    for res_pid, _, pid in out:
        assert res_pid == pid != os.getpid()  # built on the worker, never on the client
    built = {}
    for res_pid, built_at, _ in out:
        built.setdefault(res_pid, set()).add(built_at)
    assert all(len(v) == 1 for v in built.values())  # one build per worker
    with pytest.raises(TypeError):
        next(res)


def make_counter_dataset(ictx):
    start = ictx.input_pipeline_id * 1000
    return [start + i for i in range(100)] + [ictx.num_input_pipelines]


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_per_worker_dataset_iterators(coord):
    ds = coord.create_per_worker_dataset(make_counter_dataset)
    it = iter(ds)
    assert isinstance(it, dd.PerWorkerValues)
    with pytest.raises(TypeError):
        next(it)
    out = coord.fetch([coord.schedule(take, args=(it, 3)) for _ in range(10)])
    # every worker's iterator advanced without repeats: per worker values strictly increase
    seen = [v for chunk in out for v in chunk]
    assert len(seen) == len(set(seen)) == 30
    for chunk in out:
        assert chunk[0] // 1000 == chunk[-1] // 1000


def broken_factory(ctx):
    raise ZeroDivisionError("factory exploded")


def test_failing_resource_gives_input_error_others_unaffected(coord):
    res = coord.create_per_worker_resource(broken_factory)
    ok = coord.schedule(square, args=(6,))
    assert ok.fetch() == 36
    bad = coord.schedule(use_resource, args=(res,))
    with pytest.raises(dd.InputError, match="factory exploded") as info:
        bad.fetch()
    assert isinstance(info.value.original, ZeroDivisionError)
    with pytest.raises(dd.InputError):
        coord.join()
    assert ok.fetch() == 36
    assert coord.schedule(square, args=(7,)).fetch() == 49


def test_registering_twice_attaches_to_same_queue(client, coord):
    joins = coord.status()["worker_joins"]
    again = dd.Coordinator(client, name=coord.name)
    try:
        a = coord.schedule(square, args=(2,))
        b = again.schedule(square, args=(3,))
        assert (a.fetch(), b.fetch()) == (4, 9)
        assert again.status()["scheduled"] == coord.status()["scheduled"]
        assert coord.status()["worker_joins"] == joins  # workers kept their sessions
    finally:
        again.close()


def test_two_names_do_not_interfere(client, coord):
    other = dd.Coordinator(client, name=coord.name + "-other")
    try:
        wait_for_workers(client, other, 2)
        other.schedule(fail, args=("only-other",))
        with pytest.raises(ValueError, match="only-other"):
            other.join()
        rv = coord.schedule(square, args=(4,))
        coord.join()  # the other queue's error is not ours
        assert rv.fetch() == 16
        assert coord.status()["failed"] == 0
    finally:
        other.close()


def test_status_and_html_reprs(coord):
    rv = coord.schedule(square, args=(3,))
    rv.fetch()
    s = coord.status()
    for key in ("queued", "running", "done", "failed", "retried", "cancelled", "workers",
                "recoveries"):
        assert key in s
    assert s["done"] >= 1 and s["workers"] == 2
    assert "Coordinator" in coord._repr_html_() and "workers" in coord._repr_html_()
    assert "READY" in rv._repr_html_()


def test_queue_is_bounded(client, request):
    co = dd.Coordinator(client, name=request.node.name, max_queued=3)
    try:
        wait_for_workers(client, co, 2)
        gate = [co.schedule(sleep_and_return, args=(0.5, i)) for i in range(3)]
        t = time.monotonic()
        extra = co.schedule(square, args=(2,))  # blocks until one finished
        assert time.monotonic() - t > 0.3
        assert extra.fetch() == 4 and [g.fetch() for g in gate] == [0, 1, 2]
    finally:
        co.close()

"""Session liveness (SPEC §2.4): leases, expiry of hung workers, fencing, no hang taken
for a GIL-holding closure, and no head-of-line blocking behind a long closure."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import dask
import pytest
from distributed import Client

import daskdist as dd
from daskdist.core.membership import LivenessTable
from tests.conftest import make_cluster, wait_for_workers, wait_until, worker_pids
from tests.tables import check_leases, check_queue, leased_to

# -- the pure table --------------------------------------------------------------------


def test_silent_session_expires_after_timeout_only():
    t = LivenessTable(timeout=10)
    t.add("a", 0.0)
    t.add("b", 0.0)
    assert t.renew("a", 5.0)
    assert t.expire(9.9) == []
    assert t.expire(10.5) == ["b"]  # a renewed at 5: alive until 15
    assert "b" not in t and "a" in t
    assert t.expire(14.9) == []  # renewed at 5: alive until 15
    assert t.expire(15.1) == ["a"]
    assert t.expiries == 2 and len(t) == 0


def test_expired_or_forgotten_session_cannot_renew():
    t = LivenessTable(timeout=1)
    t.add("a", 0.0)
    t.add("b", 0.0)
    assert t.expire(2.0) == ["a", "b"]
    assert not t.renew("a", 2.5)  # fenced: it must register a new session
    t.add("c", 3.0)
    t.forget("c")
    assert not t.renew("c", 3.1)
    assert t.expire(100.0) == [] and t.expiries == 2
    assert not t.renew("never-added", 0.0)


def test_renewal_never_moves_back_in_time():
    t = LivenessTable(timeout=5)
    t.add("a", 10.0)
    assert t.renew("a", 3.0)  # a late, reordered message
    assert t.expire(14.9) == [] and t.expire(15.1) == ["a"]  # still alive until 10 + 5


def test_a_stalled_scheduler_blames_no_session():
    t = LivenessTable(timeout=5)
    t.add("a", 0.0)
    t.extend(8.0)  # the scheduler's loop was blocked for 8 s
    assert t.expire(10.0) == []
    assert t.expire(13.5) == ["a"]


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="lease-timeout"):
        LivenessTable(timeout=0)


def test_coordinator_state_expires_like_a_lost_worker():
    """CoordinatorState: an expired session's closures go back, it stops being a member,
    its leased rows return to the pool, and renewals from it are refused."""
    from daskdist.plugins.scheduler.state import CoordinatorState

    co = CoordinatorState("t", lease_timeout=5)
    for s, addr in (("s1", "w1"), ("s2", "w2")):
        co.members.join(s, addr, now=0.0)
        co.queue.add_session(s, 1)
    for i in range(4):
        co.queue.put(f"o-{i}", "o", b"")
    assert [c.cid for c in co.queue.dispatch("s1", 2)] == ["o-0", "o-1"]
    co.leases.define("ds", [(10, 1)])
    lease = co.leases.acquire("s1", "ds", 0, 10)
    assert lease is not None
    assert co.members.renew("s2", 4.0)
    assert co.expire_sessions(5.5) == ["s1"]
    assert "s1" not in co.members and co.workers_lost == 1
    assert not co.members.renew("s1", 6.0)
    assert [c.cid for c in co.queue.dispatch("s2", 4)] == ["o-0", "o-1", "o-2", "o-3"]
    assert co.leases.progress("ds", 0)["free"] == 10
    assert co.status()["lease_expiries"] == 1
    check_queue(co.queue)
    check_leases(co.leases)


# -- real processes ----------------------------------------------------------------------

LEASE = 3.0  # seconds: short, so a SIGSTOP test stays fast


def sleepy(i, seconds):
    ctx = dd.get_worker_context()
    time.sleep(seconds)
    return i, ctx.attempt, os.getpid(), time.time()


@pytest.fixture(scope="module")
def short_lease_cluster():
    # The scheduler of a LocalCluster runs in this process and reads the setting when a
    # coordinator is created; the nannies hand this process's config to the workers.
    with dask.config.set({"daskdist.liveness.lease-timeout": f"{LEASE}s",
                          "daskdist.liveness.renew-interval": "250ms"}), \
            make_cluster(2) as cluster, Client(cluster) as client:
        yield cluster, client


def test_workers_see_the_config_of_the_cluster_creator(short_lease_cluster):
    _, client = short_lease_cluster
    got = client.run(lambda: dask.config.get("daskdist.liveness.renew-interval"))
    assert set(got.values()) == {"250ms"}


def test_sigstopped_worker_closures_complete_elsewhere(short_lease_cluster):
    _, client = short_lease_cluster
    with dask.config.set({"daskdist.liveness.lease-timeout": f"{LEASE}s"}):
        coord = dd.Coordinator(client, name="sigstop")
    try:
        wait_for_workers(client, coord, 2)
        rvs = [coord.schedule(sleepy, args=(i, 0.1)) for i in range(40)]
        wait_until(lambda: coord.status()["done"] >= 4, 30, "some progress")
        pids = sorted(worker_pids(client).values())
        victim = pids[0]
        os.kill(victim, signal.SIGSTOP)
        t_stop, t_wall = time.monotonic(), time.time()
        try:
            coord.join(timeout=LEASE + 30)
            recovered = time.monotonic() - t_stop
            status = coord.status()
        finally:
            os.kill(victim, signal.SIGCONT)
        results = [rv.fetch() for rv in rvs]
        counts = Counter(r[0] for r in results)
        assert sorted(counts) == list(range(40)) and set(counts.values()) == {1}
        assert status["lease_expiries"] >= 1 and status["workers_lost"] >= 1
        rerun = [end - t_wall for _, attempt, pid, end in results
                 if attempt >= 2 and pid != victim]
        print(f"SIGSTOP: the stopped closure completed elsewhere "
              f"{min(rerun, default=float('nan')):.2f} s after the stop, all done after "
              f"{recovered:.2f} s (lease-timeout {LEASE} s)")
        # the woken worker rejoins as a new session and takes work again
        wait_until(lambda: coord.status()["workers"] == 2, 30, "the stopped worker rejoining")
        after = coord.fetch([coord.schedule(sleepy, args=(i, 0.05)) for i in range(20)])
        assert victim in {pid for _, _, pid, _ in after}
        assert coord.status()["done"] == 60  # late results of the old session were refused
    finally:
        coord.close()


def gil_holder(seconds):
    """Pure-Python work (holds the GIL between switch intervals) then a matmul loop."""
    import torch

    end = time.monotonic() + seconds / 2
    x = 0
    while time.monotonic() < end:
        for i in range(10000):
            x += i * i
    a = torch.randn(512, 512)
    end = time.monotonic() + seconds / 2
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
    return os.getpid()


def _probe_gaps(dask_worker):
    """Start a task measuring the largest gap between event-loop ticks (10 ms sleeps)."""
    import asyncio

    state = dask_worker.__dict__.setdefault("_gap_probe", {"max": 0.0, "stop": False})
    state.update(max=0.0, stop=False)

    async def probe():
        last = time.monotonic()
        while not state["stop"]:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            state["max"] = max(state["max"], now - last - 0.01)
            last = now

    asyncio.get_running_loop().create_task(probe())


def _read_gaps(dask_worker):
    state = dask_worker._gap_probe
    state["stop"] = True
    return state["max"]


def test_gil_holding_closure_is_not_taken_for_a_hang(short_lease_cluster):
    _, client = short_lease_cluster
    with dask.config.set({"daskdist.liveness.lease-timeout": f"{LEASE}s"}):
        coord = dd.Coordinator(client, name="gil")
    try:
        wait_for_workers(client, coord, 2)
        client.run(_probe_gaps)
        rvs = [coord.schedule(gil_holder, args=(2 * LEASE,)) for _ in range(2)]
        coord.join(timeout=120)
        gaps = client.run(_read_gaps)
        print(f"largest event-loop gap during GIL-holding closures: "
              f"{max(gaps.values()) * 1000:.1f} ms")
        assert coord.status()["lease_expiries"] == 0
        assert all(rv.fetch() for rv in rvs)
        assert all(rv.attempt == 1 for rv in rvs)
    finally:
        coord.close()


def _held_until(started: str, go: str, deadline: float) -> int:
    """Say it started (a file), then hold its thread until ``go`` exists."""
    open(started, "w").close()
    end = time.monotonic() + deadline
    while not os.path.exists(go):
        if time.monotonic() > end:
            raise TimeoutError(f"{go} never appeared")
        time.sleep(0.01)
    return os.getpid()


def test_short_closures_do_not_wait_behind_a_long_one(tmp_path):
    """One 20 s closure, then 60 of 0.1 s, on two workers: every short one finishes while
    the long one still runs (the prefetched ones are taken back from its worker).

    Both workers are held busy while the closures are queued, so the worker that takes
    the long one takes prefetched short ones with it in the same reply: they can only
    finish in time if they are stolen back."""
    go = str(tmp_path / "go")
    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="hol")
        wait_for_workers(client, coord, 2)
        started = [str(tmp_path / f"started-{i}") for i in range(2)]
        holds = [coord.schedule(_held_until, args=(s, go, 60.0)) for s in started]
        wait_until(lambda: all(os.path.exists(s) for s in started), 60,
                   "both workers running a held closure")
        t0 = time.monotonic()
        long = coord.schedule(sleepy, args=(-1, 20.0))
        short = [coord.schedule(sleepy, args=(i, 0.1)) for i in range(60)]
        wait_until(lambda: coord.status()["queued"] == 61, 30, "61 closures queued")
        open(go, "w").close()
        assert len({rv.fetch(timeout=60) for rv in holds}) == 2  # one on each worker
        for rv in short:
            rv.fetch(timeout=60)
        elapsed = time.monotonic() - t0
        assert not long.done()  # nothing waited for the long closure to end
        assert coord.status()["steals"] >= 1
        print(f"60 short closures beside a 20 s one: {elapsed:.2f} s")
        coord.close()


def test_lease_timeout_constructor_argument_wins(short_lease_cluster):
    _, client = short_lease_cluster
    with pytest.raises(ValueError, match="lease_timeout"):
        dd.Coordinator(client, name="lt-bad", lease_timeout=0)
    coord = dd.Coordinator(client, name="lt", lease_timeout=7)
    try:
        got = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.extensions["daskdist"]
            .coordinators["lt"].members.leases.timeout)
        assert got == 7.0
    finally:
        coord.close()


def test_a_completed_closure_whose_rows_are_refused_is_counted_and_frees_its_lease():
    """A closure that completes with rows its session does not hold (never expected) is
    counted and logged, and the rows it does hold go back to the pool (none stay stuck)."""
    from daskdist.core.protocol import READY, Outcome
    from daskdist.data.leased.service import lease_token
    from daskdist.plugins.scheduler.state import CoordinatorState

    co = CoordinatorState("t")
    co.members.join("s1", "w1")
    co.queue.add_session("s1", 1)
    co.queue.put("o-0", "o", b"")
    assert [c.cid for c in co.queue.dispatch("s1", 1)] == ["o-0"]
    co.members.join("s2", "w2")
    co.leases.define("ds", [(10, 2)])
    assert co.leases.acquire("s1", "ds", 0, 1) == [(0, 10)]
    assert co.leases.acquire("s2", "ds", 0, 1) == [(10, 20)]
    # rows 0-5 are this session's, 10-12 another's: the acknowledgement is refused whole
    co.closure_book.apply_results("s1", [Outcome("o-0", READY, b"", None, 1, tokens=[
        lease_token("ds", 0, [(0, 5)]), lease_token("ds", 0, [(10, 12)])])])
    assert co.status()["acks_refused"] == 1
    p = co.leases.progress("ds", 0)
    assert p["acknowledged"] == 0 and p["free"] == 5  # s1's rows 0-5 back in the pool
    assert leased_to(co.leases, "s2", "ds", 0) == [(10, 20)]  # the other's untouched

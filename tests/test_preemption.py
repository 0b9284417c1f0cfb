"""Worker loss on a real LocalCluster: SIGKILL, retirement, lost sessions (SPEC §2.4)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest
from distributed import Client

import daskdist as dd
from daskdist.core.protocol import worker_plugin_name
from daskdist.plugins.worker.plugin import CoordinatorWorkerPlugin
from tests.conftest import (
    kill_and_replace,
    make_cluster,
    sigkill,
    wait_for_workers,
    wait_until,
    worker_pids,
)


def slow_task(i, seconds=0.2):
    ctx = dd.get_worker_context()
    time.sleep(seconds)
    return i, ctx.attempt, os.getpid(), ctx.worker_index


def pid_of_running(coord, client):
    """The pid of a worker that is running one of ``coord``'s closures now."""
    def running(dask_worker, name=coord.name):
        plugin = dask_worker.plugins.get(worker_plugin_name(name))
        return plugin is not None and plugin.runner is not None and plugin.runner.taken > 0

    def find():
        busy = [a for a, r in client.run(running, on_error="ignore").items() if r]
        return client.run(os.getpid, workers=busy[:1]).popitem()[1] if busy else None

    return wait_until(find, 30, "a worker running a closure")


def check_exactly_once(results, n):
    counts = Counter(r[0] for r in results)
    assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}


def test_sigkill_mid_closure_reruns_elsewhere(coord, client):
    rvs = [coord.schedule(slow_task, args=(i,)) for i in range(24)]
    finished = wait_until(lambda: [rv for rv in rvs if rv.done()], 30, "a first result")
    victim = finished[0].fetch()[2]  # this worker has more closures leased: kill it now
    sigkill(victim)
    coord.join(timeout=60)
    results = [rv.fetch() for rv in rvs]
    check_exactly_once(results, 24)
    assert any(attempt >= 2 for _, attempt, _, _ in results)
    assert coord.status()["recoveries"] >= 1
    assert coord.status()["workers_lost"] == 1  # a SIGKILL is not an expected removal
    # results that finished on the victim before it died stay fetchable
    assert any(pid == victim for _, _, pid, _ in results)
    wait_for_workers(client, coord, 2, gone=victim)


def test_same_worker_killed_twice(coord, client):
    rvs = [coord.schedule(slow_task, args=(i, 0.15)) for i in range(30)]
    first = pid_of_running(coord, client)
    kill_and_replace(client, coord, first)
    # the replacement took the lost worker's index; kill the worker at that index again
    index_pid = dict(
        client.run(lambda dask_worker, n=coord.name: (
            dask_worker.plugins[worker_plugin_name(n)].runner.index, os.getpid()),
            on_error="ignore").values()
    )
    before = coord.status()["recoveries"]
    if coord.done():
        rvs += [coord.schedule(slow_task, args=(i, 0.15)) for i in range(30, 40)]
    sigkill(index_pid[0])
    coord.join(timeout=90)
    results = [rv.fetch() for rv in rvs]
    check_exactly_once(results, len(rvs))
    # the survivor may finish everything before Dask reports the second kill
    wait_until(lambda: coord.status()["worker_leaves"] >= 2, 30, "the second leave")
    assert coord.status()["recoveries"] >= before
    wait_for_workers(client, coord, 2)
    # indices stay dense after the replacements
    indices = sorted(r.fetch()[3] for r in [coord.schedule(slow_task, args=(0, 0.3))
                                             for _ in range(6)])
    assert set(indices) <= {0, 1}


def build_pid(ctx):
    return {"pid": os.getpid(), "index": ctx.worker_index}


def read_resource(res):
    return res["pid"], os.getpid()


def test_resource_rebuilt_on_replacement_worker(coord, client):
    res = coord.create_per_worker_resource(build_pid)
    before = coord.fetch([coord.schedule(read_resource, args=(res,)) for _ in range(10)])
    assert all(a == b for a, b in before)
    victim = next(iter(worker_pids_of(client)))
    kill_and_replace(client, coord, victim)
    after = coord.fetch([coord.schedule(read_resource, args=(res,)) for _ in range(20)])
    assert all(a == b for a, b in after)  # every worker uses its own resource
    assert victim not in {a for a, _ in after}
    new_pids = set(worker_pids_of(client))
    assert {a for a, _ in after} <= new_pids


def worker_pids_of(client):
    return list(worker_pids(client).values())


def poison_pill():
    os.kill(os.getpid(), signal.SIGKILL)


def test_poison_pill_ends_in_worker_lost_error(coord, client):
    pill = coord.schedule(poison_pill)
    later = [coord.schedule(slow_task, args=(i, 0.05)) for i in range(10)]
    with pytest.raises(dd.WorkerLostError):
        pill.fetch(timeout=90)
    check_exactly_once([rv.fetch(timeout=60) for rv in later], 10)
    with pytest.raises(dd.WorkerLostError):
        coord.join()
    assert coord.status()["failed"] == 1
    wait_for_workers(client, coord, 2)


def test_lost_session_closures_are_put_back(coord, client):
    """Re-registering the worker plugin mid-flight ends sessions; nothing is stranded."""
    rvs = [coord.schedule(slow_task, args=(i, 0.1)) for i in range(20)]
    pid_of_running(coord, client)
    plugin = CoordinatorWorkerPlugin(coord.name)
    plugin.idempotent = False  # force teardown + setup: every worker gets a new session
    client.register_plugin(plugin, name=worker_plugin_name(coord.name))
    coord.join(timeout=60)
    check_exactly_once([rv.fetch() for rv in rvs], 20)
    assert coord.status()["worker_joins"] >= 4


def test_cancelled_long_poll_does_not_strand_closures(coord, client):
    """A worker's exchange cancelled while the scheduler waits: closures must still run."""
    def cancel_loop(dask_worker, name=coord.name):
        runner = dask_worker.plugins[worker_plugin_name(name)].runner
        runner.task.cancel()
        return runner.session_id

    def restart_loop(dask_worker, name=coord.name):
        import asyncio

        runner = dask_worker.plugins[worker_plugin_name(name)].runner
        runner.task = asyncio.get_running_loop().create_task(runner._loop())

    async def arestart(dask_worker, name=coord.name):
        restart_loop(dask_worker, name)

    client.run(cancel_loop)
    rvs = [coord.schedule(slow_task, args=(i, 0.01)) for i in range(10)]
    # closures may now be leased to sessions whose reply nobody reads
    client.run(arestart)
    coord.join(timeout=60)
    check_exactly_once([rv.fetch() for rv in rvs], 10)


def test_retire_workers_loses_nothing():
    with make_cluster(3) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="retire")
        wait_for_workers(client, coord, 3)
        rvs = [coord.schedule(slow_task, args=(i, 0.1)) for i in range(40)]
        wait_until(lambda: coord.status()["done"] >= 5, 30, "some progress")
        workers = list(client.scheduler_info(n_workers=-1)["workers"])
        retiring = workers[0]
        client.retire_workers([retiring], close_workers=True)
        t_retired = time.time()
        coord.join(timeout=60)
        results = [rv.fetch() for rv in rvs]
        check_exactly_once(results, 40)
        assert coord.status()["workers"] == 2
        assert coord.status()["workers_lost"] == 0  # Dask expected this removal
        assert len(client.scheduler_info(n_workers=-1)["workers"]) == 2
        # the retired worker ran nothing after retirement (it is gone)
        after = [coord.schedule(slow_task, args=(i, 0.01)) for i in range(10)]
        coord.join(timeout=60)
        assert time.time() > t_retired
        live = set(client.run(os.getpid).values())
        assert {rv.fetch()[2] for rv in after} <= live
        coord.close()


def test_sessions_ended_by_the_scheduler_recover(coord, client):
    """The scheduler ends live workers' sessions mid-flight (as after a network cut):
    their closures run again, the workers re-register, and keep taking work."""
    def end_sessions(dask_scheduler, name=coord.name):
        co = dask_scheduler.extensions["daskdist"].coordinators[name]
        sessions = list(co.members.members)
        for s in sessions:
            co.end_session(s)
        return len(sessions)

    rvs = [coord.schedule(slow_task, args=(i, 0.1)) for i in range(20)]
    pid_of_running(coord, client)
    assert client.run_on_scheduler(end_sessions) == 2
    coord.join(timeout=60)
    check_exactly_once([rv.fetch() for rv in rvs], 20)
    wait_for_workers(client, coord, 2)
    after = coord.fetch([coord.schedule(slow_task, args=(i, 0.1)) for i in range(12)])
    assert len({pid for _, _, pid, _ in after}) == 2  # both workers still take closures


def test_retiring_worker_gets_no_new_work(coord, client):
    """A worker whose status turns closing_gracefully takes no closure; back to running,
    it takes work again."""
    workers = sorted(worker_pids(client).items())
    (addr, pid), (_, other_pid) = workers

    def set_status(status, dask_scheduler=None, address=addr):
        dask_scheduler.handle_worker_status_change(status, address, "test-retire")

    client.run_on_scheduler(set_status, "closing_gracefully")
    try:
        out = coord.fetch([coord.schedule(slow_task, args=(i, 0.01)) for i in range(20)])
        assert {p for _, _, p, _ in out} == {other_pid}
    finally:
        client.run_on_scheduler(set_status, "running")
    out = coord.fetch([coord.schedule(slow_task, args=(i, 0.05)) for i in range(20)])
    assert pid in {p for _, _, p, _ in out}


def test_worker_plugin_setup_failure_is_raised(client):
    """A worker plugin that fails to set up (here: an invalid torch thread count) is an
    error of ``Coordinator(...)`` naming the cause, not a coordinator without workers."""
    with pytest.raises(RuntimeError, match="failed to set up.*set_num_threads"):
        dd.Coordinator(client, name="bad-setup", torch_threads=-1)
    plugins = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.worker_plugins))
    assert worker_plugin_name("bad-setup") not in plugins  # a retry registers it again

"""Planned departures are not failures, and a memory pause keeps the group
(SPEC §2.4), on real LocalClusters with worker processes."""

from __future__ import annotations

import glob
import os
import time

import dask
from distributed import Client
from distributed.core import Status

import daskdist as dd
from daskdist.core.protocol import worker_plugin_name
from daskdist.plugins.worker.plugin import CoordinatorWorkerPlugin
from tests.conftest import make_cluster, wait_for_workers, wait_until


def long_closure(gate, timeout=240.0):
    """Says where each attempt runs (a file per attempt), then runs until ``gate``."""
    ctx = dd.get_worker_context()
    with open(f"{gate}.attempt{ctx.attempt}", "w") as f:
        f.write(ctx.address)
    deadline = time.monotonic() + timeout
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    return ctx.attempt, ctx.address


def running_at(gate, attempt):
    """The worker address running ``attempt`` of the long closure, once it started."""
    path = f"{gate}.attempt{attempt}"
    wait_until(lambda: os.path.exists(path) and open(path).read(), 120,
               f"attempt {attempt} to start")
    return open(path).read()


def short(i):
    return i


def test_planned_departures_put_a_long_closure_back_without_counting(tmp_path):
    """Retirement, a graceful close and a plugin re-registration, one after another,
    while one long closure runs: with max_worker_failures=1 it still completes (no
    departure fails it with WorkerLostError)."""
    gate = str(tmp_path / "gate")
    with make_cluster(4) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="departures", max_worker_failures=1)
        try:
            wait_for_workers(client, coord, 4)
            rv = coord.schedule(long_closure, args=(gate,))
            others = [coord.schedule(short, args=(i,)) for i in range(20)]

            client.retire_workers([running_at(gate, 1)], close_workers=True)
            addr = running_at(gate, 2)  # run again elsewhere, a new attempt
            client.run(lambda dask_worker: dask_worker.loop.add_callback(
                dask_worker.close_gracefully), workers=[addr])
            running_at(gate, 3)
            plugin = CoordinatorWorkerPlugin(coord.name)
            plugin.idempotent = False  # every worker's session ends and a new one starts
            client.register_plugin(plugin, name=worker_plugin_name(coord.name))
            running_at(gate, 4)

            open(gate, "w").close()
            attempt, _ = rv.fetch(timeout=120)
            assert attempt == 4
            assert coord.fetch(others) == list(range(20))
            status = coord.status()
            assert status["failed"] == 0 and status["workers_lost"] == 0
            assert len(glob.glob(f"{gate}.attempt*")) == 4
        finally:
            coord.close()


def where(i):
    return dd.get_worker_context().address


def rank_info():
    group = dd.collective.get_group()
    return group.rank, group.world_size, group.generation


def set_status(status: str):
    def run(dask_worker, status=status):
        dask_worker.status = Status[status]

    return run


def test_a_memory_paused_worker_keeps_its_place_in_the_group():
    """A paused worker (Dask pauses at 80% memory) takes no new closures but stays in its
    group: the next gangs run on the same generation, paused and after unpause (it is
    not dropped at the next gang and re-formed in on unpause)."""
    # the worker's memory monitor would unpause it at once: pause by status only
    with dask.config.set({"distributed.worker.memory.pause": False}), \
            make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="paused")
        try:
            wait_for_workers(client, coord, 2)
            group = coord.collective_group(backend="gloo", timeout=60)
            before = coord.fetch(coord.schedule_on_all(rank_info))
            assert sorted(before) == [(0, 2, group.generation), (1, 2, group.generation)]
            paused = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]

            client.run(set_status("paused"), workers=[paused])
            wait_until(lambda: client.run_on_scheduler(
                lambda dask_scheduler: dask_scheduler.workers[paused].status.name)
                == "paused", 30, "the scheduler to see the pause")
            out = coord.fetch([coord.schedule(where, args=(i,)) for i in range(20)])
            assert paused not in out  # no new closures
            during = coord.fetch(coord.schedule_on_all(rank_info))
            assert sorted(during) == sorted(before)  # same members, same generation

            client.run(set_status("running"), workers=[paused])
            wait_until(lambda: paused in coord.fetch(
                [coord.schedule(where, args=(i,)) for i in range(10)]), 30,
                "closures on the unpaused worker")
            after = coord.fetch(coord.schedule_on_all(rank_info))
            assert sorted(after) == sorted(before)
            assert coord._call("daskdist_group_info")["generation"] == group.generation
        finally:
            coord.close()

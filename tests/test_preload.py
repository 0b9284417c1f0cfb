"""The scheduler plugin loaded with `dask scheduler --preload` (no client registration)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from distributed import Client

import daskdist as dd
import daskdist.plugins.scheduler
from tests.conftest import wait_for_workers, wait_until


def triple(x):
    return 3 * x


@pytest.fixture
def preloaded_cluster(tmp_path):
    """`dask scheduler --preload daskdist.plugins.scheduler` that refuses client plugins."""
    sched_file = tmp_path / "scheduler.json"
    env = dict(os.environ)
    env["DASK_DISTRIBUTED__SCHEDULER__BLOCKED_HANDLERS"] = json.dumps(
        ["register_scheduler_plugin", "register_worker_plugin"])
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here),
                                         env.get("PYTHONPATH", "")])
    bindir = os.path.dirname(sys.executable)
    procs = [subprocess.Popen(
        [os.path.join(bindir, "dask"), "scheduler", "--port", "0", "--no-dashboard",
         "--scheduler-file", str(sched_file), "--preload", "daskdist.plugins.scheduler"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        wait_until(lambda: sched_file.exists() and sched_file.read_text().strip(), 60,
                   "the scheduler file")
        procs.append(subprocess.Popen(
            [os.path.join(bindir, "dask"), "worker", "--scheduler-file", str(sched_file),
             "--nthreads", "1", "--no-dashboard"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield str(sched_file)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_preloaded_scheduler_plugin_serves_coordinator(preloaded_cluster):
    with Client(scheduler_file=preloaded_cluster) as client:
        # the client may not register plugins here: prove it, then use the preload
        with pytest.raises(Exception, match="disallowed"):
            client.register_plugin(dd.plugins.scheduler.CoordinatorPlugin(), name="x")
        coord = dd.Coordinator(client, name="preloaded")
        wait_for_workers(client, coord, 1)
        assert coord.fetch([coord.schedule(triple, args=(i,)) for i in range(5)]) == [
            0, 3, 6, 9, 12]
        coord.close()


def test_gpu_pin_picks_the_workers_own_gpu():
    from daskdist.plugins.gpu_pin import local_gpu

    assert local_gpu("SLURMCluster-3-0", None, 4) == "0"
    assert local_gpu("SLURMCluster-3-2", None, 4) == "2"
    assert local_gpu("job-1", "4,5,6,7", 0) == "5"
    assert local_gpu("job-5", "4,5", 0) == "5"  # wraps around
    assert local_gpu("worker", "0,1", 0) is None  # no index in the name: leave it
    assert local_gpu("job-0", None, 0) is None  # no GPU at all

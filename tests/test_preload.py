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
from tests.conftest import child_env, wait_for_workers, wait_until


def triple(x):
    return 3 * x


def _stop(procs: list) -> None:
    """Terminate the cluster's processes, last started first; kill one that lingers."""
    for p in reversed(procs):
        p.terminate()
    for p in reversed(procs):
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture
def preloaded_cluster(tmp_path):
    """`dask scheduler --preload daskdist.plugins.scheduler` that refuses client plugins."""
    sched_file = tmp_path / "scheduler.json"
    env = child_env(os.path.dirname(os.path.abspath(__file__)))
    env["DASK_DISTRIBUTED__SCHEDULER__BLOCKED_HANDLERS"] = json.dumps(
        ["register_scheduler_plugin", "register_worker_plugin"])
    procs = [subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--port", "0", "--no-dashboard",
         "--scheduler-file", str(sched_file), "--preload", "daskdist.plugins.scheduler"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        wait_until(lambda: sched_file.exists() and sched_file.read_text().strip(), 60,
                   "the scheduler file")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker",
             "--scheduler-file", str(sched_file), "--nthreads", "1", "--no-dashboard"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield str(sched_file)
    finally:
        _stop(procs)


@pytest.mark.slow
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


def test_gpu_pin_picks_the_gpu_of_the_workers_slot():
    from daskdist.plugins.gpu_pin import local_gpu

    assert local_gpu(0, None, 4) == "0"
    assert local_gpu(2, None, 4) == "2"
    assert local_gpu(1, "4,5,6,7", 0) == "5"
    assert local_gpu(5, "4,5", 0) == "5"  # wraps around
    assert local_gpu(0, None, 0) is None  # no GPU at all


def test_host_slots_are_the_lowest_free_and_freed_with_their_holder(tmp_path):
    from daskdist.plugins import gpu_pin

    try:
        assert [gpu_pin.host_slot(str(tmp_path)) for _ in range(3)] == [0, 1, 2]
        gpu_pin._held.pop(1).close()  # slot 1's holder ended: its successor takes it
        assert gpu_pin.host_slot(str(tmp_path)) == 1
        assert gpu_pin.host_slot(str(tmp_path)) == 3
    finally:
        gpu_pin.release_slots()
    assert gpu_pin.host_slot(str(tmp_path)) == 0
    gpu_pin.release_slots()


def _visible():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_gpu_pin_on_a_local_cluster_whose_workers_are_named_0_1_2(tmp_path):
    """LocalCluster names its workers 0, 1, 2 (no ``-N`` suffix): each still gets its
    own device (here among 3 devices made visible, as a 3-GPU host shows them), its
    slot one of this job's (outside a batch system: the cluster's scheduler)."""
    import dask

    from daskdist.plugins import gpu_pin
    from tests.conftest import make_cluster

    # the devices are made visible to the workers only, and distributed's NVML monitor
    # is off there: on a host with a real GPU it would look for devices 4, 6 and 7
    with dask.config.set({"daskdist.gpu-pin.slots-dir": str(tmp_path / "slots"),
                          "distributed.diagnostics.nvml": False}):
        with make_cluster(3, preload=["daskdist.plugins.gpu_pin"],
                          env={"CUDA_VISIBLE_DEVICES": "4,6,7"}) as cluster, \
                Client(cluster) as client:
            client.wait_for_workers(3)
            names = client.run(lambda dask_worker: dask_worker.name)
            assert sorted(names.values()) == [0, 1, 2]
            assert sorted(client.run(_visible).values()) == ["4", "6", "7"]
            job = gpu_pin.job_key(None, os.environ,
                                  dask.config.get("daskdist.gpu-pin.job-variables"),
                                  cluster.scheduler_address)
            assert [p.name for p in (tmp_path / "slots").iterdir()] == [
                os.path.basename(gpu_pin.slots_dir(job))]
            assert sorted(p.name for p in (tmp_path / "slots").glob("*/*.lock")) == [
                "0.lock", "1.lock", "2.lock"]


def _worker_parent() -> tuple[int, int, bool]:
    """This worker's pid, its parent's, and whether the parent has torch loaded."""
    ppid = os.getppid()
    with open(f"/proc/{ppid}/maps") as f:
        return os.getpid(), ppid, "libtorch" in f.read()


def _nanny_pid(dask_worker) -> int:
    return os.getpid()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc")
def test_the_fork_server_nanny_preload_forks_workers_and_replacements_with_torch(tmp_path):
    """`dask worker --nanny --preload-nanny daskdist.plugins.fork_server`: the worker, and
    the Nanny's replacement after a SIGKILL, are children of a fork server (not of the
    Nanny) that has torch loaded, so a replacement imports nothing heavy again."""
    from tests.conftest import sigkill

    sched_file = tmp_path / "scheduler.json"
    env = child_env(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--port", "0",
         "--no-dashboard", "--scheduler-file", str(sched_file)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        wait_until(lambda: sched_file.exists() and sched_file.read_text().strip(), 60,
                   "the scheduler file")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
             str(sched_file), "--nthreads", "1", "--no-dashboard", "--nanny",
             "--preload-nanny", "daskdist.plugins.fork_server"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with Client(scheduler_file=str(sched_file)) as client:
            client.wait_for_workers(1, timeout=60)
            nanny = next(iter(client.run(_nanny_pid, nanny=True).values()))
            pid, parent, torch_there = next(iter(client.run(_worker_parent).values()))
            assert parent != nanny and torch_there, (pid, parent, nanny)
            sigkill(pid)

            def replacement():
                got = client.run(_worker_parent, on_error="ignore").values()
                return next((g for g in got if isinstance(g, tuple) and g[0] != pid), None)

            pid2, parent2, torch_there2 = wait_until(replacement, 60, "the replacement")
            assert parent2 == parent and torch_there2, (pid2, parent2, parent)
    finally:
        _stop(procs)

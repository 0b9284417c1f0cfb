"""GPU clusters as Dask users build them, on real worker processes and a real
Coordinator: workers given their GPU through ``CUDA_VISIBLE_DEVICES`` as dask-cuda
gives it (no ``GPU`` resource declared), beside a plain worker started with
``CUDA_VISIBLE_DEVICES=""`` and the ``gpu_pin`` preload. ``members="gpu"`` makes the
GPU workers the members and the plain one their helper; every worker reports the GPU
it was given. On a CPU machine torch sees no device, so the members bind the CPU and
report what they were given; the last test runs on a real ``LocalCUDACluster``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import dask
import numpy as np
import pytest
from distributed import Client, Nanny, Scheduler, SpecCluster

import daskdist as dd
from tests.conftest import child_env, wait_until

pd = pytest.importorskip("pandas")
ddf = pytest.importorskip("dask.dataframe")

pytestmark = pytest.mark.timeout(180)

# dask-cuda's LocalCUDACluster gives its worker 1 on a two-GPU host "1,0"; a MIG
# instance is given by its id. Neither is a device torch sees here (nor, for the MIG id,
# on a host with GPUs), so what the worker reports is what it was given.
ROTATED = "1,0"
MIG = "MIG-4a2c3a7e-1b5d-5f0e-9c3b-2d7e6f1a0b9c"
PARTS, ROWS = 4, 10


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Two dask-cuda-like workers and a plain one (one thread each):
    ``(client, {name: address}, slots directory)``."""
    slots = tmp_path_factory.mktemp("slots")
    # distributed's NVML monitor is off: on a host with one GPU it would look for device 1
    # (dotted keys: a Nanny's config= replaces whole top-level sections)
    config = {"distributed.diagnostics.nvml": False,
              "daskdist.gpu-pin.slots-dir": str(slots)}

    def worker(visible: str, **options) -> dict:
        return {"cls": Nanny, "options": {
            "nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": visible}, "config": config,
            "silence_logs": logging.ERROR, **options}}

    spec = {"cuda-1": worker(ROTATED), "cuda-mig": worker(MIG),
            "plain": worker("", preload=["daskdist.plugins.gpu_pin"])}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
    # Dask's work stealing may move a partition from the helper daskdist prefers (a
    # loose restriction) to an idle member: off, so where partitions run is daskdist's
    with dask.config.set({"distributed.scheduler.work-stealing": False}), \
            SpecCluster(workers=spec, scheduler=scheduler, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(3)
        assert "stealing" not in cluster.scheduler.extensions
        info = client.scheduler_info(n_workers=-1)["workers"]
        yield client, {w["name"]: a for a, w in info.items()}, slots


def made_on(i: int) -> pd.DataFrame:
    """Partition ``i``: its ids and the worker that computed it."""
    try:
        from distributed import get_worker

        where = get_worker().address
    except ValueError:  # Dask computing its meta on the client
        where = ""
    return pd.DataFrame({"id": np.arange(ROWS, dtype=np.int64) + i * ROWS,
                         "made_on": [where] * ROWS})


def take(it):
    """A closure: one batch's ids, the worker it ran on and where its rows were made."""
    try:
        batch = next(it)
    except StopIteration:
        return None
    return {"id": batch["id"].tolist(), "worker": dd.get_worker_context().address,
            "made_on": sorted(set(batch["made_on"]))}


def where_and_device():
    ctx = dd.get_worker_context()
    return ctx.address, str(ctx.device)


def visible():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def reported(member: dict, given: str) -> bool:
    """What a member given ``given`` reports: that, bound to the CPU (as here); bound to
    a GPU (a host that has one), its UUID unless it was given an id."""
    if member["device"] == "cpu":
        return member["gpu"] == given
    return member["gpu"] == given if given.startswith("MIG-") else member["gpu"].startswith(
        "GPU-")


def test_members_gpu_makes_the_gpu_workers_members_and_the_plain_one_their_helper(mixed):
    client, workers, _ = mixed
    gpu_workers = {workers["cuda-1"], workers["cuda-mig"]}
    with dd.Coordinator(client, name="gpu-members", members="gpu") as coord:
        who = wait_until(lambda: (w := coord.members())["helpers"] and len(w["members"]) == 2
                         and w, 60, "two members and a helper")
        assert {m["address"] for m in who["members"]} == gpu_workers
        assert who["helpers"] == [workers["plain"]]
        by_address = {m["address"]: m for m in who["members"]}
        assert reported(by_address[workers["cuda-1"]], "1")  # the first entry: its GPU
        assert reported(by_address[workers["cuda-mig"]], MIG)
        assert coord.status()["workers"] == 2

        # the collective group and gangs: the two GPU workers only
        group = coord.collective_group(timeout=30)
        assert set(group.members) == gpu_workers and group.world_size == 2
        ranks = coord.fetch(coord.schedule_on_all(where_and_device))
        assert {a for a, _ in ranks} == gpu_workers

        # a Dask collection: the members train it, the helper computes its partitions
        frame = ddf.from_map(made_on, range(PARTS))
        ds = coord.distribute_dataset(frame, global_batch_size=2 * ROWS)
        it = iter(ds)
        got, deadline = [], time.monotonic() + 90
        while not ds.progress()["complete"]:
            assert time.monotonic() < deadline, f"the epoch did not complete: {ds.progress()}"
            got += [r for r in coord.fetch([coord.schedule(take, args=(it,))
                                            for _ in range(4)]) if r]
        assert sorted(i for r in got for i in r["id"]) == list(range(PARTS * ROWS))
        assert {r["worker"] for r in got} <= gpu_workers
        assert {w for r in got for w in r["made_on"]} == {workers["plain"]}


def test_every_worker_reports_the_gpu_it_was_given(mixed):
    """Without ``members=`` every worker is a member; each reports the first entry of
    its CUDA_VISIBLE_DEVICES, and the one started with ``""`` has no GPU: ``gpu_pin``
    left it without one (and took no slot)."""
    client, workers, slots = mixed
    assert client.run(visible) == {workers["cuda-1"]: ROTATED, workers["cuda-mig"]: MIG,
                                   workers["plain"]: ""}
    assert list(slots.rglob("*.lock")) == []
    with dd.Coordinator(client, name="everyone") as coord:
        who = wait_until(lambda: len((w := coord.members())["members"]) == 3 and w, 60,
                         "three members")
        assert who["helpers"] == []
        by_address = {m["address"]: m for m in who["members"]}
        plain = by_address[workers["plain"]]
        assert (plain["device"], plain["gpu"]) == ("cpu", "")
        assert reported(by_address[workers["cuda-1"]], "1")
        assert reported(by_address[workers["cuda-mig"]], MIG)
        assert sorted(m["index"] for m in who["members"]) == [0, 1, 2]


def test_a_name_keeps_the_members_its_first_coordinator_chose(mixed):
    """Another Coordinator of the name attaches with the same setting or none, and is
    refused, naming both, with another (the setting's own checks, on client and
    scheduler: tests/test_checks.py)."""
    client, _, _ = mixed
    with dd.Coordinator(client, name="kinds", members="gpu") as coord:
        with dd.Coordinator(client, name="kinds", members="gpu") as same, \
                dd.Coordinator(client, name="kinds") as any_:
            assert same.members() == coord.members() == any_.members()
        with pytest.raises(ValueError, match=r"makes the workers with a GPU its members; "
                                             r"a Coordinator asking for resources="):
            dd.Coordinator(client, name="kinds", resources={"GPU": 1})
    with dd.Coordinator(client, name="all-workers") as coord:
        with pytest.raises(ValueError, match=r"makes every worker its members; a "
                                             r"Coordinator asking for members='gpu'"):
            dd.Coordinator(client, name="all-workers", members="gpu")


def allreduce_ones():
    import torch

    g = dd.collective.get_group()
    t = torch.ones(1, device=g.device)
    g.allreduce(t)
    return g.backend, float(t.item())


@pytest.mark.gpu
def test_a_local_cuda_cluster_makes_each_gpu_a_member_and_refuses_two_on_one():
    """A stock dask-cuda ``LocalCUDACluster`` (one worker per GPU, no resource
    declared): every worker a member on its own GPU, NCCL chosen; a second worker given
    GPU 0 too makes explicit NCCL refused, naming both workers and the GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch sees no GPU here)")
    pytest.importorskip("dask_cuda", reason="needs dask-cuda (pip install dask-cuda)")
    from dask_cuda import LocalCUDACluster

    n = torch.cuda.device_count()
    with LocalCUDACluster(n_workers=n, threads_per_worker=1, dashboard_address=None,
                          silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        client.wait_for_workers(n)
        given = client.run(visible)
        with dd.Coordinator(client, name="cuda", members="gpu") as coord:
            coord.wait_for_workers(n, timeout=120)
            who = coord.members()
            assert who["helpers"] == [] and [m["device"] for m in who["members"]] == [
                "cuda:0"] * n
            ids = [m["gpu"] for m in who["members"]]
            assert all(i.startswith(("GPU-", "MIG-")) for i in ids) and len(set(ids)) == n
            assert coord.collective_group(timeout=60).backend == "nccl"
            assert coord.fetch(coord.schedule_on_all(allreduce_ones)) == [("nccl", n)] * n
            first = next(m for m in who["members"] if m["index"] == 0)
        # a plain `dask worker` given the first member's GPU as well
        extra = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
             "--nthreads", "1", "--no-dashboard"],
            env=child_env(CUDA_VISIBLE_DEVICES=given[first["address"]].split(",")[0]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client.wait_for_workers(n + 1)
            with dd.Coordinator(client, name="cuda-shared", members="gpu") as coord:
                coord.wait_for_workers(n + 1, timeout=120)
                with pytest.raises(dd.CollectiveError) as e:
                    coord.collective_group(backend="nccl", timeout=60)
                msg = str(e.value)
                (newcomer,) = set(client.scheduler_info(n_workers=-1)["workers"]) - set(given)
                assert f"workers {first['address']}, {newcomer} share GPU {first['gpu']}" in msg \
                    or f"workers {newcomer}, {first['address']} share GPU {first['gpu']}" in msg
        finally:
            extra.terminate()
            extra.wait(30)

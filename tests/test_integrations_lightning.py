"""DaskdistStrategy (SPEC §4.4) on real LocalClusters with worker processes and gloo:
Trainer.fit over a "dynamic" dataset trains every row exactly once in the committed
module; a member SIGKILLed mid-fit (3 workers) re-runs fit from the committed
global_step on every rank; a worker that joins mid-fit is taken in at the next commit;
a whole job killed mid-fit is resumed by a new cluster from its newest durable
checkpoint (§4.3), every row once across the two; running the same cell 5 times leaves
worker memory and threads flat."""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from distributed import Client  # noqa: E402

import daskdist as dd  # noqa: E402
from tests.conftest import (  # noqa: E402
    THREADS,
    make_cluster,
    sigkill,
    wait_for_workers,
    wait_until,
)
from tests.framework_rows import (  # noqa: E402
    assert_flat,
    committed_counts,
    complete_checkpoints,
    kill_a_job_past_its_checkpoints,
    read_events,
    rerun_after,
    rss_and_threads,
    write_rows,
)
from tests.lightning_job import BATCH, NAME, SEED, drive, fit, make_module  # noqa: E402
from tests.row_ledger import assert_every_row_once  # noqa: E402

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def _members(coord) -> list[str]:
    return coord._call("daskdist_group_info")["members"]


@pytest.mark.parametrize("threads", THREADS)
def test_fit_over_a_dynamic_dataset_trains_every_row_once(tmp_path, threads):
    n = 1000
    glob = write_rows(tmp_path, n)
    with make_cluster(2, threads=threads) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-once")
        wait_for_workers(client, coord, 2)
        coord.collective_group(timeout=30)
        module = coord.create_per_worker_resource(functools.partial(make_module, n=n))
        ds = coord.distribute_dataset(glob, global_batch_size=40, policy="dynamic",
                                      shuffle=True, seed=1, prefetch=0)
        it = iter(ds)
        runs = drive(coord, ds, module, it, commit_every=3)
        out = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
        steps = [s for s, _ in out]
        assert len(set(steps)) == 1 and steps[0] == runs[-1][0][1] > 0
        assert_every_row_once(out, n)
        assert ds.progress()["acknowledged"] == n
        coord.close()


def test_member_sigkilled_mid_fit_resumes_from_the_committed_step(tmp_path):
    n = 1500
    glob = write_rows(tmp_path, n)
    logdir = tmp_path / "log"
    logdir.mkdir()
    with make_cluster(3) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-kill")
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=30)
        module = coord.create_per_worker_resource(
            functools.partial(make_module, n=n, logdir=str(logdir), pause=0.02))
        ds = coord.distribute_dataset(glob, global_batch_size=30, policy="dynamic",
                                      shuffle=True, seed=2, prefetch=0)
        it = iter(ds)
        killed: list[tuple[float, int]] = []

        def kill_rank0_mid_fit():
            wait_until(lambda: sum(e[1] == "step" for e in read_events(logdir)) > 15,
                       120, "steps")
            addr = _members(coord)[0]  # rank 0: the rank whose state DDP broadcasts
            pid = client.run(os.getpid, workers=[addr])[addr]
            killed.append((time.time(), pid))
            sigkill(pid)

        killer = threading.Thread(target=kill_rank0_mid_fit, daemon=True)
        killer.start()
        drive(coord, ds, module, it)
        killer.join(60)
        assert killed, "the member was not killed"
        t_kill, victim = killed[0]
        committed, rerun = rerun_after(read_events(logdir), t_kill)
        assert len({e[4] for e in rerun}) == rerun[0][5]  # every rank of it started ...
        assert {e[2] for e in rerun} == {rerun[0][2]}  # ... at the same step ...
        assert committed - 1 <= rerun[0][2] <= committed and rerun[0][2] > 0  # ... committed
        assert victim not in {e[6] for e in rerun}
        print(f"killed rank 0 after step {committed}; fit ran again on "
              f"{rerun[0][5]} ranks from global_step {rerun[0][2]}")
        out = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
        assert_every_row_once(out, n)
        coord.close()


@pytest.mark.slow
def test_worker_joining_mid_fit_is_taken_in_at_the_next_commit(tmp_path):
    n = 4000
    glob = write_rows(tmp_path, n)
    logdir = tmp_path / "log"
    logdir.mkdir()
    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-join")
        wait_for_workers(client, coord, 2)
        first = coord.collective_group(timeout=30)
        # steps of 0.06 s: the fit outlasts a worker's start (torch, CUDA) on a fast host
        module = coord.create_per_worker_resource(
            functools.partial(make_module, n=n, logdir=str(logdir), pause=0.06))
        ds = coord.distribute_dataset(glob, global_batch_size=24, policy="dynamic",
                                      shuffle=True, seed=3, prefetch=0)
        it = iter(ds)
        gang = coord.schedule_on_all(fit, args=(module, it, 2))
        wait_until(lambda: any(e[1] == "step" for e in read_events(logdir)), 120, "steps")
        cluster.scale(3)
        coord.fetch(gang)
        events = read_events(logdir)
        grown = [e for e in events if e[1] == "start" and e[5] == 3]
        assert grown, "the newcomer never trained"
        assert all(e[3] > first.generation for e in grown)
        # the 2 members' last step ended in the commit that raised HostsUpdatedInterrupt
        # (before the module's own batch-end hook logged it); the 3 members began there
        last = max(e[2] for e in events if e[1] == "step" and e[5] == 2) + 1
        assert {e[2] for e in grown} == {last}
        assert last % 2 == 0  # commit_every=2: the join waited for a commit
        print(f"joined at the commit of step {last}")
        drive(coord, ds, module, it, commit_every=2)
        out = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
        assert len(out) == 3
        assert_every_row_once(out, n)
        coord.close()


@pytest.mark.slow
def test_sigterm_notice_mid_fit_leaves_at_a_commit(tmp_path):
    """Daskdist's SIGTERM handler (Lightning's own is installed on the main thread
    only): the member leaves at its next commit, nothing counts as lost, every row once."""
    import signal

    import dask

    n = 1500
    glob = write_rows(tmp_path, n)
    logdir = tmp_path / "log"
    logdir.mkdir()
    with dask.config.set({"daskdist.preemption.grace": "20s"}), \
            make_cluster(3) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-sigterm")
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=30)
        module = coord.create_per_worker_resource(
            functools.partial(make_module, n=n, logdir=str(logdir), pause=0.02))
        ds = coord.distribute_dataset(glob, global_batch_size=30, policy="dynamic",
                                      shuffle=True, seed=8, prefetch=0)
        it = iter(ds)
        noticed: list[int] = []

        def notice():
            wait_until(lambda: sum(e[1] == "step" for e in read_events(logdir)) > 15,
                       120, "steps")
            addr = _members(coord)[0]
            pid = client.run(os.getpid, workers=[addr])[addr]
            noticed.append(pid)
            os.kill(pid, signal.SIGTERM)

        t = threading.Thread(target=notice, daemon=True)
        t.start()
        drive(coord, ds, module, it, commit_every=2)
        t.join(60)
        assert noticed
        status = coord.status()
        assert status["workers_lost"] == 0 and status["failed"] == 0, status
        wait_until(lambda: noticed[0] not in client.run(os.getpid).values(), 30,
                   "the notified worker to leave")
        out = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
        assert len(out) == 2
        assert_every_row_once(out, n)
        coord.close()


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_new_cluster_resumes_a_killed_fit_from_its_checkpoint_every_row_once(tmp_path):
    """DaskdistStrategy(checkpoint_to=url, every=N) (SPEC §4.3 through §4.4): a job
    (its scheduler, 3 workers and client, one process group) SIGKILLed mid-fit; a new
    cluster of 2 workers with the same URL and a dataset of the same name resumes fit
    from the newest complete checkpoint (its global_step, > 0, on every rank), and the
    committed module trains every row of the epoch exactly once across the two jobs."""
    n = 1200
    glob = write_rows(tmp_path, n)
    url = tmp_path / "ckpt"
    first_log, second_log = tmp_path / "log1", tmp_path / "log2"
    first_log.mkdir()
    second_log.mkdir()
    kill_a_job_past_its_checkpoints(
        ["tests.lightning_job", str(url), glob, str(n), "3", str(first_log)], url,
        first_log, tmp_path / "job.log")
    newest = complete_checkpoints(url)[-1]
    trained = max(e[2] for e in read_events(first_log) if e[1] == "step")
    assert 0 < newest < trained  # the first job went on past its newest checkpoint

    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-resumed")
        wait_for_workers(client, coord, 2)
        coord.collective_group(timeout=30)
        module = coord.create_per_worker_resource(
            functools.partial(make_module, n=n, logdir=str(second_log)))
        ds = coord.distribute_dataset(glob, global_batch_size=BATCH, policy="dynamic",
                                      shuffle=True, seed=SEED, prefetch=0, name=NAME)
        assert ds.progress()["acknowledged"] == 0  # the ledger comes with the checkpoint
        drive(coord, ds, module, iter(ds), checkpoint_to=str(url))
        committed = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
        assert ds.progress()["acknowledged"] == n
        coord.close()
    first_fit: dict[int, tuple] = {}  # each worker's first fit (events are by time)
    for e in read_events(second_log):
        if e[1] == "start":
            first_fit.setdefault(e[6], e)
    # both ranks of the first fit began at the checkpoint's step (a commit per step:
    # commit k holds global_step k), not at 0
    assert sorted(e[4] for e in first_fit.values()) == [0, 1]
    assert {e[2] for e in first_fit.values()} == {newest}, (newest, first_fit)
    print(f"the first job trained to step {trained} and was killed; the newest complete "
          f"checkpoint held step {newest}; the new cluster's fit began there")
    assert_every_row_once(committed, n)
    assert complete_checkpoints(url)[-1] > newest  # the new job went on checkpointing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fit_with_nccl_on_the_workers_gpu(tmp_path):
    """One worker on its GPU, an NCCL group: the module, the batches and the group's
    calls on cuda:0, every row once (a second GPU is not needed for the device path)."""
    n = 1000
    glob = write_rows(tmp_path, n)
    with make_cluster(1) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-nccl")
        wait_for_workers(client, coord, 1)
        assert coord.collective_group(backend="nccl", timeout=60).backend == "nccl"
        module = coord.create_per_worker_resource(functools.partial(make_module, n=n))
        ds = coord.distribute_dataset(glob, global_batch_size=50, policy="dynamic",
                                      shuffle=True, seed=9)
        drive(coord, ds, module, iter(ds), commit_every=2)
        assert_every_row_once(coord.fetch(coord.schedule_on_all(committed_counts,
                                                                args=(module,))), n)
        coord.close()


def test_running_the_cell_five_times_leaves_memory_and_threads_flat(tmp_path):
    n = 1000
    glob = write_rows(tmp_path, n)
    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-cells")
        wait_for_workers(client, coord, 2)
        coord.collective_group(timeout=30)
        samples = []
        for _ in range(5):  # the notebook cell: a module, a dataset, the driver's loop
            module = coord.create_per_worker_resource(functools.partial(make_module, n=n))
            ds = coord.distribute_dataset(glob, global_batch_size=40, policy="dynamic",
                                          shuffle=True, seed=4)
            it = iter(ds)
            drive(coord, ds, module, it)
            out = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
            assert_every_row_once(out, n)
            del module, ds, it
            samples.append(client.run(rss_and_threads))
        assert_flat(samples)
        coord.close()


@pytest.mark.slow
def test_a_module_sharded_in_configure_model_survives_a_sigkill_every_row_once(tmp_path):
    """A LightningModule that shards itself with FSDP2 in configure_model over a 2-D
    ``self.device_mesh`` (its "data_parallel" dimension): a member SIGKILLed mid-fit,
    the survivors' fit shards a fresh module over the new mesh and resumes from the
    commit; the committed counts hold every row exactly once."""
    from tests import lightning_sharded_job as sj

    n = 1500
    glob = write_rows(tmp_path, n)
    logdir = tmp_path / "log"
    logdir.mkdir()
    with make_cluster(3) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-sharded")
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=30)
        module = coord.create_per_worker_resource(
            functools.partial(sj.make_module, n=n, logdir=str(logdir), pause=0.02))
        ds = coord.distribute_dataset(glob, global_batch_size=30, policy="dynamic",
                                      shuffle=True, seed=2, prefetch=0)
        it = iter(ds)
        killed: list[tuple[float, int]] = []

        def kill_a_member():
            wait_until(lambda: sum(e[1] == "step" for e in read_events(logdir)) > 12,
                       120, "steps")
            addr = _members(coord)[1]
            pid = client.run(os.getpid, workers=[addr])[addr]
            killed.append((time.time(), pid))
            sigkill(pid)

        killer = threading.Thread(target=kill_a_member, daemon=True)
        killer.start()
        runs = []
        end = time.monotonic() + 240
        while not ds.progress()["complete"]:
            assert time.monotonic() < end, ds.progress()
            runs.append(coord.fetch(coord.schedule_on_all(
                sj.fit, args=(module, it, ("data_parallel", "tensor_parallel")))))
        killer.join(60)
        assert killed, "the member was not killed"
        committed, rerun = rerun_after(read_events(logdir), killed[0][0])
        assert {e[2] for e in rerun} == {rerun[0][2]}  # every rank from the same step
        assert committed - 1 <= rerun[0][2] <= committed and rerun[0][2] > 0
        # after the re-formation, configure_model sharded a fresh module (its own record
        # of meshes starts again) over the new mesh: the 2 survivors', or the 3 of a
        # generation the replacement joined before the epoch's end
        assert coord.status()["group_generation"] >= 2
        final = runs[-1]
        assert all(r[2] == [len(final)] for r in final), runs
        out = coord.fetch(coord.schedule_on_all(sj.counts, args=(module,)))
        assert_every_row_once(out, n)
        coord.close()

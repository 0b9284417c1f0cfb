"""ShardedState on real LocalClusters of 4 worker processes (gloo, FSDP2): SIGKILLs,
replacements joining, a lost pair of ring neighbours, and jobs resumed on new clusters
of other sizes, every row of every epoch trained exactly once (tests/sharded_job.py:
a model that counts its rows), each resume compared bit for bit with the commit it
resumed at (parameters and momentum, rebuilt from every rank's logged shard)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from distributed import Client

import daskdist as dd
from tests import sharded_job as job
from tests.conftest import THREADS, make_cluster, sigkill, wait_for_workers, wait_until

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def write_rows(root: Path, n: int = job.N_ROWS) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for f in range(4):
        ids = np.arange(f * n // 4, (f + 1) * n // 4, dtype=np.int64)
        pq.write_table(pa.table({"id": ids}), root / f"p{f}.parquet", row_group_size=48)
    return str(root / "*.parquet")


@pytest.fixture(scope="module", params=THREADS)
def cluster4(request):
    with make_cluster(4, threads=request.param) as cluster, Client(cluster) as client:
        yield cluster, client


@pytest.fixture
def coord(cluster4, request):
    _, client = cluster4
    co = dd.Coordinator(client, name=request.node.name)
    wait_for_workers(client, co, 4, timeout=120)
    co.collective_group(timeout=30)
    yield co
    co.close()


def members(coord) -> list[str]:
    return coord._call("daskdist_group_info")["members"]


def kill_rank(client, coord, rank: int) -> tuple[float, int]:
    """SIGKILL rank ``rank``'s worker; (wall time of the kill: the logs' clock, its pid)."""
    addr = members(coord)[rank]
    pid = client.run(os.getpid, workers=[addr])[addr]
    t = time.time()
    sigkill(pid)
    return t, pid


def check_resumes(logdir: str, earlier: str | None = None) -> list[tuple]:
    """Every resume at a commit equals that commit, bit for bit (all parameters and
    optimizer state), the commit made in this job or in the ``earlier`` one (logged
    there); returns the resumes."""
    seen = job.resumes(logdir)
    for gen, world, commits, _ in seen:
        if commits == 0:
            continue
        resumed = job.whole(logdir, f"resume-g{gen}-s{commits}")
        want = job.committed(logdir, commits, upto=gen)
        if want is None and earlier is not None:
            want = job.committed(earlier, commits, upto=1 << 30)
        assert resumed is not None and want is not None, (gen, commits)
        assert resumed.keys() == want.keys()
        for k in want:
            assert torch.equal(resumed[k], want[k]), (gen, world, commits, k)
    return seen


def every_row(counts: list, times: int) -> None:
    c = np.asarray(counts)
    assert (c == times).all(), (f"rows trained fewer than {times} times: "
                                f"{int((c < times).sum())}, more: {int((c > times).sum())}")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sigkills_reshard_from_memory_and_a_joiner_grows_the_mesh(cluster4, coord, tmp_path):
    """A non-zero rank, then rank 0, SIGKILLed: the survivors go on from the last commit
    from their copies (no checkpoint: storage cannot be read); each replacement joins
    at a commit (3 -> 4 ranks). Epochs run until both kills happened."""
    _, client = cluster4
    logdir = str(tmp_path / "log")
    os.makedirs(logdir)
    state = coord.create_per_worker_resource(job.MakeState())
    ds = coord.distribute_dataset(write_rows(tmp_path / "rows"), global_batch_size=job.BATCH,
                                  policy="dynamic", shuffle=True, seed=3, prefetch=0)
    kills: list[tuple[float, int]] = []
    stop = threading.Event()

    def inject():
        for rank in (2, 0):
            if kills:  # the replacement joined: a group of 4 again, after the kill
                wait_until(lambda: stop.is_set() or any(
                    w == 4 and t > kills[-1][0] for _, w, _, t in job.resumes(logdir)),
                    120, "the replacement joined")
            else:
                wait_until(lambda: stop.is_set() or ds.progress()["acknowledged"] > 240,
                           120, "steps")
            if stop.is_set():
                return
            base = ds.progress()["acknowledged"]
            wait_until(lambda base=base: stop.is_set()
                       or ds.progress()["acknowledged"] > base + 2 * job.BATCH, 120,
                       "two more commits")
            if stop.is_set():
                return
            kills.append(kill_rank(client, coord, rank))

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    epochs = 0
    try:
        # epochs start while the kills are pending (generous: a loaded machine is slow)
        start_by = time.monotonic() + 240
        deadline = start_by + 60
        while epochs == 0 or (injector.is_alive() and time.monotonic() < start_by):
            ds.set_epoch(epochs)
            it = iter(ds)
            while not ds.progress()["complete"]:
                assert time.monotonic() < deadline, ds.progress()
                coord.fetch(coord.schedule_on_all(job.train_rows,
                                                  args=(state, it, logdir, 0.02)))
            epochs += 1
    finally:
        stop.set()
        injector.join(60)
    assert len(kills) == 2, (kills, epochs, job.resumes(logdir), coord.status()["workers"])
    _, counts = coord.fetch(coord.schedule_on_all(job.final_counts, args=(state,)))[0]
    every_row(counts, epochs)
    seen = check_resumes(logdir)
    for t_kill, _ in kills:
        before = job.last_commit_before(logdir, t_kill)
        after = [(w, c) for _, w, c, t in seen if t > t_kill]
        assert after and after[0][1] >= before - 2, (before, after)  # the last commit
    # the first kill lands mid-epoch: the 3 survivors go on at once, then the
    # replacement joins at a commit (the second may land between two gangs, when the
    # replacement can be back before the group re-forms)
    first = [w for _, w, _, t in seen if kills[0][0] < t < kills[1][0]]
    assert first[0] == 3 and 4 in first[1:], (kills, seen)
    assert coord.status()["workers_lost"] >= 2


@pytest.mark.slow
@pytest.mark.parametrize("cluster4", [1], indirect=True)
def test_two_neighbours_lost_fall_back_to_the_checkpoint(cluster4, coord, tmp_path):
    """Ranks 1 and 2 (ring neighbours: rank 1's copy lives on rank 2) SIGKILLed at once:
    shard 1 has no holder left, so the survivors load the newest checkpoint (every rank
    wrote its part), resharded 4 -> 2, and the rows after it are trained again."""
    _, client = cluster4
    logdir = str(tmp_path / "log")
    os.makedirs(logdir)
    url = str(tmp_path / "ckpt")
    state = coord.create_per_worker_resource(job.MakeState(url, every=3))
    ds = coord.distribute_dataset(write_rows(tmp_path / "rows"), global_batch_size=job.BATCH,
                                  policy="dynamic", shuffle=True, seed=3, prefetch=0,
                                  name="train")
    it = iter(ds)
    kills: list[tuple[float, int]] = []

    def inject():
        wait_until(lambda: len(list(Path(url).glob("commit-*/.metadata"))) >= 2
                   or ds.progress()["complete"], 120, "two checkpoints")
        addrs = members(coord)
        pids = client.run(os.getpid, workers=addrs[1:3])
        for a in addrs[1:3]:
            kills.append((time.time(), pids[a]))
            sigkill(pids[a])

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    deadline = time.monotonic() + 200
    while not ds.progress()["complete"]:
        assert time.monotonic() < deadline, ds.progress()
        coord.fetch(coord.schedule_on_all(job.train_rows, args=(state, it, logdir, 0.02)))
    injector.join(60)
    assert len(kills) == 2
    _, counts = coord.fetch(coord.schedule_on_all(job.final_counts, args=(state,)))[0]
    every_row(counts, 1)
    seen = check_resumes(logdir)
    t_kill = max(t for t, _ in kills)
    before = job.last_commit_before(logdir, t_kill)
    (world, commits) = next((w, c) for _, w, c, t in seen if t > t_kill)
    assert world == 2 and commits % 3 == 0 and commits < before, (world, commits, before)


@pytest.mark.slow
@pytest.mark.parametrize("cluster4", [2], indirect=True)
def test_a_job_resumes_on_new_clusters_of_3_then_2_workers_every_row_once(
        cluster4, coord, tmp_path):
    """Part of an epoch on 4 workers, checkpointed; a new cluster of 3 workers resumes
    it (resharded 4 -> 3) and trains some more; a new cluster of 2 resumes that (3 -> 2)
    and ends the epoch: across the three jobs every row is trained exactly once."""
    url = str(tmp_path / "ckpt")
    data = write_rows(tmp_path / "rows")

    def run_job(co, k: int, steps: int) -> list:
        logdir = str(tmp_path / f"log{k}")
        os.makedirs(logdir)
        state = co.create_per_worker_resource(job.MakeState(url, every=2))
        ds = co.distribute_dataset(data, global_batch_size=job.BATCH, policy="dynamic",
                                   shuffle=True, seed=3, prefetch=0, name="train")
        it = iter(ds)
        out = co.fetch(co.schedule_on_all(job.train_rows,
                                          args=(state, it, logdir, 0.0, steps)))
        check_resumes(logdir, str(tmp_path / f"log{k - 1}") if k else None)
        if not steps:
            return [out, co.fetch(co.schedule_on_all(job.final_counts, args=(state,)))[0],
                    ds.progress()]
        newest = max(o[3] + o[4] for o in out)  # the commits made: a checkpoint of it
        wait_until(lambda: any(int(p.parent.name.split("-")[1]) >= newest - 1
                               for p in Path(url).glob("commit-*/.metadata")),
                   60, "the job's last checkpoint")
        return out

    first = run_job(coord, 0, 9)
    assert {o[1] for o in first} == {4}
    coord.close()
    for k, (workers, steps) in enumerate(((3, 9), (2, 0)), start=1):
        with make_cluster(workers, threads=2) as cluster, Client(cluster) as client:
            co = dd.Coordinator(client, name=f"resumed-{workers}")
            wait_for_workers(client, co, workers, timeout=120)
            co.collective_group(timeout=30)
            got = run_job(co, k, steps)
            co.close()
        if steps:
            assert {o[1] for o in got} == {workers} and got[0][3] > 0  # resumed
    out, (commits, counts), progress = got
    assert {o[1] for o in out} == {2} and out[0][3] > 0
    every_row(counts, 1)
    assert progress["acknowledged"] == progress["total"] == job.N_ROWS

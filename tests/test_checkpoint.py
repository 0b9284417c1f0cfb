"""Durable commits (SPEC §4.3): checkpoints that survive the end of the job.

- The whole cluster (scheduler, workers, client: one process group) is SIGKILLed
  mid-epoch; a new cluster with another number of workers creates the same State with
  the same URL and a dataset of the same name, resumes from the newest complete
  checkpoint, and completes the epoch: the committed counts hold every row exactly
  once, although the steps after that checkpoint were trained twice.
- A checkpoint cut off mid-write (no ``.metadata``) is never loaded.
- Pure: the store keeps the newest K, and a write cut off by SIGKILL is ignored.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from distributed import Client, LocalCluster

import daskdist as dd
from daskdist.collective.state.checkpoint import CheckpointStore
from tests.checkpoint_job import BATCH, N_ROWS, MakeCounts, final_counts, train_rows
from tests.conftest import child_env, wait_until

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def write_rows(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for f in range(3):
        ids = np.arange(f * N_ROWS // 3, (f + 1) * N_ROWS // 3, dtype=np.int64)
        pq.write_table(pa.table({"id": ids}), root / f"p{f}.parquet", row_group_size=100)
    return str(root / "*.parquet")


def complete(url: Path) -> list[int]:
    """The commits of the complete checkpoints under ``url`` (DCP's metadata written)."""
    return sorted(int(p.parent.name.split("-")[1]) for p in url.glob("commit-*/.metadata"))


@pytest.mark.slow
def test_a_new_cluster_resumes_a_killed_job_every_row_exactly_once(tmp_path):
    data = write_rows(tmp_path / "shards")
    url = tmp_path / "ckpt"
    env = child_env()
    log = open(tmp_path / "job.log", "w")
    job = subprocess.Popen([sys.executable, "-m", "tests.checkpoint_job", str(url), data, "3"],
                           cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        wait_until(lambda: len(complete(url)) >= 2 or job.poll() is not None, 180,
                   "two complete checkpoints of the first job")
        assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
        os.killpg(job.pid, signal.SIGKILL)  # the whole job: scheduler, workers, client
        job.wait(30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        log.close()
    kept = complete(url)
    assert len(kept) == 2  # checkpoint-keep: the newest 2
    newest = kept[-1]
    # a checkpoint cut off mid-write: a newer directory without DCP's metadata
    cut = url / f"commit-{newest + 100:012d}"
    shutil.copytree(url / f"commit-{newest:012d}", cut)
    (cut / ".metadata").unlink()

    # a new cluster, another number of workers, a new client: the same State and name
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=True,
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        coord = dd.Coordinator(client, name="resumed")
        coord.wait_for_workers(2, timeout=120)
        coord.collective_group(timeout=60)
        state = coord.create_per_worker_resource(MakeCounts(str(url)))
        ds = coord.distribute_dataset(data, global_batch_size=BATCH, policy="dynamic",
                                      shuffle=True, seed=3, prefetch=0, name="train")
        it = iter(ds)
        runs = []
        deadline = time.monotonic() + 150
        while not ds.progress()["complete"]:
            assert time.monotonic() < deadline, ds.progress()
            runs.append(coord.fetch(coord.schedule_on_all(train_rows, args=(state, it))))
        commits, counts = coord.fetch(coord.schedule_on_all(final_counts, args=(state,)))[0]
        p = ds.progress()
        status = coord.status()
        coord.close()
    resumed_at = runs[0][0][0]
    assert resumed_at == newest  # the newest complete checkpoint, not the cut-off one
    c = np.asarray(counts)
    assert (c == 1).all(), (f"rows trained 0 times: {int((c == 0).sum())}, more than "
                            f"once: {int((c > 1).sum())}")
    assert p["acknowledged"] == p["total"] == N_ROWS
    assert commits == newest + sum(steps for run in runs for _, steps in run[:1])
    assert status["group_size"] == 2
    assert complete(url)[-1] >= newest  # it went on checkpointing where it resumed


# -- the store alone ---------------------------------------------------------------------
def _snapshot(seed: int) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), {"step": seed}


def test_the_store_keeps_the_newest_and_loads_what_it_wrote(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for n in (3, 6, 9):
        w = store.write(n, *_snapshot(n), {"ledger": {"train": {"epoch": 0}}}).result()
        assert w.info.commits == n and w.nbytes > 0
    assert [c.commits for c in store.complete()] == [6, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["commit-000000000006",
                                                          "commit-000000000009"]
    model = torch.nn.Linear(64, 8)
    _, extra = store.load(store.latest(), model.state_dict())
    want = _snapshot(9)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want[0].items())
    assert extra["objects"] == {"step": 9} and extra["record"]["commits"] == 9
    assert extra["record"]["ledger"] == {"train": {"epoch": 0}}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(extra["optimizer"])
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"],
                       want[1]["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("failing", [1, 2], ids=["before-the-write", "in-its-step"])
def test_a_write_survives_the_process_group_torn_down_under_it(tmp_path, monkeypatch,
                                                              failing):
    """DCP's logging asks torch.distributed for the default group's backend while a group
    is up, though a ``no_dist`` write needs none; a re-formation on another thread can
    destroy the group in between (a just-in-time checkpoint was lost so, as its member
    left). Here a group is up and its ``failing``-th lookup fails, as in that window (the
    save's own, or its write step's): the write runs once more, completes and loads."""
    import torch.distributed as dist

    own = not dist.is_initialized()  # a group up in this process, as on a member
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        lookup, calls = dist.get_backend, []

        def torn_down_once(group=None):
            calls.append(group)
            if len(calls) == failing:
                raise ValueError("Default process group has not been initialized, please "
                                 "make sure to call init_process_group.")
            return lookup(group)

        monkeypatch.setattr(dist, "get_backend", torn_down_once)
        store = CheckpointStore(str(tmp_path), keep=2)
        w = store.write(3, *_snapshot(3), {"ledger": {}}).result(60)
        assert w.info.commits == 3 and len(calls) > failing
        model = torch.nn.Linear(64, 8)
        _, extra = store.load(store.latest(), model.state_dict())
        assert extra["record"]["commits"] == 3
        assert all(torch.equal(model.state_dict()[k], v) for k, v in _snapshot(3)[0].items())
    finally:
        if own:
            dist.destroy_process_group()


def _write_then_stall(url: str) -> None:  # pragma: no cover - runs in a child process
    """Write commit 1, then commit 2 up to DCP's metadata and stall there (a slow store):
    the test SIGKILLs this process mid-write."""
    from torch.distributed.checkpoint import FileSystemWriter

    store = CheckpointStore(url, keep=10)
    store.write(1, {"w": torch.ones(8)}, None, {}, {}).result()
    finish = FileSystemWriter.finish

    def stall(self, metadata, results):
        print("finishing", flush=True)
        time.sleep(120)
        finish(self, metadata, results)

    FileSystemWriter.finish = stall
    store.write(2, {"w": torch.zeros(8)}, None, {}, {}).result()


@pytest.mark.slow
def test_a_checkpoint_killed_mid_write_is_never_loaded(tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.test_checkpoint import "
            f"_write_then_stall; _write_then_stall({str(tmp_path)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    second = tmp_path / "commit-000000000002"
    try:
        assert proc.stdout.readline().strip() == "finishing"  # its data is written
        assert any(second.iterdir())
        proc.kill()  # SIGKILL mid-write: DCP's metadata never written
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert second.exists() and not (second / ".metadata").exists()
    store = CheckpointStore(str(tmp_path))
    assert [c.commits for c in store.complete()] == [1]
    _, extra = store.load(store.latest(), {"w": torch.zeros(8)})
    assert extra["record"]["commits"] == 1

"""Sixteen worker processes (1 thread each): a dynamic epoch of plain closures
and a gang with elastic commits, each with a member SIGKILLed mid-epoch (its Nanny
replaces it), train every row exactly once."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

import daskdist as dd
from tests.conftest import make_cluster, sigkill, take_rows, wait_for_workers, wait_until
from tests.row_ledger import assert_every_row_once, final_counts, make_counts, train_rows

pytestmark = pytest.mark.timeout(900)

WORKERS = 16
ROWS = 16_000


def _write(root: Path, column: str) -> dd.data.ArrowShards:
    for f in range(8):
        ids = np.arange(f * ROWS // 8, (f + 1) * ROWS // 8, dtype=np.int64)
        pq.write_table(pa.table({column: ids}), root / f"p{f}.parquet", row_group_size=250)
    return dd.data.ArrowShards(str(root / "*.parquet"))


@pytest.fixture(scope="module")
def sixteen():
    with make_cluster(WORKERS, threads=1) as cluster, Client(cluster) as client:
        yield cluster, client


def _kill_when(ds, frac: float, victim_of, done: list) -> threading.Thread:
    """SIGKILL the worker ``victim_of()`` names once ``frac`` of the epoch is
    acknowledged (in a thread; ``done`` gets its pid)."""
    def run():
        deadline = time.monotonic() + 300
        while ds.progress()["acknowledged"] < frac * ROWS and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = victim_of()
        if isinstance(pid, int):
            sigkill(pid)
            done.append(pid)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_dynamic_epoch_on_16_workers_with_a_kill(sixteen, tmp_path):
    cluster, client = sixteen
    coord = dd.Coordinator(client, name="scale16-dynamic")
    try:
        wait_for_workers(client, coord, WORKERS, timeout=300)
        ds = coord.distribute_dataset(_write(tmp_path, "rid"), global_batch_size=960,
                                      policy="dynamic", shuffle=True, seed=1)
        it = iter(ds)
        pids = client.run(os.getpid)
        victim = sorted(pids)[3]
        killed: list = []
        killer = _kill_when(ds, 0.3, lambda: pids[victim], killed)
        seen: Counter = Counter()
        empty = closures = 0
        deadline = time.monotonic() + 400
        while not ds.progress()["complete"]:
            assert time.monotonic() < deadline, ds.progress()
            got = coord.fetch([coord.schedule(take_rows, args=(it, 0.01))
                               for _ in range(2 * WORKERS)])
            closures += len(got)
            empty += sum(not g for g in got)
            seen.update(r for g in got for r in g)
        killer.join(60)
        assert killed, "the kill did not happen"
        assert sorted(seen) == list(range(ROWS)) and set(seen.values()) == {1}
        print(f"16 workers, dynamic epoch with a kill: {closures} closures, "
              f"{empty / closures:.0%} without a batch")
    finally:
        coord.close()


@pytest.mark.slow
def test_gang_with_commits_on_16_workers_with_a_kill(sixteen, tmp_path):
    cluster, client = sixteen
    coord = dd.Coordinator(client, name="scale16-gang")
    try:
        wait_for_workers(client, coord, WORKERS, timeout=300)
        t0 = time.monotonic()
        group = coord.collective_group(backend="gloo", timeout=60)
        print(f"16-worker group formed in {time.monotonic() - t0:.2f} s")
        assert group.world_size == WORKERS
        state = coord.create_per_worker_resource(functools.partial(make_counts, n=ROWS))
        ds = coord.distribute_dataset(_write(tmp_path, "id"), global_batch_size=240,
                                      policy="dynamic", shuffle=True, seed=2, prefetch=0)
        it = iter(ds)

        def rank_pid(rank: int):
            members = coord._call("daskdist_group_info")["members"]
            addr = members[rank] if len(members) > rank else None
            return client.run(os.getpid, workers=[addr], on_error="ignore").get(addr)

        killed: list = []
        killer = _kill_when(ds, 0.3, functools.partial(rank_pid, 5), killed)
        deadline = time.monotonic() + 500
        while not ds.progress()["complete"]:
            assert time.monotonic() < deadline, ds.progress()
            coord.fetch(coord.schedule_on_all(train_rows, args=(state, it, 0.0)))
        killer.join(60)
        assert killed, "the kill did not happen"
        wait_until(lambda: coord.status()["workers"] == WORKERS, 120, "the replacement")
        assert_every_row_once(coord.fetch(coord.schedule_on_all(final_counts, args=(state,))),
                              ROWS)
        p = ds.progress()
        assert p["acknowledged"] == p["total"] == ROWS
    finally:
        coord.close()

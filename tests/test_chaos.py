"""Chaos suite: real worker processes under random faults. Nothing hangs,
nothing is lost, nothing is reported twice.

Faults: SIGKILL of a random worker every 1.5 s (the nanny restarts it) during closures
(1 and 2 threads per worker) and during a dynamic epoch; SIGSTOP of a worker longer
than the lease, then SIGCONT, during a dynamic epoch; a retirement mid-epoch; the
client's connection to the scheduler cut and restored.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter

import dask
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

import daskdist as dd
from tests.conftest import (
    THREADS,
    make_cluster,
    take_rows,
    wait_for_workers,
    wait_until,
    worker_pids,
)

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(90),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]

N_FILES, GROUPS, ROWS = 4, 3, 150  # 1800 rows in 12 row groups
TOTAL = N_FILES * GROUPS * ROWS


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos-shards")
    for f in range(N_FILES):
        ids = np.arange(f * GROUPS * ROWS, (f + 1) * GROUPS * ROWS, dtype=np.int64)
        pq.write_table(pa.table({"rid": ids}), root / f"part-{f}.parquet",
                       row_group_size=ROWS)
    return root


class Killer:
    """SIGKILLs a random live worker every ``every`` seconds until stopped (a thread)."""

    def __init__(self, client, every: float = 1.5, limit: int = 4):
        self.client, self.every, self.limit = client, every, limit
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = random.Random(0)
        while not self._stop.wait(self.every) and len(self.killed) < self.limit:
            pids = sorted(worker_pids(self.client).values())
            if pids:
                pid = rng.choice(pids)
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.killed.append(pid)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def work(i, seconds):
    time.sleep(seconds)
    return i


def drain_epoch(coord, ds, it, seconds=0.0, during=None, max_rounds=600):
    """Closures until the epoch is complete; the rows of completed closures."""
    rows = []
    deadline = time.monotonic() + 70
    for round_ in range(max_rounds):
        rvs = [coord.schedule(take_rows, args=(it, seconds)) for _ in range(6)]
        if during is not None:
            during(round_)
        for rv in rvs:
            rows += rv.fetch(timeout=60)
        if ds.progress()["complete"]:
            return rows
        assert time.monotonic() < deadline, f"epoch not complete: {ds.progress()}"
    raise AssertionError(f"epoch not complete after {max_rounds} rounds: {ds.progress()}")


def check_rows(rows):
    counts = Counter(rows)
    assert sorted(counts) == list(range(TOTAL)), "a row was lost"
    assert set(counts.values()) == {1}, "a row was delivered to two completed closures"


@pytest.mark.parametrize("threads", THREADS)
def test_random_sigkills_during_closures(threads):
    with make_cluster(2, threads=threads) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="chaos-kill", max_worker_failures=20)
        wait_for_workers(client, coord, 2)
        with Killer(client, limit=3) as killer:
            rvs = [coord.schedule(work, args=(i, 0.04)) for i in range(200)]
            coord.join(timeout=70)
        results = [rv.fetch() for rv in rvs]
        assert sorted(results) == list(range(200))  # each once, none lost
        status = coord.status()
        assert status["done"] == 200 and status["failed"] == 0
        assert killer.killed and status["workers_lost"] >= 1
        coord.close()


def test_random_sigkills_during_a_dynamic_epoch(shards_dir):
    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="chaos-epoch", max_worker_failures=20)
        wait_for_workers(client, coord, 2)
        ds = coord.distribute_dataset(str(shards_dir), global_batch_size=60,
                                      policy="dynamic", name="chaos-epoch")
        with Killer(client, limit=3) as killer:
            rows = drain_epoch(coord, ds, iter(ds), seconds=0.05)
        check_rows(rows)
        assert len(killer.killed) >= 1 and coord.status()["failed"] == 0
        coord.close()


LEASE = 2.0


def test_sigstop_longer_than_the_lease_during_a_dynamic_epoch(shards_dir):
    with dask.config.set({"daskdist.liveness.lease-timeout": f"{LEASE}s",
                          "daskdist.liveness.renew-interval": "200ms"}), \
            make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="chaos-stop")
        wait_for_workers(client, coord, 2)
        ds = coord.distribute_dataset(str(shards_dir), global_batch_size=60,
                                      policy="dynamic", name="chaos-stop")
        stopped = []

        def stop_one(round_):
            if round_ == 2:
                pid = sorted(worker_pids(client).values())[0]
                os.kill(pid, signal.SIGSTOP)
                stopped.append((pid, time.monotonic()))
            elif stopped and len(stopped) == 1 and time.monotonic() > stopped[0][1] + 2 * LEASE:
                os.kill(stopped[0][0], signal.SIGCONT)
                stopped.append(None)

        try:
            rows = drain_epoch(coord, ds, iter(ds), seconds=0.05, during=stop_one)
        finally:
            if len(stopped) == 1:
                os.kill(stopped[0][0], signal.SIGCONT)
        check_rows(rows)
        assert coord.status()["lease_expiries"] >= 1
        # the woken worker rejoins as a new session; a new epoch runs on both, exactly once
        wait_until(lambda: coord.status()["workers"] == 2, 30, "the stopped worker back")
        ds.set_epoch(1)
        check_rows(drain_epoch(coord, ds, iter(ds)))
        coord.close()


def test_retirement_during_a_dynamic_epoch(shards_dir):
    with make_cluster(3) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="chaos-retire")
        wait_for_workers(client, coord, 3)
        ds = coord.distribute_dataset(str(shards_dir), global_batch_size=60,
                                      policy="dynamic", name="chaos-retire")

        def retire(round_):
            if round_ == 2:
                worker = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
                client.retire_workers([worker], close_workers=True)

        check_rows(drain_epoch(coord, ds, iter(ds), seconds=0.05, during=retire))
        assert coord.status()["workers"] == 2 and coord.status()["workers_lost"] == 0
        coord.close()


def test_client_connection_cut_and_restored():
    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="chaos-client")
        wait_for_workers(client, coord, 2)
        rvs = [coord.schedule(work, args=(i, 0.02)) for i in range(100)]
        wait_until(lambda: coord.status()["done"] >= 10, 30, "some progress")
        # cut the client's stream to the scheduler (the scheduler sees the client leave;
        # the client reconnects with the same id)
        comm = client.scheduler_comm.comm
        client.loop.add_callback(comm.abort)
        wait_until(lambda: comm.closed(), 10, "the cut")
        wait_until(lambda: client.status == "running" and client.scheduler_comm is not None
                   and not client.scheduler_comm.comm.closed(), 30, "the reconnect")
        rvs += [coord.schedule(work, args=(i, 0.02)) for i in range(100, 150)]
        coord.join(timeout=60)
        assert sorted(rv.fetch() for rv in rvs) == list(range(150))
        assert coord.status()["done"] == 150 and coord.status()["cancelled"] == 0
        coord.close()

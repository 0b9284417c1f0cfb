"""The ``"dynamic"`` policy with several threads per worker, on a real LocalCluster.

The scenario: 3 workers, rounds of 16 closures that each call ``next()`` on the
per-worker iterator, ``join()`` after each round. With 2 threads per worker two closures
share one iterator at once; every round must finish, the epoch must complete, and every
row must be acknowledged exactly once, also when a worker is SIGKILLed mid-epoch.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import THREADS, kill_and_replace, make_cluster, wait_for_workers, wait_until

pytestmark = pytest.mark.timeout(180)

N_FILES, GROUPS, ROWS = 4, 3, 250  # 3000 rows in 12 row groups
TOTAL = N_FILES * GROUPS * ROWS
WORKERS = 3


@pytest.fixture(scope="module", params=THREADS, ids=lambda t: f"threads{t}")
def threads(request):
    return request.param


@pytest.fixture(scope="module")
def cluster(threads):
    with make_cluster(WORKERS, threads=threads) as c:
        yield c


@pytest.fixture
def coord(client, request):
    import daskdist as dd

    co = dd.Coordinator(client, name=request.node.name)
    wait_for_workers(client, co, WORKERS)
    yield co
    co.close()


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads-shards")
    for f in range(N_FILES):
        ids = np.arange(f * GROUPS * ROWS, (f + 1) * GROUPS * ROWS, dtype=np.int64)
        pq.write_table(pa.table({"rid": ids, "x": ids.astype(np.float32)}),
                       root / f"part-{f:02d}.parquet", row_group_size=ROWS)
    return root


def take_rows(it, seconds=0.0):
    """A closure: one batch's row ids; [] when no unleased rows remain right now."""
    try:
        batch = next(it)
    except StopIteration:
        return []
    assert (batch["x"] == batch["rid"].float()).all()
    time.sleep(seconds)  # some work, so closures on one worker overlap
    return batch["rid"].tolist()


def rounds_until_complete(coord, ds, it, seconds=0.0, on_round=None, max_rounds=200):
    """Rounds of 16 closures, ``join()`` after each, until the epoch is complete."""
    rows = []
    for round_ in range(max_rounds):
        rvs = [coord.schedule(take_rows, args=(it, seconds)) for _ in range(16)]
        if on_round is not None:
            on_round(round_)
        coord.join(timeout=60)  # the hang this guards against: closures RUNNING forever
        for rv in rvs:
            rows += rv.fetch()
        if ds.progress()["complete"]:
            return rows, round_ + 1
    raise AssertionError(f"epoch not complete after {max_rounds} rounds: {ds.progress()}")


def test_dynamic_rounds_of_16_closures_finish_exactly_once(coord, client, shards_dir,
                                                           threads):
    # shuffled: the unshuffled path is the same iterator (tests/test_data_threads.py)
    ds = coord.distribute_dataset(str(shards_dir), global_batch_size=75, policy="dynamic",
                                  shuffle=True, seed=threads, name="rounds")
    rows, rounds = rounds_until_complete(coord, ds, iter(ds), seconds=0.002)
    counts = Counter(rows)
    assert sorted(counts) == list(range(TOTAL))
    assert set(counts.values()) == {1}, "a row went to two completed closures"
    p = ds.progress()
    assert p["acknowledged"] == p["total"] == TOTAL and p["leased"] == 0 and p["complete"]
    threads_seen = client.run(lambda dask_worker: dask_worker.state.nthreads)
    assert set(threads_seen.values()) == {threads}


def test_dynamic_exactly_once_with_a_sigkill_at_two_threads(coord, client, shards_dir,
                                                            threads):
    if threads < 2:
        pytest.skip("one thread per worker: tests/test_data_distributed.py covers SIGKILL")
    ds = coord.distribute_dataset(str(shards_dir), global_batch_size=60, policy="dynamic",
                                  name="killed")
    killed = []

    def kill_one(round_):
        if round_ == 2 and not killed:
            pid = sorted(client.run(os.getpid, on_error="ignore").values())[0]
            killed.append(pid)
            kill_and_replace(client, coord, pid, n=WORKERS)

    rows, _ = rounds_until_complete(coord, ds, iter(ds), seconds=0.01, on_round=kill_one)
    assert len(killed) == 1
    counts = Counter(rows)
    assert sorted(counts) == list(range(TOTAL))
    assert set(counts.values()) == {1}, "a row went to two completed closures"
    assert coord.status()["worker_leaves"] >= 1
    wait_until(lambda: ds.progress()["complete"], 10, "the epoch to be complete")
    assert ds.progress()["acknowledged"] == TOTAL

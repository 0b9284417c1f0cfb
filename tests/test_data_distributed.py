"""Per-worker Arrow datasets through the coordinator, and the exactly-once dynamic policy.

Real Parquet files, a real LocalCluster with worker processes, workers SIGKILLed
mid-epoch: the multiset of row ids returned by completed closures must be exactly the
dataset, every row once.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import kill_and_replace, take_rows, wait_until

N_FILES, GROUPS, ROWS = 6, 3, 200  # 3600 rows in 18 row groups


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    rid = 0
    for f in range(N_FILES):
        n = GROUPS * ROWS
        ids = np.arange(rid, rid + n, dtype=np.int64)
        table = pa.table({
            "rid": ids,
            "x": np.random.default_rng(f).standard_normal((n,)).astype(np.float32),
        })
        pq.write_table(table, root / f"part-{f:02d}.parquet", row_group_size=ROWS)
        rid += n
    return root


def drain_epoch(coord, ds, it, seconds=0.0, on_round=None, max_rounds=400):
    """Schedule closures until the epoch is complete; return rows of completed closures."""
    rows = []
    for round_ in range(max_rounds):
        rvs = [coord.schedule(take_rows, args=(it, seconds)) for _ in range(8)]
        if on_round is not None:
            on_round(round_)
        for rv in rvs:
            rows += rv.fetch()
        if ds.progress()["complete"]:
            return rows
    raise AssertionError(f"epoch not complete after {max_rounds} rounds: {ds.progress()}")


def test_static_policy_partitions_rows_across_workers(coord, shards_dir):
    ds = coord.distribute_dataset(str(shards_dir), global_batch_size=64, policy="file")
    it = iter(ds)
    rows = []
    for _ in range(40):  # rounds of closures, until both pipelines ran dry
        got = coord.fetch([coord.schedule(take_rows, args=(it,)) for _ in range(10)])
        rows += [r for batch in got for r in batch]
        if len(rows) >= N_FILES * GROUPS * ROWS:
            break
    counts = Counter(rows)
    assert max(counts.values()) == 1  # no row repeated across pipelines
    assert sorted(counts) == list(range(N_FILES * GROUPS * ROWS))  # and none missing


def test_dynamic_policy_exactly_once_without_faults(coord, shards_dir):
    ds = coord.distribute_dataset(str(shards_dir), global_batch_size=100, policy="dynamic",
                                  name="clean")
    rows = drain_epoch(coord, ds, iter(ds))
    assert sorted(rows) == list(range(N_FILES * GROUPS * ROWS))
    p = ds.progress()
    assert p["acknowledged"] == p["total"] == N_FILES * GROUPS * ROWS and p["complete"]


def test_distribute_dataset_bad_input_named(coord, tmp_path, shards_dir):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        coord.distribute_dataset(str(tmp_path / "nothing-here" / "*.parquet"), 64)
    with pytest.raises(ValueError, match="divisible"):
        coord.distribute_dataset(str(shards_dir), global_batch_size=63)
    for bad in (0, -64, 64.0, "64", None, True):  # on the client, at once, naming it
        with pytest.raises(ValueError, match="global_batch_size"):
            coord.distribute_dataset(str(shards_dir), global_batch_size=bad)
    assert coord.distribute_dataset(str(shards_dir), np.int64(64)).dataset_id  # numpy ints
    with pytest.raises(TypeError, match="global_batch_size"):
        coord.distribute_dataset(str(shards_dir), 64, batch_size=32)


def test_dynamic_policy_exactly_once_with_sigkills(coord, client, shards_dir):
    ds = coord.distribute_dataset(str(shards_dir), global_batch_size=50, policy="dynamic",
                                  name="killed")
    it = iter(ds)
    killed = []

    def kill_some(round_):
        if round_ in (3, 12) and len(killed) < 2:
            pid = sorted(client.run(os.getpid, on_error="ignore").values())[0]
            killed.append(pid)
            kill_and_replace(client, coord, pid)

    rows = drain_epoch(coord, ds, it, seconds=0.01, on_round=kill_some)
    assert len(killed) == 2
    counts = Counter(rows)
    assert sorted(counts) == list(range(N_FILES * GROUPS * ROWS))
    assert set(counts.values()) == {1}, "a row was delivered to two completed closures"
    assert coord.status()["worker_leaves"] >= 2
    wait_until(lambda: ds.progress()["complete"], 10, "the epoch to be complete")

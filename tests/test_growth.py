"""A dataset when the cluster grows, on real LocalClusters of worker
processes with 2 threads each: ``distribute_dataset(global_batch_size=...)`` on 2 workers,
then ``cluster.scale(3)`` mid-epoch. The per-replica batch size is the one fixed when the
dataset was made (the newcomer uses it, even where the global batch does not divide by
3); ``"dynamic"`` takes the newcomer in at once; a static policy keeps its split until
the next ``set_epoch`` (the newcomer's iterator yields nothing until then). Every row
once, in every epoch."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

import daskdist as dd
from tests.conftest import make_cluster, wait_for_workers

pytestmark = pytest.mark.timeout(240)

FILES, ROWS = 6, 1000
TOTAL = FILES * ROWS


@pytest.fixture
def shards(tmp_path):
    for f in range(FILES):
        ids = np.arange(f * ROWS, (f + 1) * ROWS, dtype=np.int64)
        pq.write_table(pa.table({"rid": ids}), tmp_path / f"p{f}.parquet", row_group_size=100)
    return dd.data.ArrowShards(str(tmp_path))


@pytest.fixture
def grown():
    with make_cluster(2, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="grow-data")
        wait_for_workers(client, coord, 2)
        yield cluster, client, coord
        coord.close()


def take(it, seconds: float = 0.05):
    """One batch: the worker's index and the batch's row ids (``[]``: none right now);
    then ``seconds`` of work, so closures overlap and every worker gets some."""
    index = dd.get_worker_context().worker_index
    try:
        rows = next(it)["rid"].tolist()
    except StopIteration:
        return index, []
    time.sleep(seconds)
    return index, rows


def _round(coord, it, n=6) -> list[tuple[int, list[int]]]:
    return coord.fetch([coord.schedule(take, args=(it,)) for _ in range(n)])


def _grow(cluster, client, coord) -> None:
    cluster.scale(3)
    wait_for_workers(client, coord, 3)


def test_dynamic_epoch_completes_after_scale_with_the_batch_size_unchanged(grown, shards):
    cluster, client, coord = grown
    # 256 a replica, 512 % 3 != 0; small leases, so rows are still free when it grows
    ds = coord.distribute_dataset(shards, global_batch_size=512, policy="dynamic",
                                  shuffle=True, seed=2, lease_rows=512, prefetch=0)
    it = iter(ds)
    batches: list[tuple[int, list[int]]] = []
    while ds.progress()["acknowledged"] < TOTAL // 4:
        batches += _round(coord, it)
    _grow(cluster, client, coord)
    deadline = time.monotonic() + 120
    while not ds.progress()["complete"]:
        assert time.monotonic() < deadline, ds.progress()
        batches += _round(coord, it)
    counts = Counter(r for _, rows in batches for r in rows)
    assert sorted(counts) == list(range(TOTAL)) and set(counts.values()) == {1}
    sizes = [len(rows) for _, rows in batches if rows]
    assert max(sizes) == 256 and all(s <= 256 for s in sizes)
    newcomer = [len(rows) for index, rows in batches if index == 2 and rows]
    assert newcomer and max(newcomer) == 256  # it joined the epoch, at the same size


def test_static_split_holds_until_the_next_set_epoch(grown, shards):
    cluster, client, coord = grown
    # 60 a replica; 120 also divides by 3, so without a fixed split the newcomer would
    # read a third of the files from the start and rows would be read twice
    ds = coord.distribute_dataset(shards, global_batch_size=120, policy="file")
    it = iter(ds)
    epoch0 = _round(coord, it, 4)
    _grow(cluster, client, coord)
    deadline = time.monotonic() + 120
    while len({r for _, rows in epoch0 for r in rows}) < TOTAL:
        assert time.monotonic() < deadline, "epoch 0 did not complete"
        epoch0 += _round(coord, it, 9)
    epoch0 += _round(coord, it, 9)  # every iterator exhausted: nothing more comes
    counts = Counter(r for _, rows in epoch0 for r in rows)
    assert sorted(counts) == list(range(TOTAL)) and set(counts.values()) == {1}
    assert all(not rows for index, rows in epoch0 if index == 2), "the newcomer read epoch 0"
    assert {len(rows) for _, rows in epoch0 if rows} <= set(range(1, 61))
    assert max(len(rows) for _, rows in epoch0) == 60

    ds.set_epoch(1)  # re-split over the 3 workers there now
    it = iter(ds)
    epoch1: list[tuple[int, list[int]]] = []
    deadline = time.monotonic() + 120
    while len({r for _, rows in epoch1 for r in rows}) < TOTAL:
        assert time.monotonic() < deadline, "epoch 1 did not complete"
        epoch1 += _round(coord, it, 9)
    epoch1 += _round(coord, it, 9)
    counts = Counter(r for _, rows in epoch1 for r in rows)
    assert sorted(counts) == list(range(TOTAL)) and set(counts.values()) == {1}
    by_worker = {index: {r // ROWS for r in rows} for index, rows in epoch1 if rows}
    read = {}
    for index, rows in epoch1:
        read.setdefault(index, set()).update(r // ROWS for r in rows)
    assert {i: f for i, f in read.items() if f} == {0: {0, 3}, 1: {1, 4}, 2: {2, 5}}, by_worker
    assert max(len(rows) for _, rows in epoch1) == 60

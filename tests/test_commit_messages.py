"""A gang commit reaches the scheduler as one message from rank 0:
the ranks' lease tokens ride the commit's allgather, packed, and rank 0 sends every
rank's part (``daskdist_gang_commit``); a part too large for the slots the ranks agreed
on goes part by part (``daskdist_gang_commit_part``) that once, and the slots grow to
fit the next. Real LocalCluster of 3 worker processes (1 and 2 threads), gloo, a
dynamic epoch trained under State with a commit per step: every row once."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

import daskdist as dd
from tests.conftest import THREADS, make_cluster, wait_for_workers
from tests.row_ledger import assert_every_row_once, final_counts, make_counts, train_rows

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]

N_ROWS = 3000
OPS = ("daskdist_gang_commit", "daskdist_gang_commit_part")


def _count_commit_messages(dask_scheduler) -> None:
    """Count the commit messages the scheduler's handlers receive (the real handlers
    still answer them)."""
    counts = Counter()
    dask_scheduler.daskdist_test_commit_counts = counts
    for op in OPS:
        handler = dask_scheduler.handlers[op]

        @functools.wraps(handler)
        def counted(*args, _handler=handler, _op=op, **kwargs):
            counts[_op] += 1
            return _handler(*args, **kwargs)

        dask_scheduler.handlers[op] = counted


def _commit_counts(dask_scheduler) -> dict:
    return dict(dask_scheduler.daskdist_test_commit_counts)


def _write_rows(root: Path) -> dd.data.ArrowShards:
    for f in range(3):
        ids = np.arange(f * N_ROWS // 3, (f + 1) * N_ROWS // 3, dtype=np.int64)
        pq.write_table(pa.table({"id": ids}), root / f"p{f}.parquet", row_group_size=100)
    return dd.data.ArrowShards(str(root / "*.parquet"))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("threads", THREADS)
def test_a_commit_step_is_one_message_from_rank_0(threads, shuffle, tmp_path):
    shards = _write_rows(tmp_path)
    with make_cluster(3, threads=threads) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="commits")
        wait_for_workers(client, coord, 3)
        client.run_on_scheduler(_count_commit_messages)
        coord.collective_group(timeout=30)
        state = coord.create_per_worker_resource(functools.partial(make_counts, n=N_ROWS))
        ds = coord.distribute_dataset(shards, global_batch_size=60, policy="dynamic",
                                      shuffle=shuffle, seed=5, prefetch=0)
        it = iter(ds)
        steps = gangs = 0
        while not ds.progress()["complete"]:  # a gang ends when a rank's rows run out
            out = coord.fetch(coord.schedule_on_all(train_rows, args=(state, it)))
            assert all(o[1] == out[0][1] for o in out)
            steps += out[0][1]
            gangs += 1
            assert gangs <= 10, ds.progress()
        assert steps >= N_ROWS // 60
        counts = client.run_on_scheduler(_commit_counts)
        one, parts = counts.get(OPS[0], 0), counts.get(OPS[1], 0)
        if shuffle:
            # 20 shuffled rows a rank and step: ~20 intervals, over the first commit's 8
            # slots: that commit (and any whose part outgrew the slots) goes part by
            # part, every later one in one message
            assert parts % 3 == 0 and 3 <= parts <= 3 * 3 * gangs, counts
            assert one + parts // 3 == steps, counts
        else:
            # a rank's 20 rows are one or two intervals of its lease: always one message
            assert (one, parts) == (steps, 0), counts
        assert_every_row_once(coord.fetch(coord.schedule_on_all(final_counts, args=(state,))),
                              N_ROWS)
        p = ds.progress()
        assert p["acknowledged"] == p["total"] == N_ROWS
        coord.close()

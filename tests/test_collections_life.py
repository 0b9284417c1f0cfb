"""A Dask collection's dataset over its life on real LocalClusters (worker processes, 2
threads per worker): resumed from ``state_dict`` without recomputing the partitions it
trained, and what is left on the cluster (futures, keys, threads) once its epochs end,
its handle is dropped or its coordinator closes with computes in flight."""

from __future__ import annotations

import functools
import os
import time
from collections import Counter

import numpy as np
import pytest

pd = pytest.importorskip("pandas")
ddf = pytest.importorskip("dask.dataframe")

import daskdist as dd  # noqa: E402
from daskdist.core.partitions import STRIDE  # noqa: E402
from tests.conftest import make_cluster, wait_for_workers, wait_until  # noqa: E402

THREADS = 2
PARTS, ROWS = 12, 40


def counted_part(i: int, log: str, rows: int = ROWS, pause: float = 0.0) -> pd.DataFrame:
    """Partition ``i`` (ids ``i*rows ..``); a worker computing it appends ``i`` to
    ``log`` (Dask computing its meta on the client does not count)."""
    try:
        from distributed import get_worker

        get_worker()
        with open(log, "a") as f:
            f.write(f"{i}\n")
    except ValueError:
        pass
    if pause:
        time.sleep(pause)
    return pd.DataFrame({"id": np.arange(rows, dtype=np.int64) + i * rows,
                         "x": np.full(rows, float(i), dtype=np.float32)})


def counted_frame(log: str, parts: int = PARTS, pause: float = 0.0):
    return ddf.from_map(functools.partial(counted_part, log=log, pause=pause), range(parts))


def computed(log: str) -> list[int]:
    """The partitions computed so far, in order (with repeats)."""
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [int(line) for line in f if line.strip()]


def take_ids(it):
    try:
        b = next(it)
    except StopIteration:
        return None
    return b["id"].tolist()


def busy(client) -> list[str]:
    """Keys the scheduler still knows in any state but released or forgotten."""
    def keys(dask_scheduler):
        return [str(k) for k, ts in dask_scheduler.tasks.items()
                if ts.state not in ("released", "forgotten")]

    return client.run_on_scheduler(keys)


@pytest.fixture(scope="module")
def cluster2():
    from distributed import Client

    with make_cluster(2, threads=THREADS) as cluster, Client(cluster) as client:
        yield cluster, client


def fully_acknowledged(state: dict) -> set[int]:
    """Partitions whose every row the ledger acknowledges (from its learned lengths)."""
    lengths = []
    for n, k in state["lengths"]:
        lengths += [n] * k
    acked = [tuple(iv) for iv in state["acknowledged"]]
    done = set()
    for u, n in enumerate(lengths):
        if n < 0:
            continue
        a, b = u * STRIDE, u * STRIDE + n
        if n == 0 or any(lo <= a and b <= hi for lo, hi in acked):
            done.add(u)
    return done


def test_a_resumed_epoch_computes_only_the_partitions_it_still_has_to_train(cluster2,
                                                                              tmp_path):
    _, client = cluster2
    log = str(tmp_path / "computed.log")
    frame = counted_frame(log)
    first = dd.Coordinator(client, name="resume-first")
    wait_for_workers(client, first, 2)
    ds = first.distribute_dataset(frame, global_batch_size=2 * ROWS, name="resumed")
    it = iter(ds)
    trained: list[int] = []
    deadline = time.monotonic() + 120
    while ds.progress()["acknowledged"] < PARTS * ROWS // 2:
        assert time.monotonic() < deadline, ds.progress()
        trained += [i for r in first.fetch([first.schedule(take_ids, args=(it,))
                                            for _ in range(2)]) if r for i in r]
    state = ds.state_dict()
    done = fully_acknowledged(state)
    assert len(done) >= PARTS // 2 - 2, state
    # the first job goes: its loaders stop, Dask forgets what they computed ahead
    first.close()
    del ds, it
    wait_until(lambda: not busy(client), 60, "the first job's partitions to go")
    before = len(computed(log))

    second = dd.Coordinator(client, name="resume-second")
    wait_for_workers(client, second, 2)
    ds2 = second.distribute_dataset(frame, global_batch_size=2 * ROWS, name="resumed")
    ds2.load_state_dict(state)
    p = ds2.progress()
    assert p["units_known"] >= len(done) and p["acknowledged"] == len(trained)
    it2 = iter(ds2)
    deadline = time.monotonic() + 120
    while not ds2.progress()["complete"]:
        assert time.monotonic() < deadline, ds2.progress()
        trained += [i for r in second.fetch([second.schedule(take_ids, args=(it2,))
                                             for _ in range(4)]) if r for i in r]
    again = computed(log)[before:]
    print(f"partitions trained before the resume: {sorted(done)}; computed after it: "
          f"{sorted(Counter(again).items())}")
    assert not done & set(again), "a partition trained before the resume was recomputed"
    assert set(again) == set(range(PARTS)) - done  # the rest, each computed
    ids = Counter(trained)
    assert sorted(ids) == list(range(PARTS * ROWS)) and set(ids.values()) == {1}
    second.close()

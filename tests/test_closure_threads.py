"""Rows taken by a thread that a closure started, on a real LocalCluster
of 2 worker processes with 2 threads each and a ``"dynamic"`` dataset: a thread started
in the closure's context counts for the closure; a plain thread, or one that goes on
after its closure returned, gets a clear error naming it and its rows go back to the
pool. Never stranded: every epoch completes with every row acknowledged exactly once."""

from __future__ import annotations

import contextvars
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import daskdist as dd
from tests.conftest import make_cluster, wait_for_workers, wait_until

pytestmark = pytest.mark.timeout(180)

TOTAL = 2000


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("closure-threads")
    for f in range(4):
        ids = np.arange(f * TOTAL // 4, (f + 1) * TOTAL // 4, dtype=np.int64)
        pq.write_table(pa.table({"rid": ids}), root / f"p{f}.parquet", row_group_size=100)
    return dd.data.ArrowShards(str(root))


@pytest.fixture(scope="module")
def coord():
    from distributed import Client

    with make_cluster(2, threads=2) as cluster, Client(cluster) as client:
        co = dd.Coordinator(client, name="closure-threads")
        wait_for_workers(client, co, 2)
        yield co
        co.close()


def _take(it, out: list) -> None:
    try:
        out.append(next(it)["rid"].tolist())
    except StopIteration:
        out.append([])
    except RuntimeError as e:
        out.append(str(e))


def in_context(it):
    """A prefetch thread started in the closure's context: its batch counts for us."""
    out: list = []
    t = threading.Thread(target=contextvars.copy_context().run, args=(_take, it, out),
                         name="prefetch-in-context")
    t.start()
    t.join()
    return out[0]


def plain_thread(it):
    """A plain thread: it runs no closure, so its batch is refused and given back."""
    out: list = []
    t = threading.Thread(target=_take, args=(it, out), name="plain-prefetch")
    t.start()
    t.join()
    return out[0]


def outliving(it, path: str):
    """A thread in our context that goes on taking batches after we return: those taken
    before our end count for us; the first one after it is refused (written down)."""
    def run():
        taken = []
        while True:
            try:
                batch = next(it)
            except StopIteration:
                time.sleep(0.01)
                continue
            except RuntimeError as e:
                Path(path).write_text(f"{threading.current_thread().name}\n{e}")
                return
            taken.append(batch["rid"].tolist())

    threading.Thread(target=contextvars.copy_context().run, args=(run,),
                     name="outliving-prefetch", daemon=True).start()
    return "started"


def take(it):
    try:
        return next(it)["rid"].tolist()
    except StopIteration:
        return []


def _drain(coord, ds, it, fn, counts: Counter) -> None:
    deadline = time.monotonic() + 120
    while not ds.progress()["complete"]:
        assert time.monotonic() < deadline, ds.progress()
        for rows in coord.fetch([coord.schedule(fn, args=(it,)) for _ in range(4)]):
            counts.update(rows)


def test_a_thread_started_in_the_closures_context_counts_for_it(coord, shards):
    ds = coord.distribute_dataset(shards, global_batch_size=100, policy="dynamic")
    counts: Counter = Counter()
    _drain(coord, ds, iter(ds), in_context, counts)
    assert sorted(counts) == list(range(TOTAL)) and set(counts.values()) == {1}
    p = ds.progress()
    assert p["acknowledged"] == TOTAL and p["leased"] == 0


def test_a_plain_thread_is_refused_by_name_and_its_rows_go_back(coord, shards):
    ds = coord.distribute_dataset(shards, global_batch_size=100, policy="dynamic")
    it = iter(ds)
    refusals = coord.fetch([coord.schedule(plain_thread, args=(it,)) for _ in range(4)])
    for text in refusals:
        assert isinstance(text, str), text
        assert "'plain-prefetch'" in text and "runs no daskdist closure" in text, text
        assert "copy_context" in text
    assert ds.progress()["acknowledged"] == 0
    counts: Counter = Counter()
    # the refused rows went back to the pool: the epoch completes (stranded rows, leased
    # to a session and never acknowledged, would keep it from completing)
    _drain(coord, ds, it, take, counts)
    assert sorted(counts) == list(range(TOTAL)) and set(counts.values()) == {1}


def test_a_thread_outliving_its_closure_is_refused_and_nothing_is_stranded(coord, shards,
                                                                           tmp_path):
    ds = coord.distribute_dataset(shards, global_batch_size=100, policy="dynamic")
    it = iter(ds)
    note = tmp_path / "refused.txt"
    assert coord.fetch(coord.schedule(outliving, args=(it, str(note)))) == "started"
    wait_until(note.exists, 60, "the outliving thread refused")
    name, text = note.read_text().split("\n", 1)
    assert name == "outliving-prefetch" and "'outliving-prefetch'" in text
    assert "after the closure it was started in ended" in text
    counts: Counter = Counter()
    _drain(coord, ds, it, take, counts)
    # rows the thread took while its closure ran were acknowledged with the closure's
    # result; the rest (its refused batch included) reached our closures: each row once
    p = ds.progress()
    assert p["acknowledged"] == TOTAL and p["leased"] == 0
    assert set(counts.values()) <= {1} and len(counts) <= TOTAL

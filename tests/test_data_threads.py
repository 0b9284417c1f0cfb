"""One loader iterator driven from several plain threads (no Dask): every row delivered
exactly once, each batch's rows recorded to the thread that got it, nothing hangs, and
close() from another thread ends the callers that wait."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from daskdist.data import ArrowLoader, ArrowShards, InputContext, LocalLeaseService
from daskdist.session.scope import ClosureScope, closure_scope
from tests.tables import check_leases

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
]

TOTAL = 3000


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads")
    for f in range(4):
        ids = np.arange(f * 750, (f + 1) * 750, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": ids.astype(np.float32) / 2,
                                 "y": ids.astype(np.float32) * 2}),
                       root / f"p{f}.parquet", row_group_size=100)
    return ArrowShards(root)


def run_threads(n, body):
    """Run ``body(i)`` in ``n`` threads; re-raise the first error; every thread joined."""
    errors = []

    def target(i):
        try:
            body(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts), "a consumer thread hung"
    if errors:
        raise errors[0]


def check_batch(b):
    assert len(b["id"]) and (b["x"] == b["id"].float() / 2).all()
    assert (b["y"] == b["id"].float() * 2).all()


@pytest.mark.parametrize("n_threads", [2, 4])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_static_policy_each_row_once_across_threads(shards, n_threads, shuffle, prefetch):
    ld = ArrowLoader(shards, batch_size=64, shuffle=shuffle, seed=3, prefetch=prefetch,
                     shuffle_buffer=300)
    it = iter(ld)
    got = [[] for _ in range(n_threads)]

    def consume(i):
        for b in it:
            check_batch(b)
            got[i].extend(b["id"].tolist())
        with pytest.raises(StopIteration):  # the end stays the end
            next(it)

    run_threads(n_threads, consume)
    counts = Counter(r for g in got for r in g)
    assert sorted(counts) == list(range(TOTAL)) and set(counts.values()) == {1}
    assert sum(1 for g in got if g) >= 1
    assert ld.state_dict()["position"] == TOTAL


def closure(it, tokens):
    """``next(it)`` as a closure runs it: tokens recorded in this thread go to ``tokens``."""
    with closure_scope(ClosureScope(tokens=tokens)):
        return next(it)


def rows_of(tokens):
    return sorted(i for tok in tokens for a, b in tok[3] for i in range(a, b))


@pytest.mark.parametrize("n_threads", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_dynamic_policy_rows_recorded_to_the_caller(shards, n_threads, shuffle, prefetch):
    svc = LocalLeaseService()
    ld = ArrowLoader(shards, InputContext(services=svc), batch_size=50, policy="dynamic",
                     shuffle=shuffle, seed=1, prefetch=prefetch)
    it = iter(ld)
    got = [[] for _ in range(n_threads)]

    def consume(i):
        while True:
            tokens = []
            try:
                b = closure(it, tokens)
            except StopIteration:
                assert tokens == []
                return
            check_batch(b)
            ids = sorted(b["id"].tolist())
            assert rows_of(tokens) == ids  # this thread's closure recorded this batch
            assert svc.ack_tokens(tokens)
            got[i].extend(ids)

    run_threads(n_threads, consume)
    counts = Counter(r for g in got for r in g)
    assert sorted(counts) == list(range(TOTAL)) and set(counts.values()) == {1}
    p = ld.progress()
    assert p["complete"] and p["acknowledged"] == TOTAL and p["leased"] == 0
    check_leases(svc.table)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_dynamic_next_after_stop_picks_up_returned_rows_from_threads(shards, prefetch):
    """Closures fail now and then (their rows go back to the pool); the threads keep
    calling next() until the epoch is complete, also after StopIteration."""
    svc = LocalLeaseService()
    ld = ArrowLoader(shards, InputContext(services=svc), batch_size=64, policy="dynamic",
                     shuffle=True, seed=2, prefetch=prefetch)
    it = iter(ld)
    acked = Counter()
    failed = Counter()
    lock = threading.Lock()
    rng = np.random.default_rng(0)
    deadline = time.monotonic() + 30

    def consume(i):
        stops = 0
        while not ld.progress()["complete"]:
            assert time.monotonic() < deadline, f"epoch not complete: {ld.progress()}"
            tokens = []
            try:
                b = closure(it, tokens)
            except StopIteration:
                stops += 1
                time.sleep(0.001)  # another thread holds an unacked batch; poll again
                continue
            ids = b["id"].tolist()
            with lock:
                fail = rng.random() < 0.2 and failed[ids[0]] == 0
                if fail:
                    failed.update(ids)
            if fail:
                assert svc.release_tokens(tokens) == len(ids)
            else:
                assert svc.ack_tokens(tokens)
                with lock:
                    acked.update(ids)

    run_threads(3, consume)
    assert sorted(acked) == list(range(TOTAL)) and set(acked.values()) == {1}
    assert sum(failed.values()) > 0  # some rows did come back and were served again
    check_leases(svc.table)


class GatedLeases(LocalLeaseService):
    """A lease service whose acquire waits for ``gate`` after the first ``free`` leases
    (a slow scheduler), so consumers wait for blocks that do not come."""

    def __init__(self, free):
        super().__init__()
        self.gate = threading.Event()
        self.free = free
        self.calls = 0

    def acquire(self, dataset_id, epoch, rows, least=1, rate=None):
        self.calls += 1
        if self.calls > self.free:
            assert self.gate.wait(30), "gate never opened"
        return super().acquire(dataset_id, epoch, rows, least, rate)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_from_another_thread_ends_waiting_consumers(shards, prefetch):
    svc = GatedLeases(free=1)
    ld = ArrowLoader(shards, InputContext(services=svc), batch_size=40, policy="dynamic",
                     prefetch=prefetch, lease_rows=1)  # a lease: 2 batches, in one unit
    it = iter(ld)
    first = closure(it, [])  # one unit (100 rows) leased, 40 delivered
    assert len(first["id"]) == 40
    ended = []
    counted = threading.Semaphore(0)

    def consume(i):
        try:
            while True:
                closure(it, [])
        except StopIteration:
            ended.append(i)
        finally:
            counted.release()

    consumers = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(3)]
    for t in consumers:
        t.start()
    # the unit's other 60 rows go, then every consumer waits for the gated lease
    deadline = time.monotonic() + 30
    while svc.calls < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert svc.calls == 2
    closer = threading.Thread(target=it.close, daemon=True)
    closer.start()
    if prefetch:  # consumers wait on the buffer: close() ends their wait at once
        for _ in consumers:
            assert counted.acquire(timeout=30), "a consumer still waits after close()"
        assert sorted(ended) == [0, 1, 2]
    svc.gate.set()  # the producer (or the inline read) may now return from the RPC
    closer.join(30)
    assert not closer.is_alive(), "close() did not return"
    for t in consumers:
        t.join(30)
        assert not t.is_alive()
    assert sorted(ended) == [0, 1, 2]
    p = ld.progress()
    assert p["leased"] == 100  # delivered, never acked: the test's closures did not ack
    with pytest.raises(StopIteration):
        next(it)

"""The dynamic policy in one process: loaders lease units from a shared LeaseTable,
closures record their batches' rows, completed closures ack, failed ones release, lost
workers are dropped; every row is delivered to exactly one completed closure."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from daskdist.context import ClosureScope, closure_scope
from daskdist.core.leases import LeaseTable
from daskdist.data import ArrowLoader, ArrowShards, InputContext, LocalLeaseService

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

TOTAL = 1500


@pytest.fixture
def shards(tmp_path):
    for f in range(3):
        ids = np.arange(f * 500, (f + 1) * 500, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": ids.astype(np.float32)}),
                       tmp_path / f"p{f}.parquet", row_group_size=90)
    return ArrowShards(tmp_path)


def closure(it):
    """Run ``next(it)`` as a closure would: tokens recorded in this thread come back."""
    with closure_scope(ClosureScope()) as scope:
        batch = next(it, None)
    return batch, scope.tokens


def rows_of(tokens):
    return sorted(i for tok in tokens for a, b in tok[3] for i in range(a, b))


def make(shards, svc, n=1, i=0, **kw):
    ctx = InputContext(num_input_pipelines=n, input_pipeline_id=i, leases=svc)
    kw.setdefault("batch_size", 64)
    return ArrowLoader(shards, ctx, policy="dynamic", **kw)


def test_single_worker_drains_the_epoch(shards):
    svc = LocalLeaseService()
    ld = make(shards, svc, shuffle=True, seed=1)
    it = iter(ld)
    delivered = []
    while True:
        batch, tokens = closure(it)
        if batch is None:
            break
        ids = sorted(batch["id"].tolist())
        assert len(tokens) == 1 and tokens[0][:3] == ("lease", ld.dataset_id, 0)
        assert rows_of(tokens) == ids  # the token names exactly the batch's rows
        assert len(tokens[0][3]) <= 64 // 4 + 3  # a few runs (tiles), not one per row
        assert svc.ack_tokens(tokens)
        delivered.extend(ids)
    assert sorted(delivered) == list(range(TOTAL))
    assert delivered != sorted(delivered)  # shuffled
    p = ld.progress()
    assert p["complete"] and p["acknowledged"] == TOTAL and p["leased"] == 0
    svc.table.check()


def test_next_after_stop_iteration_picks_up_released_rows(shards):
    svc = LocalLeaseService()
    ld = make(shards, svc, batch_size=100, prefetch=0)
    it = iter(ld)
    first, failed = closure(it)
    batches = [closure(it) for _ in range(40)]
    assert batches[-1][0] is None  # nothing free right now
    for _b, toks in batches[:-1]:
        assert svc.ack_tokens(toks)
    assert not ld.progress()["complete"]
    assert svc.release_tokens(failed) == 100  # the first closure failed
    again, toks = closure(it)  # the same iterator serves the returned rows
    assert sorted(again["id"].tolist()) == sorted(first["id"].tolist())
    assert svc.ack_tokens(toks) and ld.progress()["complete"]
    assert closure(it)[0] is None


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("kills", [1, 2])
def test_exactly_once_with_workers_lost_mid_epoch(shards, seed, kills):
    """Three workers take closures in random order; ``kills`` of them are lost mid-epoch
    with closures in flight (never acked) and prefetched leases; replacements join.
    The multiset of rows returned by completed closures is exactly the dataset."""
    rng = random.Random(seed)
    table = LeaseTable()
    base = LocalLeaseService(table, "w0")
    workers = {}

    def join(name):
        svc = base.for_session(name)
        ld = make(shards, svc, n=3, i=len(workers) % 3, shuffle=seed % 2 == 0, seed=seed,
                  batch_size=rng.choice([32, 64, 100]), prefetch=rng.choice([0, 1, 2]))
        workers[name] = (svc, ld, iter(ld))

    for w in range(3):
        join(f"w{w}")
    completed = Counter()
    in_flight = []
    step = 0
    kill_at = sorted(rng.sample(range(3, 18), kills))
    next_name = 3
    while not base.progress(shards_id(workers), 0)["complete"]:
        step += 1
        assert step < 2000, "epoch never completed"
        name = rng.choice(sorted(workers))
        svc, ld, it = workers[name]
        batch, tokens = closure(it)
        if batch is not None:
            if rng.random() < 0.1:
                assert svc.release_tokens(tokens) == len(batch["id"])  # user error
            elif rng.random() < 0.3:
                in_flight.append((name, batch, tokens))  # result not back yet
            else:
                assert svc.ack_tokens(tokens)
                completed.update(batch["id"].tolist())
        if kill_at and step >= kill_at[0]:
            kill_at.pop(0)
            victim = rng.choice(sorted(workers))
            vsvc, vld, _ = workers.pop(victim)
            vsvc.drop_session()  # the scheduler saw the worker leave
            vld.close()
            join(f"w{next_name}")
            next_name += 1
        # some in-flight closures complete; a dead worker's results are fenced off
        still = []
        for iname, ibatch, itoks in in_flight:
            if rng.random() < 0.5:
                ok = base.for_session(iname).ack_tokens(itoks)
                assert ok == (iname in workers)
                if ok:
                    completed.update(ibatch["id"].tolist())
            elif iname in workers:
                still.append((iname, ibatch, itoks))
        in_flight = still
        table.check()
    assert sorted(completed) == list(range(TOTAL))
    assert set(completed.values()) == {1}
    for _svc, ld, _it in workers.values():
        ld.close()


def shards_id(workers):
    return next(iter(workers.values()))[1].dataset_id


def test_faster_workers_take_more_units(shards):
    base = LocalLeaseService(session="fast")
    fast = iter(make(shards, base, prefetch=0))
    slow = iter(make(shards, base.for_session("slow"), prefetch=0))
    counts = Counter()
    while True:
        progressed = False
        for _ in range(3):  # the fast worker runs three closures per slow one
            batch, toks = closure(fast)
            if batch is not None:
                base.ack_tokens(toks)
                counts["fast"] += len(batch["id"])
                progressed = True
        batch, toks = closure(slow)
        if batch is not None:
            base.for_session("slow").ack_tokens(toks)
            counts["slow"] += len(batch["id"])
            progressed = True
        if not progressed:
            break
    assert counts["fast"] + counts["slow"] == TOTAL
    assert counts["fast"] > 2 * counts["slow"]


def test_close_gives_back_prefetched_rows(shards):
    svc = LocalLeaseService()
    ld = make(shards, svc, prefetch=4)
    it = iter(ld)
    batch, toks = closure(it)
    assert svc.ack_tokens(toks)
    ld.close()
    p = ld.progress()
    assert p["leased"] == 0 and p["acknowledged"] == len(batch["id"])
    assert p["free"] == TOTAL - len(batch["id"])


def test_dynamic_configuration_errors(shards):
    with pytest.raises(ValueError, match="lease service"):
        ArrowLoader(shards, InputContext(), policy="dynamic")
    with pytest.raises(ValueError, match="drop_last"):
        make(shards, LocalLeaseService(), drop_last=True)
    ld = make(shards, LocalLeaseService())
    with pytest.raises(TypeError):
        len(ld)
    assert ld.state_dict()["position"] == 0
    svc = LocalLeaseService()
    ld1 = make(shards, svc)
    ld1.set_epoch(1)
    ids = [i for b in ld1 for i in b["id"].tolist()]
    assert sorted(ids) == list(range(TOTAL))
    assert svc.progress(ld1.dataset_id, 1)["leased"] == TOTAL  # no closure acked them
    assert not svc.progress(ld1.dataset_id, 0)["known"]

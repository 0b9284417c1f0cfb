"""The dynamic policy in one process: loaders lease units from a shared LeaseTable,
closures record their batches' rows, completed closures ack, failed ones release, lost
workers are dropped; every row is delivered to exactly one completed closure."""

from __future__ import annotations

import random
import time
from collections import Counter

import dask
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from daskdist.core.leases.table import LeaseTable
from daskdist.data import ArrowLoader, ArrowShards, InputContext, LocalLeaseService
from daskdist.errors import InputError
from daskdist.session.scope import ClosureScope, closure_scope
from tests.tables import check_leases

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


def make(shards, svc, n=1, i=0, dataset_id="ds", **kw):
    """A dynamic loader of pipeline ``i`` of ``n``: loaders made with one ``dataset_id``
    are the workers' loaders of one dataset (as a coordinator's workers build them)."""
    ctx = InputContext(num_input_pipelines=n, input_pipeline_id=i, services=svc,
                       dataset_id=dataset_id)
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
    check_leases(svc.table)


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
        check_leases(table)
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
    p = svc.progress(ld1.dataset_id, 0)
    assert p["known"] and p["free"] == TOTAL and p["leased"] == 0
    with pytest.raises(ValueError, match="lease_rows"):
        make(shards, LocalLeaseService(), lease_rows=0)


class CountingLeases(LocalLeaseService):
    """Counts lease RPCs and the rows each covered; ``asks``: per ask (when the loader
    makes it; the lease is made when its result is asked for), the rows and the pace
    asked with, and the rows leased and not yet taken by the test then (``taken``: what
    the test's consumer counts)."""

    def __init__(self):
        super().__init__()
        self.leases = []
        self.asks = []
        self.taken = 0
        self.leased = 0

    def acquire_async(self, dataset_id, epoch, rows, least=1, rate=None):
        self.asks.append((rows, least, rate, self.leased - self.taken))  # asked now
        return super().acquire_async(dataset_id, epoch, rows, least, rate)

    def acquire(self, dataset_id, epoch, rows, least=1, rate=None):
        got = super().acquire(dataset_id, epoch, rows, least, rate)
        if got is not None:
            self.leases.append(got)
            self.leased += sum(b - a for a, b in got)
        return got


def paced_asks(shards, lead: str) -> list[tuple[int, int, float, int]]:
    """A loader read to its end at about 1,000 rows a second, leases of 500 ms of its
    reading, the next asked ``lead`` before the rows held run out: the asks made once
    its pace was measured, as :class:`CountingLeases` saw them."""
    svc = CountingLeases()
    settings = {"daskdist.data.pace-span": 0, "daskdist.data.lease-seconds": "500ms",
                "daskdist.data.lease-lead": lead}
    with dask.config.set(settings):
        ld = make(shards, svc, batch_size=10, lease_rows=100_000, prefetch=2)
    got = []
    for batch in ld:
        got += batch["id"].tolist()
        svc.taken += len(batch["id"])
        time.sleep(0.01)
    assert sorted(got) == list(range(TOTAL))
    paced = [ask for ask in svc.asks if ask[2]]
    assert len(paced) >= 2, svc.asks
    for rows, least, rate, _ in paced:
        assert rows <= max(least, rate * 0.5) + 1, (rows, rate)  # never lease_rows
    return paced


def test_a_loader_asks_for_seconds_of_its_reading_and_asks_again_near_their_end(shards):
    """Once its pace is measured, a lease covers at most ``lease-seconds`` of the loader's
    reading (a slow worker does not take a large share at once), and the next is asked
    for only once the rows held would last under ``lease-lead``: not a second lease on
    top of a whole one, which at the epoch's end a slow reader would hold while the
    others run dry. Asked at once instead (a lead longer than a lease), the rows held
    at an ask exceed the bound: the bound is what the lead decides."""

    def bound(rate):  # under 50 ms of rows, a batch of slack for the consumer's count,
        return rate * 0.05 + 10 + 2 * 90  # and the prefetch: two units' blocks (90 rows)

    near = paced_asks(shards, "50ms")
    assert all(held <= bound(rate) for _, _, rate, held in near), near
    at_once = paced_asks(shards, "10s")
    assert any(held > bound(rate) for _, _, rate, held in at_once), at_once


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_lease_covers_whole_units_up_to_the_rows_asked_for(shards, shuffle):
    """One lease call per ``lease_rows`` rows (in whole row groups), not one per unit,
    once the loader measured its pace (before: the least lease, a batch); every row read
    once."""
    svc = CountingLeases()
    with dask.config.set({"daskdist.data.pace-span": 0}):  # measured from the 2nd batch
        ld = make(shards, svc, batch_size=50, lease_rows=400, shuffle=shuffle)
    assert ld.lease_rows == 400
    got = []
    for batch in ld:
        got += batch["id"].tolist()
    assert sorted(got) == list(range(TOTAL))
    # units of 90 rows (and a last one of 50) in 3 files of 500 rows: a lease ends at a
    # unit's end; the first (pace unknown) covers a batch, the next >= 400 rows until
    # the share of what is left (free / 2) is less
    ends = {u.start + u.num_rows for u in shards.units}
    assert all(lease[-1][1] in ends for lease in svc.leases)
    sizes = [sum(b - a for a, b in lease) for lease in svc.leases]
    # until then (the leases the prefetch asked before two batches were taken): a unit
    first = next(i for i, n in enumerate(sizes) if n >= 400)
    assert 1 <= first <= 4 and all(n <= 90 for n in sizes[:first])
    assert len(svc.leases) <= 9 < len(shards.units)
    assert make(shards, svc, batch_size=300, lease_rows=1).lease_rows == 600  # 2 batches


def test_each_loader_is_a_dataset_of_its_own(shards):
    """Two loaders over the same files (train and eval) each read every row; outside a
    coordinator each loader gets a fresh id, inside one the per-worker dataset's."""
    svc = LocalLeaseService()
    a = ArrowLoader(shards, InputContext(services=svc), batch_size=100, policy="dynamic")
    b = ArrowLoader(shards, InputContext(services=svc), batch_size=100, policy="dynamic")
    assert a.dataset_id != b.dataset_id
    for ld in (a, b):
        it = iter(ld)
        ids = []
        while (got := closure(it))[0] is not None:
            assert svc.ack_tokens(got[1])
            ids += got[0]["id"].tolist()
        assert sorted(ids) == list(range(TOTAL)) and ld.progress()["complete"]
    ctx = InputContext(services=svc, dataset_id="rid")
    train = ArrowLoader(shards, ctx, policy="dynamic", name="train")
    evaluation = ArrowLoader(shards, ctx, policy="dynamic", name="eval")
    assert (train.dataset_id, evaluation.dataset_id) == ("rid", "rid.1")
    assert train.progress()["name"] == "train"


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return data


def test_a_failed_read_gives_its_rows_back_and_a_retry_completes(tmp_path):
    """A truncated file: the closure that reaches it gets one error naming the file; the
    lease's rows not handed on go back at once (the bad unit's after every other row);
    once the file is fixed, the same iterator completes the epoch, every row once."""
    for f in range(3):
        ids = np.arange(f * 500, (f + 1) * 500, dtype=np.int64)
        pq.write_table(pa.table({"id": ids}), tmp_path / f"p{f}.parquet", row_group_size=100)
    shards = ArrowShards(tmp_path).validate()  # footers read first, as on the client
    good = truncate(tmp_path / "p1.parquet")
    svc = LocalLeaseService()
    ld = make(shards, svc, batch_size=50, lease_rows=200, prefetch=2)
    it = iter(ld)
    acked, errors = [], []
    for _ in range(200):
        try:
            batch, tokens = closure(it)
        except ValueError as e:
            errors.append(str(e))
            assert ld.progress()["leased"] == 0  # nothing stays leased to this worker
            if len(errors) == 1:
                (tmp_path / "p1.parquet").write_bytes(good)  # the user fixes the file
            continue
        if batch is None:
            if ld.progress()["complete"]:
                break
            continue
        assert svc.ack_tokens(tokens)
        acked.append(batch["id"].tolist())
    rows = sorted(r for b in acked for r in b)
    assert rows == list(range(TOTAL)), "every row exactly once"
    assert len(errors) == 1 and "p1.parquet" in errors[0]
    assert ld.progress()["failed"] is None
    check_leases(svc.table)


def test_the_same_file_failing_max_failures_times_fails_the_epoch(tmp_path):
    """A null in a numeric column without ``fill_null``: each read names the file and
    the column, gives its rows back, and the third failure of that file fails the epoch
    with ``InputError`` (no endless retry); the other rows were all read meanwhile."""
    for f in range(2):
        ids = np.arange(f * 300, (f + 1) * 300, dtype=np.int64)
        x = pa.array([None if (f == 1 and i == 5) else float(i) for i in range(300)],
                     pa.float64())
        pq.write_table(pa.table({"id": ids, "x": x}), tmp_path / f"p{f}.parquet",
                       row_group_size=100)
    svc = LocalLeaseService()  # max_failures: 3, the coordinator's default
    ld = make(ArrowShards(tmp_path), svc, batch_size=50, lease_rows=100)
    it = iter(ld)
    errors, rows = [], []
    for _ in range(100):
        try:
            batch, tokens = closure(it)
        except InputError as e:
            errors.append(e)
            break
        except ValueError as e:
            errors.append(e)
            assert "p1.parquet" in str(e) and "'x'" in str(e) and "fill_null" in str(e)
            assert ld.progress()["leased"] == 0  # given back at once
            continue
        if batch is not None:
            assert svc.ack_tokens(tokens)
            rows += batch["id"].tolist()
    assert [type(e) for e in errors] == [ValueError, ValueError, InputError]
    assert "p1.parquet" in str(errors[-1]) and "3 times" in str(errors[-1])
    assert "'x'" in str(errors[-1])  # the third read's own error, in the epoch's
    assert sorted(rows) == [i for i in range(600) if not 300 <= i < 400]
    p = ld.progress()
    assert not p["complete"] and "p1.parquet" in p["failed"]
    with pytest.raises(InputError):
        closure(it)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_batch_cut_across_a_failing_read_leaves_nothing_leased(tmp_path, prefetch, shuffle):
    """Batches of 30 over row groups of 100: a batch straddles two blocks, and when the
    second fails to convert (a null) the rows already cut from the first reached no
    caller. They go back with the error, so no row stays leased to a worker whose
    closures go on after errors, and each is trained later, once."""
    ids = np.arange(400, dtype=np.int64)
    x = pa.array([None if i == 150 else float(i) for i in ids], pa.float64())
    pq.write_table(pa.table({"id": ids, "x": x}), tmp_path / "p.parquet", row_group_size=100)
    svc = LocalLeaseService(LeaseTable(max_failures=1000))
    ld = make(ArrowShards(tmp_path), svc, batch_size=30, lease_rows=100, prefetch=prefetch,
              shuffle=shuffle, seed=3)
    it = iter(ld)
    rows, errors = [], 0
    for _ in range(200):
        try:
            batch, tokens = closure(it)
        except ValueError as e:
            assert "p.parquet" in str(e) and "'x'" in str(e)
            errors += 1
            assert ld.progress()["leased"] == 0, "rows stayed leased after the error"
            continue
        if batch is None:
            p = ld.progress()
            assert p["leased"] == 0  # no closure runs: nothing held for it
            if p["acknowledged"] + p["free"] == p["total"] and errors >= 3:
                break
            continue
        assert svc.ack_tokens(tokens)
        rows += batch["id"].tolist()
    counts = Counter(rows)
    assert set(counts.values()) == {1}, "a row trained twice"
    assert 150 not in counts and set(range(100)) | set(range(200, 400)) <= set(counts)
    check_leases(svc.table)
    ld.close()

"""A dataset is the call that made it; failed reads give their rows back, on a real
LocalCluster: 3 worker processes with 2 threads each, real Parquet
files written (and broken) by the tests.

Were a dataset's identity its files' content, and completed epochs remembered
forever, a re-run notebook cell, a new Coordinator, or a training and an evaluation
dataset over one directory would train 0 rows, silently; were a failed read's rows left
leased to a live worker, the epoch would never complete once the file was
fixed.
"""

from __future__ import annotations

import gc
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import daskdist as dd
from daskdist.core.protocol import SESSION_ENDED, DatasetDef
from tests.conftest import live_session, make_cluster, take_rows, wait_for_workers, wait_until

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]

FILES, GROUPS, ROWS = 6, 3, 200  # 3600 rows in 18 row groups
TOTAL = FILES * GROUPS * ROWS
WORKERS = 3


def write(root, nulls_in: int | None = None) -> str:
    """The shards: ``rid`` (the row id) and ``x``; file ``nulls_in`` has a null ``x``."""
    root.mkdir(parents=True, exist_ok=True)
    for f in range(FILES):
        ids = np.arange(f * GROUPS * ROWS, (f + 1) * GROUPS * ROWS, dtype=np.int64)
        x = pa.array(ids.astype(np.float32))
        if f == nulls_in:
            x = pa.array([None if i == 7 else float(v) for i, v in enumerate(ids)],
                         pa.float32())
        pq.write_table(pa.table({"rid": ids, "x": x}), root / f"part-{f}.parquet",
                       row_group_size=ROWS)
    return str(root)


@pytest.fixture(scope="module")
def cluster():
    with make_cluster(WORKERS, threads=2) as c:
        yield c


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write(tmp_path_factory.mktemp("identity"))


@pytest.fixture
def coord(client, request):
    co = dd.Coordinator(client, name=request.node.name)
    wait_for_workers(client, co, WORKERS)
    yield co
    co.close()


def drain(coord, ds, it, max_rounds=300, on_error=None):
    """Rounds of closures until the epoch is complete (or failed); the rows of completed
    closures and the errors failed closures raised (each once)."""
    rows, errors = [], []
    for _ in range(max_rounds):
        try:
            rvs = [coord.schedule(take_rows, args=(it,)) for _ in range(2 * WORKERS)]
        except Exception:  # noqa: BLE001 - the last round's first error, raised again
            continue
        for rv in rvs:
            try:
                rows += rv.fetch(timeout=60)
            except dd.CancelledError:
                pass
            except Exception as e:  # noqa: BLE001 - a closure's own error
                errors.append(e)
                if on_error is not None:
                    on_error(e)
        try:
            if ds.progress()["complete"]:
                return rows, errors
        except dd.InputError as e:  # the epoch failed: the loop ends
            errors.append(e)
            return rows, errors
    raise AssertionError(f"epoch not complete after {max_rounds} rounds: {ds.progress()}")


def exactly_once(rows):
    counts = Counter(rows)
    assert sorted(counts) == list(range(TOTAL)), f"{TOTAL - len(counts)} rows never trained"
    assert set(counts.values()) == {1}, "a row trained twice"


def datasets_on_scheduler(client, name):
    def ids(dask_scheduler, name=name):
        co = dask_scheduler.extensions["daskdist"].coordinators[name]
        return sorted(co.leases.datasets)

    return client.run_on_scheduler(ids)


# -- point 1: a dataset is the call that made it ------------------------------------------


def test_running_the_cell_again_trains_every_row_again(coord, shards):
    runs = []
    for _ in range(2):  # the notebook cell, run twice
        ds = coord.distribute_dataset(shards, global_batch_size=3 * 40, policy="dynamic",
                                      name="train")
        rows, errors = drain(coord, ds, iter(ds))
        assert not errors
        runs.append(rows)
    for rows in runs:
        exactly_once(rows)
    assert ds.progress().get("name") == "train"  # the name is a label


def test_a_new_coordinator_trains_every_row(client, shards, request):
    for _ in range(2):  # a new Coordinator (same name, same client), same files
        co = dd.Coordinator(client, name=request.node.name)
        wait_for_workers(client, co, WORKERS)
        ds = co.distribute_dataset(shards, global_batch_size=3 * 40, policy="dynamic")
        rows, _ = drain(co, ds, iter(ds))
        exactly_once(rows)
        co.close()


def test_training_and_evaluation_over_one_directory_each_read_every_row(coord, shards):
    train = coord.distribute_dataset(shards, global_batch_size=3 * 40, policy="dynamic",
                                     shuffle=True)
    evaluation = coord.distribute_dataset(shards, global_batch_size=3 * 60,
                                          policy="dynamic")
    assert train.dataset_id != evaluation.dataset_id
    it_train, it_eval = iter(train), iter(evaluation)
    got = {"train": [], "eval": []}
    for _ in range(300):  # interleaved: each round reads from both
        rvs = [(k, coord.schedule(take_rows, args=(it,)))
               for k, it in (("train", it_train), ("eval", it_eval)) for _ in range(WORKERS)]
        for k, rv in rvs:
            got[k] += rv.fetch(timeout=60)
        if train.progress()["complete"] and evaluation.progress()["complete"]:
            break
    exactly_once(got["train"])
    exactly_once(got["eval"])


def make_loader(ctx, shards=None):
    return dd.data.ArrowLoader(shards, ctx, batch_size=40, policy="dynamic")


def loader_progress(loader):
    return loader.progress()


def test_per_worker_datasets_with_a_dynamic_loader_are_new_each_call(coord, shards):
    """``create_per_worker_dataset`` with a factory building a dynamic ArrowLoader: the
    loader takes its id from the InputContext the worker builds, so two calls over the
    same files are two datasets, each read whole."""
    import functools

    runs, handles = [], []
    for _ in range(2):
        ds = coord.create_per_worker_dataset(functools.partial(make_loader, shards=shards))
        it = iter(ds)
        rows = []
        for _ in range(300):
            rows += [r for b in coord.fetch([coord.schedule(take_rows, args=(it,))
                                             for _ in range(2 * WORKERS)]) for r in b]
            if coord.schedule(loader_progress, args=(ds.values,)).fetch()["complete"]:
                break
        runs.append(rows)
        handles.append(ds)
    for rows in runs:
        exactly_once(rows)
    named = coord.create_per_worker_dataset(functools.partial(make_loader, shards=shards),
                                            name="pw")
    assert not named.progress()["known"]  # no worker's loader defined it yet
    p = handles[0].progress()
    assert p["complete"] and p["total"] == TOTAL and p["name"] == ""


def prefetching(dask_worker) -> int:
    import threading

    return sum(t.name.startswith("daskdist-prefetch") for t in threading.enumerate())


def test_a_dataset_goes_with_its_handle_and_with_its_coordinator(client, coord, shards):
    name = coord.name
    done = coord.distribute_dataset(shards, global_batch_size=3 * 40, policy="dynamic")
    rows, _ = drain(coord, done, iter(done))
    exactly_once(rows)
    # dropped mid-epoch: its loaders hold leased rows they have not handed out
    ds = coord.distribute_dataset(shards, global_batch_size=3 * 40, policy="dynamic")
    it = iter(ds)
    assert coord.fetch([coord.schedule(take_rows, args=(it,)) for _ in range(6)])
    assert ds.progress()["leased"] > 0
    kept = coord.distribute_dataset(shards, global_batch_size=3 * 40, policy="dynamic")
    assert datasets_on_scheduler(client, name) == sorted(
        [done.dataset_id, ds.dataset_id, kept.dataset_id])
    gone = [done.dataset_id, ds.dataset_id]
    del ds, it, done
    gc.collect()
    coord._release_now()
    wait_until(lambda: datasets_on_scheduler(client, name) == [kept.dataset_id], 30,
               "the dropped datasets' tables to go")
    assert not set(gone) & set(datasets_on_scheduler(client, name))
    # the workers closed the loaders (off their event loops) and still run closures
    wait_until(lambda: sum(client.run(prefetching).values()) == 0, 30,
               "the dropped loaders' producers to stop")
    assert coord.fetch(coord.schedule(len, args=([1, 2],))) == 2
    other = dd.Coordinator(client, name=name)  # a second client-side Coordinator
    mine = other.distribute_dataset(shards, global_batch_size=3 * 40, policy="dynamic")
    other.close()  # its datasets go with it; the first coordinator's stay
    wait_until(lambda: mine.dataset_id not in datasets_on_scheduler(client, name), 30,
               "the closed coordinator's dataset to go")
    assert datasets_on_scheduler(client, name) == [kept.dataset_id]


def test_an_epoch_resumes_on_a_new_coordinator_from_its_state_dict(client, shards, request):
    """Resuming is explicit: the ledger of a half-trained epoch (epoch, seed, the
    acknowledged rows as intervals, name) continues on a new coordinator's new dataset,
    which reads only the rows the ledger lacks."""
    a = dd.Coordinator(client, name=request.node.name + "-a")
    wait_for_workers(client, a, WORKERS)
    ds = a.distribute_dataset(shards, global_batch_size=3 * 40, policy="dynamic",
                              shuffle=True, seed=5, name="resumable")
    ds.set_epoch(3)
    it = iter(ds)
    first = []
    for _ in range(4):
        first += [r for b in a.fetch([a.schedule(take_rows, args=(it,)) for _ in range(6)])
                  for r in b]
    state = ds.state_dict()
    assert (state["epoch"], state["seed"], state["name"]) == (3, 5, "resumable")
    assert sum(b - s for s, b in state["acknowledged"]) == len(first) > 0
    assert len(state["acknowledged"]) < 200  # intervals, not rows
    a.close()

    b = dd.Coordinator(client, name=request.node.name + "-b")
    wait_for_workers(client, b, WORKERS)
    ds2 = b.distribute_dataset(shards, global_batch_size=3 * 40, policy="dynamic",
                               shuffle=True, name="resumable")
    ds2.load_state_dict(state)
    assert ds2.epoch == 3 and ds2.seed == 5
    assert ds2.progress()["acknowledged"] == len(first)
    rows, _ = drain(b, ds2, iter(ds2))
    exactly_once(first + rows)
    with pytest.raises(ValueError, match="started already"):
        ds2.load_state_dict(state)
    other_files = b.distribute_dataset(shards + "/part-0.parquet", global_batch_size=3 * 40,
                                       policy="dynamic")
    with pytest.raises(ValueError, match="other files"):
        other_files.load_state_dict(state)
    b.close()


# -- point 6: failed reads give their rows back --------------------------------------------


def test_a_truncated_file_gives_its_rows_back_and_a_retry_after_the_fix_completes(
        client, tmp_path, request):
    root = write(tmp_path / "shards")
    co = dd.Coordinator(client, name=request.node.name, max_worker_failures=20)
    wait_for_workers(client, co, WORKERS)
    ds = co.distribute_dataset(root, global_batch_size=3 * 40, policy="dynamic")
    bad = tmp_path / "shards" / "part-0.parquet"  # read by the first lease
    good = bad.read_bytes()
    bad.write_bytes(good[: len(good) // 2])  # truncated after the client read its footer
    first_unit = (0, ROWS)
    seen = []

    def on_error(e):
        if not seen:
            seen.append(e)

            def deferred(dask_scheduler, name=co.name, ds_id=ds.dataset_id):
                co_ = dask_scheduler.extensions["daskdist"].coordinators[name]
                ep = co_.leases.datasets[ds_id].epochs[0]
                return ep.deferred.items(), [rs.items() for rs in ep.leased.values()]

            deferred_rows, leased = client.run_on_scheduler(deferred)
            # given back at once: deferred (read after every other row), leased to no one
            assert any(a <= first_unit[0] and first_unit[1] <= b for a, b in deferred_rows)
            assert not any(a < first_unit[1] and first_unit[0] < b
                           for held in leased for a, b in held)
            bad.write_bytes(good)  # the user fixes the file; the loop goes on

    rows, errors = drain(co, ds, iter(ds), on_error=on_error)
    exactly_once(rows)
    assert errors and all(isinstance(e, ValueError) and "part-0.parquet" in str(e)
                          for e in errors)
    # once per closure that reached it, not a loop: each of the file's row groups fails
    # at most once before the fix (its rows are retried after every other row)
    assert len(errors) <= GROUPS
    assert co.status()["acks_refused"] == 0
    co.close()


def test_a_file_failing_max_worker_failures_times_fails_the_epoch(client, tmp_path, request):
    root = write(tmp_path / "shards", nulls_in=2)
    co = dd.Coordinator(client, name=request.node.name)  # max_worker_failures: 3
    wait_for_workers(client, co, WORKERS)
    ds = co.distribute_dataset(root, global_batch_size=3 * 40, policy="dynamic")
    rows, errors = drain(co, ds, iter(ds))
    named = [e for e in errors if not isinstance(e, dd.InputError)]
    assert named and all("part-2.parquet" in str(e) and "'x'" in str(e) for e in named)
    assert isinstance(errors[-1], dd.InputError) and "part-2.parquet" in str(errors[-1])
    assert "3 times" in str(errors[-1])
    # rows trained meanwhile were trained once; the null row never was (a lease cut
    # inside the bad row group near the epoch's end may train its rows before the null)
    counts = Counter(rows)
    bad = {2 * GROUPS * ROWS + 7}
    assert set(counts) <= set(range(TOTAL)) - bad and set(counts.values()) == {1}
    with pytest.raises(dd.InputError, match="part-2.parquet"):
        ds.progress()
    co.close()


def test_a_loop_going_on_after_a_null_leaves_no_row_leased_between_rounds(
        client, tmp_path, request):
    """A file with a null, ``max_worker_failures=1000`` and a loop that goes on after
    errors, as a user writes it: batches of 20 over row groups of 50, so a batch is often
    cut across a block and the failing one. Once every other row is trained, nothing
    stays leased while no closure runs (rows cut for a batch that failed went back),
    and every row but the failing ones was trained once."""
    ids = np.arange(200, dtype=np.int64)
    x = pa.array([None if i == 107 else float(i) for i in ids], pa.float32())
    pq.write_table(pa.table({"rid": ids, "x": x}), tmp_path / "null.parquet",
                   row_group_size=50)
    co = dd.Coordinator(client, name=request.node.name, max_worker_failures=1000)
    wait_for_workers(client, co, WORKERS)
    ds = co.distribute_dataset(str(tmp_path / "null.parquet"),
                               global_batch_size=WORKERS * 20, policy="dynamic")
    it = iter(ds)
    trainable = set(range(100)) | set(range(150, 200))
    rows, errors, p = [], 0, {}
    for _ in range(60):
        try:
            rvs = [co.schedule(take_rows, args=(it,)) for _ in range(2 * WORKERS)]
        except ValueError:  # the last round's first error, raised again
            errors += 1
            continue
        for rv in rvs:
            try:
                rows += rv.fetch(timeout=60)
            except ValueError as e:
                assert "null.parquet" in str(e) and "'x'" in str(e)
                errors += 1
        p = ds.progress()  # every closure of the round finished
        if errors >= 3 and trainable <= set(rows) and p["leased"] == 0 \
                and p["acknowledged"] + p["free"] == p["total"]:
            break
    else:
        raise AssertionError(f"rows stayed leased or untrained between rounds: {p}, "
                             f"untrained {sorted(trainable - set(rows))}")
    counts = Counter(rows)
    assert set(counts.values()) == {1} and 107 not in counts
    assert p["free"] <= 50  # only rows of the failing block are left
    assert p["acknowledged"] == len(counts)
    co.close()


# -- point 7 (the lease handlers): arguments checked, callers' sessions live ---------------


def test_lease_handlers_check_arguments_and_sessions(client, coord, shards):
    ds = coord.distribute_dataset(shards, global_batch_size=3 * 40, policy="dynamic")
    it = iter(ds)
    assert coord.fetch([coord.schedule(take_rows, args=(it,)) for _ in range(6)])
    assert ds.progress()["acknowledged"] > 0  # an epoch under way

    def call(op, **kw):
        return client.sync(getattr(client.scheduler, op), name=coord.name, **kw)

    # a worker's route checks its session first (below), then its arguments
    live = {"session": live_session(client, coord.name), "dataset_id": ds.dataset_id,
            "epoch": 0}
    good = {**live, "session": "x" * 32}
    bad_args = [
        ("daskdist_lease_acquire", {**live, "rows": 100, "dataset_id": 7}, TypeError,
         "dataset_id must be a str"),
        ("daskdist_lease_acquire", {**live, "rows": 100, "epoch": -1}, ValueError,
         "epoch must be between 0 and"),
        ("daskdist_lease_acquire", {**live, "rows": "100"}, TypeError, "rows must be an int"),
        ("daskdist_lease_acquire", {**live, "rows": True}, TypeError, "rows must be an int"),
        ("daskdist_lease_release", {**live, "ranges": [[0, 1]] * (1 + (1 << 18))}, ValueError,
         "ranges must hold at most 262144 items, got 262145"),
        ("daskdist_lease_release", {**live, "ranges": [[0, 1, 2]]}, TypeError,
         r"ranges\[0\] must be a pair"),
        ("daskdist_lease_release", {**live, "ranges": [[0, 1]], "failure": "f"}, TypeError,
         "failure"),
        ("daskdist_dataset_define", {"dataset": list(DatasetDef("d", "", [[5, 1]], 0)),
                                     "owner": "nobody", "token": coord._token},
         PermissionError, "has no owner 'nobody'"),
        ("daskdist_dataset_define", {"dataset": list(DatasetDef("d", "", [[5, 1]], 0)),
                                     "owner": coord._owner, "token": "not-the-secret"},
         PermissionError, "is not owner"),
        ("daskdist_dataset_define", {"dataset": ["d", "", [[5, 1]]], "owner": coord._owner,
                                     "token": coord._token}, TypeError, "DatasetDef"),
        ("daskdist_dataset_define", {"dataset": list(DatasetDef("d", "", [[5, -1]], 0)),
                                     "owner": coord._owner, "token": coord._token},
         ValueError, r"runs\[0\]\[1\] must be between"),
        ("daskdist_dataset_define", {"dataset": list(DatasetDef(ds.dataset_id, "", [[5, 1]],
                                                                 0)),
                                     "owner": coord._owner, "token": coord._token},
         ValueError, "differ"),
        ("daskdist_dataset_start", {"owner": coord._owner, "token": coord._token,
                                    "ledger": [ds.dataset_id, 0, [], TOTAL]},
         ValueError, "started already"),
    ]
    for op, kw, exc, match in bad_args:
        with pytest.raises(exc, match=match):
            call(op, **kw)
    # an old client's per-unit list: refused at once, no table defined
    with pytest.raises(TypeError, match="unit_rows"):
        call("daskdist_lease_progress", dataset_id="new", epoch=0, unit_rows=[100] * 10**5)
    # read-only: asking about a dataset never creates one
    assert not call("daskdist_lease_progress", dataset_id="new", epoch=0)["known"]
    assert "new" not in datasets_on_scheduler(client, coord.name)
    # a session that is not a live member is refused, and changes nothing
    before = ds.progress()
    assert call("daskdist_lease_acquire", **good, rows=100) == SESSION_ENDED
    assert call("daskdist_lease_release", **good, ranges=[[0, TOTAL]]) == SESSION_ENDED
    assert call("daskdist_dataset_define", dataset=list(DatasetDef("d2", "", [[5, 1]], 0)),
                session="x" * 32) == SESSION_ENDED
    assert ds.progress() == before
    assert "d2" not in datasets_on_scheduler(client, coord.name)

"""Dask collections through distribute_dataset on real LocalClusters (worker processes,
2 threads per worker): a lazy DataFrame streamed exactly once and gone from cluster
memory afterwards, the same with a member SIGKILLed, a dict of N-D Arrays, a persisted
DataFrame read where it is held, members restricted by resources=, synchronous
training with State.commit, and an error in the user's graph."""

from __future__ import annotations

import functools
import os
import time
from collections import Counter

import numpy as np
import pytest
import torch

pd = pytest.importorskip("pandas")
ddf = pytest.importorskip("dask.dataframe")
da = pytest.importorskip("dask.array")

import daskdist as dd  # noqa: E402
from tests.conftest import (  # noqa: E402
    gpu_and_plain_cluster,
    make_cluster,
    sigkill,
    wait_for_workers,
    wait_until,
)
from tests.row_ledger import (  # noqa: E402
    assert_every_row_once,
    final_counts,
    make_counts,
    train_rows,
)

THREADS = 2
PARTS, ROWS = 16, 50  # 800 rows


def make_part(i: int, rows: int = ROWS, pause: float = 0.0) -> pd.DataFrame:
    """Partition ``i``: ids ``i*rows ..``, when and where it was computed."""
    if pause:
        time.sleep(pause)
    try:
        from distributed import get_worker

        where = get_worker().address
    except ValueError:  # Dask computing its meta on the client
        where = ""
    return pd.DataFrame({"id": np.arange(rows, dtype=np.int64) + i * rows,
                         "x": np.full(rows, float(i), dtype=np.float32),
                         "made_at": np.full(rows, time.time()),
                         "made_on": [where] * rows})


def lazy_frame(parts: int = PARTS, pause: float = 0.0):
    return ddf.from_map(functools.partial(make_part, pause=pause), range(parts))


def take(it, pause: float = 0.0):
    """A closure: one batch's ids, when it was trained and on which worker (``None``
    when no unleased rows remain right now)."""
    try:
        b = next(it)
    except StopIteration:
        return None
    time.sleep(pause)
    return {"id": b["id"].tolist(), "at": time.time(),
            "worker": dd.get_worker_context().address,
            "made_at": float(b["made_at"].min()) if "made_at" in b else 0.0,
            "made_on": sorted(set(b["made_on"])) if "made_on" in b else []}


def drain(coord, ds, it, pause=0.0, on_round=None, deadline=120.0):
    """Closures until the epoch is complete; the completed closures' records."""
    out = []
    end = time.monotonic() + deadline
    rounds = 0
    while not ds.progress()["complete"]:
        assert time.monotonic() < end, ds.progress()
        rvs = [coord.schedule(take, args=(it, pause)) for _ in range(6)]
        if on_round is not None:
            on_round(rounds)
        out += [r for r in coord.fetch(rvs) if r is not None]
        rounds += 1
    return out


def in_memory(client) -> list[str]:
    """Keys Dask holds in memory anywhere in the cluster now."""
    def keys(dask_scheduler):
        return [str(k) for k, ts in dask_scheduler.tasks.items() if ts.state == "memory"]

    return client.run_on_scheduler(keys)


@pytest.fixture(scope="module")
def cluster2():
    from distributed import Client

    with make_cluster(2, threads=THREADS) as cluster, Client(cluster) as client:
        yield cluster, client


@pytest.fixture
def coord(cluster2, request):
    _, client = cluster2
    co = dd.Coordinator(client, name=request.node.name)
    wait_for_workers(client, co, 2)
    yield co
    co.close()


def test_a_lazy_frame_streams_every_row_once_and_leaves_nothing_in_memory(coord, cluster2):
    _, client = cluster2
    df = lazy_frame(pause=0.05)
    ds = coord.distribute_dataset(df, global_batch_size=40, shuffle=True, name="lazy")
    p = ds.progress()
    assert not p["known"] and p["total"] == 0 and p["units"] == PARTS  # no pass first
    got = drain(coord, ds, iter(ds))
    ids = Counter(i for r in got for i in r["id"])
    assert sorted(ids) == list(range(PARTS * ROWS)) and set(ids.values()) == {1}
    p = ds.progress()
    assert p["known"] and p["complete"] and p["acknowledged"] == p["total"] == PARTS * ROWS
    # the first batch was trained before the last partition was computed
    first_trained = min(r["at"] for r in got)
    last_made = max(r["made_at"] for r in got)
    print(f"first batch trained {last_made - first_trained:.2f} s before the last "
          "partition was computed")
    assert first_trained < last_made
    # no computed partition stays in the cluster's memory
    wait_until(lambda: not in_memory(client), 30, "Dask to forget the partitions")


def test_a_dict_of_arrays_gives_nd_batches_every_row_once(coord):
    n = 300
    image = da.arange(n * 6, dtype=np.float32, chunks=6 * 40).reshape(n, 2, 3)
    image = image.rechunk((40, 2, 3))
    label = da.arange(n, chunks=40)
    ds = coord.distribute_dataset({"image": image, "label": label}, global_batch_size=32)
    assert ds.progress()["known"] and ds.progress()["total"] == n  # from the chunks

    def step(it):
        try:
            b = next(it)
        except StopIteration:
            return None
        assert tuple(b["image"].shape[1:]) == (2, 3), b["image"].shape
        assert (b["image"][:, 0, 0] == b["label"] * 6).all()
        return b["label"].tolist()

    seen = []
    it = iter(ds)
    while not ds.progress()["complete"]:
        seen += [x for r in coord.fetch([coord.schedule(step, args=(it,)) for _ in range(6)])
                 if r for x in r]
    assert sorted(seen) == list(range(n))


def train_where(state, it):
    """A gang closure: synchronous steps (a commit each); per step this rank's worker
    and the ids it trained."""
    state.sync()
    where = dd.get_worker_context().address
    out = []
    for batch in dd.collective.synced(it):
        c = torch.bincount(batch["id"], minlength=state.counts.numel()).to(torch.float64)
        dd.collective.get_group().allreduce(c)
        state.counts += c.to(state.counts.device)
        state.commit()
        out.append((where, batch["id"].tolist()))
    return out


def test_a_persisted_frame_is_read_where_it_is_held(coord, cluster2):
    from distributed import futures_of, wait

    _, client = cluster2
    parts = PARTS * 2
    # persisted evenly over both workers (Dask's own placement may put most on one:
    # then at most that worker's share can be read in place under balanced steps)
    workers = sorted(client.scheduler_info()["workers"])
    df = lazy_frame(parts)[["id", "x"]]
    halves = [client.persist(df.partitions[k * parts // 2:(k + 1) * parts // 2],
                             workers=[w]) for k, w in enumerate(workers)]
    pdf = ddf.concat(halves)
    wait(halves)
    futures = futures_of(pdf)
    holders = {i: workers[i * 2 // parts] for i in range(parts)}
    assert {next(iter(w)) for w in client.who_has(futures).values()} == set(workers)
    coord.collective_group(timeout=30)
    state = coord.create_per_worker_resource(functools.partial(make_counts, n=parts * ROWS))
    ds = coord.distribute_dataset(pdf, global_batch_size=2 * ROWS, name="persisted",
                                  prefetch=0)
    it = iter(ds)
    steps = []
    deadline = time.monotonic() + 120
    while not ds.progress()["complete"]:
        assert time.monotonic() < deadline, ds.progress()
        steps += [s for rank in coord.fetch(coord.schedule_on_all(train_where,
                                                                  args=(state, it)))
                  for s in rank]
    assert_every_row_once(coord.fetch(coord.schedule_on_all(final_counts, args=(state,))),
                          parts * ROWS)
    local = sum(1 for where, ids in steps for i in ids if holders[i // ROWS] == where)
    share = local / (parts * ROWS)
    print(f"rows trained on the worker holding their partition: {share:.1%}")
    assert share >= 0.9
    # the user's persisted partitions are still there
    assert all(client.who_has(futures_of(pdf)).values())
    del pdf, futures


def boom_at_3(df):
    if int(df["id"].iloc[0]) // ROWS == 3:
        raise ZeroDivisionError("featurize failed on this one")
    return df


def take_in_a_thread(it):
    """A closure that takes its batch in a thread it started outside its context: no
    closure can acknowledge those rows. What the thread got or raised."""
    import threading

    out = {}

    def run():
        try:
            out["rows"] = len(next(it)["id"])
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["error"] = str(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_a_batch_taken_off_a_closures_scope_goes_back_and_the_epoch_completes(coord):
    """A DataFrame batch taken in a thread the closure did not start in its context:
    its rows go back to the pool and the thread gets an error saying so, as for files
    (never leased for good, the epoch never completing)."""
    ds = coord.distribute_dataset(lazy_frame(4), global_batch_size=20, name="threads")
    it = iter(ds)
    outs = coord.fetch([coord.schedule(take_in_a_thread, args=(it,)) for _ in range(4)])
    assert all("no closure could acknowledge its rows" in o.get("error", "") for o in outs)
    assert ds.progress()["acknowledged"] == 0
    records = drain(coord, ds, it)
    ids = Counter(i for r in records for i in r["id"])
    assert sorted(ids) == list(range(4 * ROWS)) and set(ids.values()) == {1}
    assert ds.progress()["leased"] == 0


def test_an_error_in_the_users_graph_names_the_partition(coord):
    df = lazy_frame(8).map_partitions(boom_at_3)
    ds = coord.distribute_dataset(df, global_batch_size=20, name="boom")
    it = iter(ds)
    with pytest.raises(dd.InputError) as e:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            coord.fetch([coord.schedule(take, args=(it,)) for _ in range(4)])
    assert "partition 3" in str(e.value)
    assert "ZeroDivisionError" in str(e.value) and "featurize failed" in str(e.value)
    assert isinstance(e.value.original, ZeroDivisionError)  # the user's error, chained
    # its rows went back to the pool: read again (and failing again) until the
    # max_worker_failures-th failure fails the epoch, naming the partition; no hang
    deadline = time.monotonic() + 60
    with pytest.raises(dd.InputError, match="partition 3.*cannot complete"):
        while time.monotonic() < deadline:
            try:
                coord.fetch([coord.schedule(take, args=(it,)) for _ in range(4)])
            except dd.InputError:
                pass
            ds.progress()  # raises once the epoch failed


def read_logged(i: int, log: str) -> pd.DataFrame:
    """Partition ``i`` of a frame, each read leaving a file in ``log`` (any process)."""
    import uuid

    open(os.path.join(log, f"{i}-{uuid.uuid4().hex}"), "w").close()
    return pd.DataFrame({"id": np.arange(ROWS, dtype=np.int64) + i * ROWS,
                         "a": np.arange(ROWS, dtype=np.float64)})


def reads(log) -> list[int]:
    return sorted(int(name.split("-")[0]) for name in os.listdir(log))


def test_work_partitions_share_is_done_again_unless_persisted(coord, cluster2, tmp_path):
    """A centered column needs the frame's mean, which reads every partition: computed
    partition by partition as members lease them, the epoch reads the frame more than
    once (docs/data.md, "Work partitions share"); persisted first, the persist reads
    each partition once and the epoch, every row once, reads none again."""
    _, client = cluster2
    parts = 8
    log = tmp_path / "reads"
    log.mkdir()
    raw = ddf.from_map(functools.partial(read_logged, log=str(log)), range(parts))
    centered = raw.assign(c=raw.a - raw.a.mean())
    for name in os.listdir(log):  # Dask's meta on the client
        os.remove(log / name)
    ds = coord.distribute_dataset(centered, global_batch_size=40, name="centered",
                                  partitions_ahead=1)
    ids = Counter(i for r in drain(coord, ds, iter(ds)) for i in r["id"])
    assert sorted(ids) == list(range(parts * ROWS)) and set(ids.values()) == {1}
    lazy = reads(log)
    print(f"the lazy frame's partitions were read {len(lazy)} times for {parts}")
    assert set(lazy) == set(range(parts)) and len(lazy) > parts
    for name in os.listdir(log):
        os.remove(log / name)
    persisted = client.persist(centered)
    ds = coord.distribute_dataset(persisted, global_batch_size=40, name="persisted-mean")
    ids = Counter(i for r in drain(coord, ds, iter(ds)) for i in r["id"])
    assert sorted(ids) == list(range(parts * ROWS)) and set(ids.values()) == {1}
    assert reads(log) == list(range(parts))  # the persist's reads, and no more
    del persisted


def test_sync_training_on_a_frame_every_row_once_in_the_committed_state(coord):
    n = PARTS * ROWS
    coord.collective_group(timeout=30)
    state = coord.create_per_worker_resource(functools.partial(make_counts, n=n))
    ds = coord.distribute_dataset(lazy_frame(), global_batch_size=40, shuffle=True,
                                  name="synced", prefetch=0)
    it = iter(ds)
    deadline = time.monotonic() + 120
    while not ds.progress()["complete"]:
        assert time.monotonic() < deadline, ds.progress()
        coord.fetch(coord.schedule_on_all(train_rows, args=(state, it)))
    assert_every_row_once(coord.fetch(coord.schedule_on_all(final_counts, args=(state,))), n)


@pytest.mark.slow
def test_a_member_killed_mid_epoch_every_row_once():
    from distributed import Client

    with make_cluster(3, threads=THREADS) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="killed")
        wait_for_workers(client, coord, 3)
        ds = coord.distribute_dataset(lazy_frame(PARTS * 2, pause=0.02),
                                      global_batch_size=30, name="killed")
        it = iter(ds)
        killed = []

        def kill_one(round_):
            if round_ == 3 and not killed:
                pids = client.run(os.getpid, on_error="ignore")
                victim = sorted(pids.values())[0]
                killed.append(sigkill(victim))

        got = drain(coord, ds, it, pause=0.01, on_round=kill_one, deadline=180)
        assert killed and coord.status()["worker_leaves"] >= 1
        ids = Counter(i for r in got for i in r["id"])
        assert sorted(ids) == list(range(PARTS * 2 * ROWS))
        assert set(ids.values()) == {1}, "a row was trained by two completed closures"
        coord.close()


def test_resources_make_only_those_workers_members():
    with gpu_and_plain_cluster(THREADS) as (cluster, client, members, cpu):
        coord = dd.Coordinator(client, name="gpus", resources={"GPU": 1})
        wait_until(lambda: coord.status()["workers"] == 2, 60, "the two GPU workers")
        with pytest.raises(ValueError, match="resources"):
            dd.Coordinator(client, name="gpus", resources={"GPU": 2})
        group = coord.collective_group(timeout=30)
        assert set(group.members) <= members and group.world_size == 2
        ds = coord.distribute_dataset(lazy_frame(pause=0.02), global_batch_size=40)
        got = drain(coord, ds, iter(ds))
        assert {r["worker"] for r in got} == members  # closures ran only on members
        ids = Counter(i for r in got for i in r["id"])
        assert sorted(ids) == list(range(PARTS * ROWS)) and set(ids.values()) == {1}
        # the plain worker computed the partitions for them: preferred, a loose restriction
        # (a cluster whose helpers die still trains), so on a loaded machine Dask may move
        # a few to the members
        made = Counter(w for r in got for w in r["made_on"])
        assert set(made) <= members | {cpu} and made[cpu] >= 0.75 * sum(made.values()), made
        ranks = coord.fetch(coord.schedule_on_all(
            lambda: dd.get_worker_context().address))
        assert set(ranks) == members and len(ranks) == 2  # the group: only the two
        coord.close()

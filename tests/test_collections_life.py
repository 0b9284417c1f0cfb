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
from daskdist.core.leases.partitions import STRIDE  # noqa: E402
from tests.conftest import (  # noqa: E402
    gpu_and_plain_cluster,
    make_cluster,
    wait_for_workers,
    wait_until,
)

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


def gated_part(i: int, gate: str, log: str, rows: int = ROWS, first: int = 0) -> pd.DataFrame:
    """Partition ``i``; from partition ``first`` on, computed only once the file ``gate``
    exists (a slow partition, for at most 120 s). Its start is logged as
    :func:`counted_part` logs."""
    try:
        from distributed import get_worker

        get_worker()
        with open(log, "a") as f:
            f.write(f"{i}\n")
        end = time.monotonic() + 120
        while i >= first and not os.path.exists(gate) and time.monotonic() < end:
            time.sleep(0.05)
    except ValueError:
        pass
    return pd.DataFrame({"id": np.arange(rows, dtype=np.int64) + i * rows,
                         "x": np.full(rows, float(i), dtype=np.float32)})


def daskdist_threads(client) -> dict[str, list[str]]:
    """Per worker, the names of its live threads that daskdist started."""
    import threading

    def names():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("daskdist"))

    return client.run(names)


def no_threads(client, prefix: str = "daskdist") -> bool:
    return not any(n.startswith(prefix) for names in daskdist_threads(client).values()
                   for n in names)


@pytest.mark.timeout(300)
def test_close_while_partitions_compute_ends_at_once_and_leaves_nothing(cluster2, tmp_path):
    _, client = cluster2
    gate, log = str(tmp_path / "gate"), str(tmp_path / "computed.log")
    # meta given: without it Dask computes partition 0 on the cluster to learn it, and
    # partition 0 waits for the gate (the whole 120 s)
    frame = ddf.from_map(functools.partial(gated_part, gate=gate, log=log), range(PARTS),
                         meta=gated_part(0, gate, log).iloc[:0])
    coord = dd.Coordinator(client, name="close-in-flight")
    wait_for_workers(client, coord, 2)
    ds = coord.distribute_dataset(frame, global_batch_size=2 * ROWS, name="gated")
    it = iter(ds)
    rvs = [coord.schedule(take_ids, args=(it,)) for _ in range(4)]  # wait for batches
    wait_until(lambda: len(computed(log)) >= 2, 60, "partitions to start computing")
    coord.close()  # the computes cannot finish: the gate is shut
    for rv in rvs:
        with pytest.raises(dd.CancelledError):
            rv.fetch()
    # the loaders' prefetch threads, the sessions' closers and the runners go now, while
    # the partitions they asked for are still computing
    try:
        wait_until(lambda: no_threads(client), 60, "no daskdist thread on the workers")
    except AssertionError as e:
        raise AssertionError(f"{e}: {daskdist_threads(client)}") from None
    assert not os.path.exists(gate)
    open(gate, "w").close()  # the computes end; nobody wants their results
    wait_until(lambda: not busy(client), 60, "Dask to forget every partition")
    del ds, it


@pytest.mark.timeout(300)
def test_a_handle_dropped_mid_epoch_leaves_no_future_key_or_thread(cluster2, tmp_path):
    import gc

    _, client = cluster2
    gate, log = str(tmp_path / "gate"), str(tmp_path / "computed.log")
    frame = ddf.from_map(functools.partial(gated_part, gate=gate, log=log, first=1),
                         range(PARTS))
    coord = dd.Coordinator(client, name="dropped-mid-epoch")
    wait_for_workers(client, coord, 2)
    ds = coord.distribute_dataset(frame, global_batch_size=2 * ROWS, name="dropped")
    dataset_id = ds.dataset_id
    it = iter(ds)
    # one batch (partition 0, the only one computed at once); that worker's loader then
    # waits for the next partitions it leased, which cannot finish: the gate is shut
    assert coord.fetch(coord.schedule(take_ids, args=(it,))) == list(range(ROWS))
    wait_until(lambda: len(computed(log)) >= 3, 60, "partitions to start computing")
    assert no_threads(client, "daskdist-prefetch") is False
    del ds, it  # the handles go mid-epoch
    gc.collect()
    coord._release_now()
    # the loader stops waiting for its partitions, its prefetch thread ends
    try:
        wait_until(lambda: no_threads(client, "daskdist-prefetch"), 60,
                   "the dropped loader's prefetch thread to end")
    except AssertionError as e:
        raise AssertionError(f"{e}: {daskdist_threads(client)}") from None
    assert not os.path.exists(gate)
    assert not coord._call("daskdist_lease_progress", dataset_id=dataset_id,
                           epoch=0)["known"]  # the lease table forgot the dataset
    open(gate, "w").close()
    wait_until(lambda: not busy(client), 60, "Dask to forget every partition")
    coord.close()
    wait_until(lambda: no_threads(client), 60, "no daskdist thread on the workers")


def test_two_epochs_then_close_leave_no_future_key_or_thread(cluster2, tmp_path):
    _, client = cluster2
    log = str(tmp_path / "computed.log")
    coord = dd.Coordinator(client, name="two-epochs")
    wait_for_workers(client, coord, 2)
    ds = coord.distribute_dataset(counted_frame(log, pause=0.01), global_batch_size=2 * ROWS,
                                  shuffle=True, name="twice")
    it = iter(ds)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        it = iter(ds)
        got: list[int] = []
        deadline = time.monotonic() + 120
        while not ds.progress()["complete"]:
            assert time.monotonic() < deadline, ds.progress()
            got += [i for r in coord.fetch([coord.schedule(take_ids, args=(it,))
                                            for _ in range(4)]) if r for i in r]
        assert sorted(got) == list(range(PARTS * ROWS)), f"epoch {epoch}"
        # between epochs nothing the loaders computed stays on the cluster
        wait_until(lambda: not busy(client), 60, f"Dask to forget epoch {epoch}'s partitions")
    assert len(computed(log)) >= 2 * PARTS
    coord.close()
    wait_until(lambda: no_threads(client), 60, "no daskdist thread on the workers")
    assert not busy(client)
    del ds, it


def test_the_worker_computing_the_partitions_killed_mid_epoch_every_row_once(tmp_path):
    """Members that train (GPU=1) and a plain worker that computes their partitions:
    SIGKILL the plain worker while it computes; Dask computes them again (on the members
    or its replacement), every row once, nothing left."""
    import signal

    log = str(tmp_path / "computed.log")
    with gpu_and_plain_cluster(THREADS) as (cluster, client, members, cpu):
        coord = dd.Coordinator(client, name="helper-killed", resources={"GPU": 1})
        wait_until(lambda: coord.status()["workers"] == 2, 60, "the two GPU workers")
        parts = 2 * PARTS
        ds = coord.distribute_dataset(counted_frame(log, parts, pause=0.1),
                                      global_batch_size=2 * ROWS, name="helped")
        it = iter(ds)
        got: list[int] = []
        killed = False
        deadline = time.monotonic() + 180
        while not ds.progress()["complete"]:
            assert time.monotonic() < deadline, ds.progress()
            got += [i for r in coord.fetch([coord.schedule(take_ids, args=(it,))
                                            for _ in range(4)]) if r for i in r]
            if not killed and len(got) >= parts * ROWS // 4:
                pid = client.run(os.getpid, workers=[cpu])[cpu]
                os.kill(pid, signal.SIGKILL)  # while it computes the next partitions
                killed = True
        assert killed
        ids = Counter(got)
        assert sorted(ids) == list(range(parts * ROWS)) and set(ids.values()) == {1}
        wait_until(lambda: not busy(client), 60, "Dask to forget every partition")
        coord.close()
        wait_until(lambda: no_threads(client), 60, "no daskdist thread on the workers")



def slow_when_recomputed(mark: str) -> int:
    """At once the first time, 3 s each time Dask computes it again."""
    if os.path.exists(mark):
        time.sleep(3.0)
    else:
        open(mark, "w").close()
    return 1


def test_a_lost_partition_is_awaited_without_polling(tmp_path):
    """A partition computed on a worker that is then SIGKILLed: its future goes "lost"
    while Dask computes it again (3 s). A loader's wait for it (data/collections/compute.py
    ``settled``) sleeps on the future's own state meanwhile: this process stays idle
    (a wait that woke at once for a lost future, over and over, would keep a core busy)."""
    import signal
    import threading

    from distributed import Client

    from daskdist.data.collections.compute import Interrupt, settled

    with make_cluster(2, threads=1) as cluster, Client(cluster) as client:
        a = sorted(client.scheduler_info()["workers"])[0]
        fut = client.submit(slow_when_recomputed, str(tmp_path / "mark"), workers=[a],
                            allow_other_workers=True, pure=False)
        assert fut.result(timeout=60) == 1
        os.kill(client.run(os.getpid, workers=[a])[a], signal.SIGKILL)
        wait_until(lambda: fut.status == "lost", 30, "the future to be lost")
        cpu0, t0 = time.process_time(), time.monotonic()
        done = threading.Event()
        waiter = threading.Thread(
            target=lambda: (Interrupt().wait(settled(fut, client.loop)), done.set()))
        waiter.start()
        assert done.wait(60), "the wait never ended"
        waited, used = time.monotonic() - t0, time.process_time() - cpu0
        assert fut.status == "finished" and fut.result(timeout=30) == 1
        assert waited >= 1.0, waited  # it waited for the recomputation
        assert used < 0.3 * waited, (used, waited)  # asleep, not polling
        # an interrupt ends such a wait at once
        os.kill(client.run(os.getpid, workers=[fut_where(client, fut)])[
            fut_where(client, fut)], signal.SIGKILL)
        wait_until(lambda: fut.status == "lost", 30, "the future to be lost again")
        stop = Interrupt()
        threading.Timer(0.2, stop.interrupt).start()
        t0 = time.monotonic()
        with pytest.raises(Exception, match="") as e:
            stop.wait(settled(fut, client.loop))
        assert type(e.value).__name__ == "Interrupted" and time.monotonic() - t0 < 2.0


def fut_where(client, fut) -> str:
    """The worker holding ``fut``'s result now."""
    return client.who_has([fut])[fut.key][0]

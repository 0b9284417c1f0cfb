"""A fence in the middle of a read: a worker SIGSTOPped past its lease while its loader's
producer is decoding, then SIGCONTed.

The scheduler ends the stopped worker's session; its closures and leased rows go to the
others. When the worker wakes, everything its old session owned must go with that
session: calls made by its closures are refused (they could otherwise lease or release
rows under the new session), its loaders are closed, and their producer threads and open
files are gone. Every row of the epoch is still delivered to exactly one completed
closure, with 2 threads per worker.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import dask
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

import daskdist as dd
from tests.conftest import make_cluster, take_rows, wait_for_workers, wait_until, worker_pids

pytestmark = pytest.mark.timeout(240)

LEASE = 3.0  # seconds of silence before the scheduler ends a session
READ = 0.4  # seconds each row-group read takes on the workers (a slow disk)
FILES, GROUPS, ROWS = 4, 6, 100  # 2400 rows in 24 row groups
TOTAL = FILES * GROUPS * ROWS
WORKERS = 3


def slow_reads(seconds: float) -> None:
    """Make every row-group read on this worker take ``seconds`` longer (a slow disk)."""
    from daskdist.data.files.arrow import UnitReader

    read = getattr(UnitReader.read, "__wrapped__", UnitReader.read)

    def slow(self, unit, columns):
        time.sleep(seconds)
        return read(self, unit, columns)

    slow.__wrapped__ = read
    UnitReader.read = slow


def loader_threads() -> dict[int, str]:
    """This worker's loader threads (prefetch producers, shuffle builders, closers)."""
    return {t.ident: t.name for t in threading.enumerate()
            if t.name.startswith(("daskdist-prefetch", "daskdist-block", "daskdist-close"))}


def open_shards() -> list[str]:
    """The Parquet files this worker process holds open (fds and memory maps)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(".parquet"):
            out.append(target)
    with open("/proc/self/maps") as f:
        out += [line.split()[-1] for line in f if line.rstrip().endswith(".parquet")]
    return out


STARTED: list[float] = []  # in each worker process: napping closures that started


def nap_then_take(it, nap: float, batches: int, victim: int) -> list[int]:
    """Nap (the closure's work: the victim is stopped during it), then take up to
    ``batches`` batches. On the victim, woken, first wait until its session has ended
    (the scheduler fenced it and the worker registered a new one): a closure of an
    ended session that goes on reading."""
    STARTED.append(time.time())
    time.sleep(nap)
    if os.getpid() == victim:
        from daskdist.session.scope import session_services

        services = session_services()  # this closure's session, not the worker's new one
        deadline = time.monotonic() + 120
        while not services.ended and time.monotonic() < deadline:
            time.sleep(0.01)  # a condition with a deadline: the re-registration ends it
        assert services.ended, "the woken worker's session was never replaced"
    out: list[int] = []
    for _ in range(batches):
        try:
            out += next(it)["rid"].tolist()
        except StopIteration:
            break
    return out


def napping(dask_worker) -> int:
    return len(STARTED)


def session_of(dask_worker, name):
    from daskdist.core.protocol import worker_plugin_name

    return dask_worker.plugins[worker_plugin_name(name)].runner.session_id


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("fence-shards")
    for f in range(FILES):
        ids = np.arange(f * GROUPS * ROWS, (f + 1) * GROUPS * ROWS, dtype=np.int64)
        pq.write_table(pa.table({"rid": ids, "x": ids.astype(np.float32)}),
                       root / f"part-{f}.parquet", row_group_size=ROWS)
    return str(root)


def test_a_fence_mid_read_closes_the_old_sessions_loaders(shards):
    with dask.config.set({"daskdist.liveness.renew-interval": "250ms"}), \
            make_cluster(WORKERS, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="fence", lease_timeout=LEASE)
        wait_for_workers(client, coord, WORKERS)
        client.run(slow_reads, READ)
        ds = coord.distribute_dataset(shards, global_batch_size=3 * 30, policy="dynamic",
                                      shuffle=True, prefetch=4)
        it = iter(ds)
        rows: list[int] = []

        def round_(n=6):
            batches = coord.fetch([coord.schedule(take_rows, args=(it, 0.05))
                                   for _ in range(n)])
            rows.extend(r for b in batches for r in b)

        round_()  # every worker's loader is producing now
        pids = worker_pids(client)
        victim_addr = sorted(pids)[1]
        victim = pids[victim_addr]

        def producing(dask_worker):
            return open_shards() and any(n.startswith("daskdist-prefetch")
                                         for n in loader_threads().values())

        # polled: on a fast machine a producer may sit between two files for a moment
        wait_until(lambda: client.run(producing, workers=[victim_addr])[victim_addr], 30,
                   "the victim's producer reading a shard")
        before = client.run(loader_threads, workers=[victim_addr])[victim_addr]
        old_session = client.run(session_of, name="fence", workers=[victim_addr])[victim_addr]
        assert before

        # closures in flight (napping), the producer mid-read: stop the worker past its
        # lease. When it wakes, its napping closures read on from the old iterator: past
        # what was prefetched they would lease rows, which must be refused
        rvs = [coord.schedule(nap_then_take, args=(it, 1.0, 8, victim))
               for _ in range(2 * WORKERS)]
        wait_until(lambda: client.run(napping, workers=[victim_addr])[victim_addr] >= 1, 30,
                   "a closure napping on the victim")
        os.kill(victim, signal.SIGSTOP)
        try:
            wait_until(lambda: coord.status()["lease_expiries"] >= 1, LEASE + 30,
                       "the stopped worker's session to expire")
            rows.extend(r for b in coord.fetch(rvs) for r in b)  # completed elsewhere
        finally:
            os.kill(victim, signal.SIGCONT)

        # it wakes, its old session is refused, and it registers a new one
        wait_until(lambda: client.run(session_of, name="fence", workers=[victim_addr])
                   [victim_addr] not in ("", old_session), 30, "the woken worker's new session")

        def old_gone(dask_worker, old=tuple(before)):
            alive = loader_threads()
            return not (set(old) & set(alive)) and not open_shards()

        # no closure ran on the new session yet: no loader of it is open either
        wait_until(lambda: client.run(old_gone, workers=[victim_addr])[victim_addr], 30,
                   "the old session's producer threads and open files to go")

        deadline = time.monotonic() + 120
        while not ds.progress()["complete"]:
            assert time.monotonic() < deadline, ds.progress()
            round_()
        counts = Counter(rows)
        assert sorted(counts) == list(range(TOTAL)), "rows never delivered"
        assert set(counts.values()) == {1}, "rows delivered twice"
        p = ds.progress()
        assert p["acknowledged"] == TOTAL and p["leased"] == 0
        assert coord.status()["acks_refused"] == 0
        coord.close()


def wait_then_ask(marker: str) -> str:
    """Runs until the test ended this worker's session on the scheduler, then asks the
    scheduler something as that session: the reply says the session ended."""
    from daskdist.session.scope import session_services

    deadline = time.monotonic() + 60
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, "the session was never ended"
        time.sleep(0.01)
    try:
        session_services().state_commits("probe")
        out = "live"
    except dd.CollectiveError as e:
        out = str(e)
    with open(marker + ".log", "a") as f:
        f.write(out + "\n")
    return out


def quick(i: int) -> int:
    return i


def runner_slots(dask_worker) -> tuple:
    from daskdist.core.protocol import worker_plugin_name

    r = dask_worker.plugins[worker_plugin_name("slots")].runner
    return r.taken, r.gangs, len(r.started())


def test_a_fenced_session_frees_the_slots_of_closures_it_did_not_run(tmp_path):
    """The scheduler ends a worker's session while it runs a closure and holds others
    prefetched: the closure's thread then finds the next one's session ended and does
    not run it; that closure's slot is free again (never taken for good, the worker
    taking one closure less for ever after), and every closure completes
    once the worker has a new session."""
    marker = str(tmp_path / "ended")
    with make_cluster(1, threads=1) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="slots")
        wait_for_workers(client, coord, 1)
        first = coord.schedule(wait_then_ask, args=(marker,))
        rest = [coord.schedule(quick, args=(i,)) for i in range(8)]
        (addr,) = client.scheduler_info()["workers"]
        wait_until(lambda: client.run(runner_slots, workers=[addr])[addr][2] == 1, 30,
                   "the first closure running, the others prefetched")

        def end(dask_scheduler):
            co = dask_scheduler.extensions["daskdist"].coordinators["slots"]
            co.end_session(co.members.session_of(addr), expected=False)

        client.run_on_scheduler(end)
        open(marker, "w").close()
        # its first run found its session ended (its result dropped); it ran again
        assert first.fetch(timeout=60) == "live"
        assert "ended" in open(marker + ".log").read().splitlines()[0]
        assert [rv.fetch(timeout=60) for rv in rest] == list(range(8))
        wait_until(lambda: client.run(runner_slots, workers=[addr])[addr] == (0, 0, 0), 30,
                   "every slot free once nothing runs")
        coord.close()

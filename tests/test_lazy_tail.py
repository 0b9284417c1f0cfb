"""The tail of a ``"dynamic"`` epoch over a lazy dask DataFrame (partition lengths unknown
until computed) read by per-worker iterators to their end, with no acknowledgement
meanwhile (no ``State.commit``): every partition is leased and every row read once, in
the first epoch and in the next (lengths known then), with no prefetch thread left.

Rows a loader read stay leased to its session until the closure that took them
completes; the tail rule must not count them as partitions the loader holds to read,
and a lease refused while a pass still has reads planned must not end the pass, or the
epoch's last partitions (``2 * members - 1`` of them) are left to no iterator."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest

pd = pytest.importorskip("pandas")
ddf = pytest.importorskip("dask.dataframe")

import daskdist as dd  # noqa: E402
from daskdist.context import InputContext  # noqa: E402
from daskdist.core.leases import resume  # noqa: E402
from daskdist.core.leases.partitions import STRIDE  # noqa: E402
from daskdist.core.leases.table import LeaseTable  # noqa: E402
from daskdist.data import ArrowLoader, LocalLeaseService  # noqa: E402
from tests.conftest import THREADS, make_cluster, wait_for_workers, wait_until  # noqa: E402
from tests.tables import check_leases, define_collection  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DS = "lazy"
PARTS, ROWS = 90, 10  # 900 rows


def slow_part(df: pd.DataFrame) -> pd.DataFrame:
    """A partition that takes a while to compute (its length is learned then)."""
    time.sleep(0.05)
    return df


def lazy_frame(parts: int = PARTS, rows: int = ROWS, pause: bool = True):
    """``parts`` partitions of ``rows`` rows, column ``id`` the row's global id; lengths
    unknown to the loader (a DataFrame's partitions are counted only by computing)."""
    n = parts * rows
    frame = ddf.from_pandas(pd.DataFrame({"id": np.arange(n, dtype=np.int64),
                                          "x": np.arange(n, dtype=np.float32)}),
                            npartitions=parts)
    return frame.map_partitions(slow_part) if pause else frame


# -- the lease table ---------------------------------------------------------------------
def lease_tail(t: LeaseTable, session: str, parts: int = 3):
    """A lease as the scheduler's collection handler asks it."""
    return t.acquire(session, DS, 0, 1, parts=parts, least=1, tail=True)


@pytest.mark.parametrize("known", [False, True])
def test_partitions_read_and_not_acknowledged_hold_no_member_back(known):
    """At the tail (five of twenty partitions free for three members) a member that read
    every partition it leased, none acknowledged yet, is leased the next; one holding
    two it has not read waits, until it reads one."""
    t = LeaseTable()
    define_collection(t, DS, 20, runs=[(ROWS, 20)] if known else None, label="lazy")
    first = (lambda u: u * STRIDE) if not known else (lambda u: u * ROWS)
    for u, m in enumerate("abcbcbcbcbcacac"):  # a reads 3, b and c 6 each (under a share)
        assert lease_tail(t, m)[0][0] == first(u)
        assert resume.set_length(t, m, DS, 0, u, ROWS) is None  # read, not acknowledged
    assert not t.holds_share("a", DS, 0, 3)
    assert lease_tail(t, "a")[0][0] == first(15)  # holds nothing to read
    assert lease_tail(t, "a")[0][0] == first(16)  # one to read, one ahead
    assert t.holds_share("a", DS, 0, 3) and lease_tail(t, "a") is None  # two unread: waits
    assert lease_tail(t, "b")[0][0] == first(17)  # a member with none to read
    assert resume.set_length(t, "a", DS, 0, 15, ROWS) is None
    assert lease_tail(t, "a")[0][0] == first(18)
    check_leases(t)


@pytest.mark.parametrize("known", [False, True])
@pytest.mark.parametrize("members", [2, 3])
def test_members_reading_to_the_end_unacknowledged_lease_every_partition(known, members):
    """Members read as a loader's pass does (up to three partitions planned, each read
    reported, a lease asked after each read; a refusal ends a member's pass only when it
    had nothing left to read) and acknowledge nothing: every partition is leased once."""
    t = LeaseTable()
    define_collection(t, DS, PARTS, runs=[(ROWS, PARTS)] if known else None, label="lazy")
    unit_of = (lambda a: a // STRIDE) if not known else (lambda a: a // ROWS)
    planned: dict[str, list[int]] = {f"m{i}": [] for i in range(members)}
    read: Counter = Counter()
    done: set[str] = set()
    while len(done) < members:
        for m, plan in planned.items():
            if m in done:
                continue
            while len(plan) < 3:
                lease = lease_tail(t, m, members)
                if lease is None:
                    break
                plan.extend(unit_of(a) for a, _ in lease)
            if not plan:  # asked with nothing left to read, and refused
                done.add(m)
                continue
            u = plan.pop(0)
            assert resume.set_length(t, m, DS, 0, u, ROWS) is None
            read[u] += 1
    assert read == Counter(range(PARTS))
    p = t.progress(DS, 0)
    assert (p["free"], p["leased"], p["total"], p["known"]) == (0, PARTS * ROWS,
                                                                PARTS * ROWS, True)
    check_leases(t)


# -- loaders in one process, leasing as the scheduler's handler does -----------------------
class TailLeases(LocalLeaseService):
    """An in-process lease service that leases as the scheduler's handler asks: the tail
    rule on, ``parts`` members sharing the epoch."""

    def __init__(self, table: LeaseTable, session: str, lock: threading.Lock,
                 parts: int) -> None:
        super().__init__(table, session, lock)
        self.parts = parts

    def acquire(self, dataset_id, epoch, rows, least=1, rate=None):
        with self._lock:
            return self.table.acquire(self.session, dataset_id, epoch, rows,
                                      parts=self.parts, least=least, tail=True, rate=rate)


@pytest.mark.parametrize("members", [2, 3])
def test_per_member_loaders_read_every_row_once_before_their_iterators_end(members):
    """One loader per member over one table, taken in turns to each one's end, nothing
    acknowledged: together they yield every row of the lazy frame exactly once."""
    table, lock = LeaseTable(), threading.Lock()
    frame = lazy_frame(pause=False)
    its = {}
    for i in range(members):
        svc = TailLeases(table, f"m{i}", lock, members)
        ld = ArrowLoader(frame, InputContext(services=svc, dataset_id=DS),
                         batch_size=ROWS, policy="dynamic", name="lazy")
        its[i] = iter(ld)
    ids: Counter = Counter()
    while its:
        for i in list(its):
            try:
                ids.update(its[i].__next__()["id"].tolist())
            except StopIteration:
                its.pop(i).close()
    assert ids == Counter(range(PARTS * ROWS))


# -- a real cluster: per-worker iterators in gang closures ---------------------------------
def read_to_end(it) -> list[int]:
    """Each member's iterator to its end; then a barrier, so no closure ends (its rows,
    never acknowledged, going back to the pool) while another member still reads."""
    ids = [int(v) for batch in it for v in batch["id"]]
    dd.collective.get_group().barrier()
    return ids


def prefetch_threads() -> list[str]:
    """This process's loaders' prefetch threads still running."""
    return [t.name for t in threading.enumerate() if t.name.startswith("daskdist-prefetch")]


@pytest.mark.parametrize("threads", THREADS)
def test_per_worker_iterators_over_a_lazy_frame_read_every_row_once(threads):
    from distributed import Client

    with make_cluster(3, threads=threads) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name=f"lazy-tail-{threads}")
        try:
            wait_for_workers(client, coord, 3)
            coord.collective_group(timeout=30)
            ds = coord.distribute_dataset(lazy_frame(), global_batch_size=3 * ROWS,
                                          policy="dynamic", name="lazy")
            for epoch in range(2):  # the second epoch: lengths known, loaders reused
                ds.set_epoch(epoch)
                per_worker = coord.fetch(coord.schedule_on_all(read_to_end,
                                                               args=(iter(ds),)))
                assert len(per_worker) == 3
                ids = Counter(i for rows in per_worker for i in rows)
                assert ids == Counter(range(PARTS * ROWS)), (
                    f"epoch {epoch}: missing "
                    f"{sorted(set(range(PARTS * ROWS)) - set(ids))[:20]}, "
                    f"twice {sorted(i for i, n in ids.items() if n > 1)[:20]}")
                # (a gang's rows are acknowledged by its commits: none here, so the
                # epoch's rows go back to the pool when the closures end)
                p = ds.progress(epoch)
                assert (p["units_known"], p["known"], p["total"]) == (PARTS, True,
                                                                      PARTS * ROWS)
            # iterators read to their end leave no prefetch thread behind
            wait_until(lambda: not any(client.run(prefetch_threads).values()), 10,
                       "the prefetch threads of iterators read to their end ended")
        finally:
            coord.close()

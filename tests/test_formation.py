"""Group formation has a deadline: a member that answers nothing while
the group forms (SIGSTOPped) is fenced by its lease, and the group forms without it,
instead of waiting for Dask's 5-minute worker-ttl. Rank 0 is the stopped one: the
formation's first RPC (rank 0 opening the rendezvous store) is the one that hangs."""

from __future__ import annotations

import os
import signal
import time

import dask
import pytest
from distributed import Client

import daskdist as dd
from tests.conftest import THREADS, make_cluster, wait_for_workers, wait_until, worker_pids

pytestmark = pytest.mark.timeout(240)

LEASE = 3.0  # seconds of silence before the scheduler ends a session


def rank_and_world():
    g = dd.collective.get_group()
    return g.rank, g.world_size, os.getpid()


def _address_of_index(name: str, index: int):
    def find(dask_scheduler):
        co = dask_scheduler.extensions["daskdist"].coordinators[name]
        return next(m.address for m in co.members.members.values() if m.index == index)

    return find


@pytest.mark.parametrize("threads", THREADS)
def test_a_sigstopped_rank_0_is_fenced_and_the_group_forms_without_it(threads):
    with dask.config.set({"daskdist.liveness.lease-timeout": f"{LEASE}s"}), \
            make_cluster(3, threads=threads) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="stopped-rank-0")
        try:
            wait_for_workers(client, coord, 3)
            rank0 = client.run_on_scheduler(_address_of_index("stopped-rank-0", 0))
            victim = worker_pids(client)[rank0]
            os.kill(victim, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                group = coord.collective_group(backend="gloo", timeout=30)
                formed = time.monotonic() - t0
                assert group.world_size == 2, group
                assert rank0 not in group.members
                ranks = coord.fetch(coord.schedule_on_all(rank_and_world))
                assert sorted(r[:2] for r in ranks) == [(0, 2), (1, 2)]
                assert victim not in {r[2] for r in ranks}
                print(f"formation with a SIGSTOPped rank 0: {formed:.2f} s "
                      f"(lease-timeout {LEASE} s)")
                # within the lease (the fence) and a formation, far below worker-ttl
                assert formed < LEASE + 30
                assert coord.status()["lease_expiries"] >= 1
            finally:
                os.kill(victim, signal.SIGCONT)
            # the woken worker rejoins as a new session; the next gang includes it
            wait_until(lambda: coord.status()["workers"] == 3, 60, "the stopped worker back")
            ranks = coord.fetch(coord.schedule_on_all(rank_and_world))
            assert sorted(r[:2] for r in ranks) == [(0, 3), (1, 3), (2, 3)]
        finally:
            coord.close()

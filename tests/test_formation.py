"""Group formation has a deadline: a member that answers nothing while
the group forms (SIGSTOPped) is fenced by its lease, and the group forms without it,
instead of waiting for Dask's 5-minute worker-ttl. Rank 0 is the stopped one: the
formation's first RPC (rank 0 opening the rendezvous store) is the one that hangs.
A re-formation whose rank 0 reported its next store's port is one round of calls, and
one whose port is no longer held forms anyway."""

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


def _formations(name: str):
    """The coordinator's group on the scheduler: generation, rank 0's session and
    address, the store ports its members reported, and its formation events."""
    def get(dask_scheduler):
        co = dask_scheduler.extensions["daskdist"].coordinators[name]
        group = co.gangs.group
        rank0 = group.sessions[0]
        return {"generation": group.generation, "rank0": rank0,
                "address": co.members.members[rank0].address,
                "ports": dict(co.group_book.driver.store_ports),
                "events": [e.kind for e in co.stats.events]}

    return get


def _held_stores() -> dict:
    from daskdist.collective import bootstrap

    with bootstrap.PROCESS.lock:
        return {g: int(s.port) for g, s in bootstrap.PROCESS.stores.items()}


@pytest.mark.parametrize("threads", THREADS)
def test_a_re_formation_opens_rank_0s_store_on_the_port_it_reported(threads):
    """Every member's join reports the port of the socket it holds for its next store; the
    next formation over the same rank 0 tells every member that port at once and rank 0
    opens its store there as it joins (one round of calls). A port that is no longer
    held (its worker left the group meanwhile, or another coordinator's store took it)
    fails that formation, which is tried again at once with the store opened first: the
    group forms, beside a second coordinator on the same workers."""
    with make_cluster(3, threads=threads) as cluster, Client(cluster) as client:
        a = dd.Coordinator(client, name="ports-a")
        b = dd.Coordinator(client, name="ports-b")
        try:
            wait_for_workers(client, a, 3)
            wait_for_workers(client, b, 3)
            a.collective_group(backend="gloo", timeout=30)
            first = client.run_on_scheduler(_formations("ports-a"))
            assert len(first["ports"]) == 3
            assert all(isinstance(p, int) and p > 0 for p in first["ports"].values())
            reported = first["ports"][first["rank0"]]

            a.collective_group(backend="gloo", timeout=30)
            second = client.run_on_scheduler(_formations("ports-a"))
            assert second["rank0"] == first["rank0"]
            held = client.run(_held_stores, workers=[second["address"]])[second["address"]]
            assert held.get(second["generation"]) == reported, (held, reported)
            assert second["ports"][second["rank0"]] != reported  # a fresh socket since
            assert "formation-failed" not in second["events"]

            # b learns the ports too; then its rank 0 leaves its group, and the socket
            # it reported with it: b's next formation names a port nobody holds
            b.collective_group(backend="gloo", timeout=30)
            before = client.run_on_scheduler(_formations("ports-b"))
            stale = before["ports"][before["rank0"]]
            client.run(dd.collective.destroy_member, workers=[before["address"]])
            b.collective_group(backend="gloo", timeout=30)
            after = client.run_on_scheduler(_formations("ports-b"))
            assert after["events"].count("formation-failed") == 1, after["events"]
            assert after["events"][-1] == "formed"
            held = client.run(_held_stores, workers=[after["address"]])[after["address"]]
            assert held.get(after["generation"]) not in (None, stale)
            ranks = b.fetch(b.schedule_on_all(rank_and_world))
            assert sorted(r[:2] for r in ranks) == [(0, 3), (1, 3), (2, 3)]
            # and a, whose group b's replaced on these workers, forms and runs again
            ranks = a.fetch(a.schedule_on_all(rank_and_world))
            assert sorted(r[:2] for r in ranks) == [(0, 3), (1, 3), (2, 3)]
        finally:
            b.close()
            a.close()

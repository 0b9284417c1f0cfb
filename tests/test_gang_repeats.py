"""A gang whose collective failure repeats fails instead of looping,
on a real LocalCluster of 3 worker processes with 2 threads each and gloo: rank 0 calls
``allreduce`` and the other ranks do not (rank-dependent control flow), so every run
times out the same way. ``fetch`` raises after ``max_worker_failures`` runs, naming
the rank and the call that failed first and saying that the failure repeats."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from distributed import Client

import daskdist as dd
from tests.conftest import make_cluster, wait_for_workers

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 3.0  # the group's timeout: each run of the divergent gang costs about this


def divergent():
    g = dd.collective.get_group()
    if g.rank == 0:  # a user's rank-dependent control flow: the others never call it
        g.allreduce(torch.ones(4, device=g.device))
    return g.rank


def agree():
    g = dd.collective.get_group()
    return g.allreduce(torch.ones(1, device=g.device)).item()


def test_a_divergent_gang_fails_naming_rank_and_call_after_the_budget():
    with make_cluster(3, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="divergent", max_worker_failures=3)
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=TIMEOUT)
        t0 = time.monotonic()
        gang = coord.schedule_on_all(divergent)
        with ThreadPoolExecutor(1) as pool, pytest.raises(dd.CollectiveError) as info:
            # a deadline for the wait, not a timing assertion: without the budget the
            # gang is re-formed and run again forever and this raises TimeoutError
            pool.submit(coord.fetch, gang).result(timeout=60 * TIMEOUT)
        took = time.monotonic() - t0
        print(f"divergent gang failed after {took:.1f} s "
              f"({took / TIMEOUT:.1f} group timeouts of {TIMEOUT:g} s)")
        text = str(info.value)
        assert "3 runs in a row" in text and "repeats" in text, text
        assert "rank 0 failed first" in text, text
        assert "allreduce" in text and "on rank 0" in text, text  # the call that failed
        assert not info.value.transient
        with pytest.raises(dd.CollectiveError, match="repeats"):
            coord.join()  # TensorFlow's semantics: the next join raises it too, once
        # the group is usable after it: the next gang runs on every member
        assert coord.fetch(coord.schedule_on_all(agree)) == [3.0, 3.0, 3.0]
        assert coord.status()["workers_lost"] == 0
        coord.close()


@pytest.mark.parametrize("call", ["allreduce", "broadcast", "allgather"])
def test_a_cpu_tensor_handed_to_nccl_is_the_callers_error(call):
    """On GPUs the same loop came from a CPU tensor passed to an NCCL collective: it is
    refused as a ``ValueError`` (a user error fails the gang at once) before torch sees
    it, never turned into a transient ``CollectiveError``. Checked without CUDA: the
    refusal comes before any transport call."""
    from daskdist.collective.group import Group

    g = Group.__new__(Group)  # a member's view, as a formed NCCL group gives it
    g.rank, g.world_size, g.generation, g.backend = 0, 2, 1, "nccl"
    g.device, g.timeout, g._pg = torch.device("cuda", 0), 5.0, None
    with pytest.raises(ValueError, match="NCCL collectives take CUDA tensors"):
        getattr(g, call)(torch.ones(2))

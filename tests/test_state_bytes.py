"""A State's host bytes per rank (``State.commit_bytes``): one copy of the state while no
commit is in flight, a second one only while one is (a ``"dynamic"`` dataset's commit,
whose outcome comes at the next commit: until then ``restore()`` goes back to the
committed copy). Real LocalCluster of 3 worker processes (1 and 2 threads), gloo, a
dynamic epoch trained with the gradient allreduce carrying the commit heads: every
row once."""

from __future__ import annotations

import functools

import pytest
import torch
from distributed import Client

import daskdist as dd
from tests.conftest import THREADS, make_cluster, wait_for_workers
from tests.framework_rows import write_rows
from tests.row_ledger import assert_every_row_once, final_grad_counts, make_grad_counts

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]

N_ROWS = 900


def held_bytes(state, it) -> tuple[int, list[int], int, int]:
    """A synced epoch with a commit per step: the State's host bytes after its sync,
    after each commit, and after a restore settled the last commit; and the bytes of one
    copy of its state (the row counts, float32)."""
    state.sync()
    synced = state.commit_bytes
    model, opt = state.model, state.optimizer
    during = []
    for batch in dd.collective.synced(it):
        opt.zero_grad()
        c = torch.bincount(batch["id"], minlength=model.counts.numel()).float()
        (-(model.counts * c).sum()).backward()
        dd.collective.allreduce_gradients(model, average=False)
        opt.step()
        state.commit()
        during.append(state.commit_bytes)
    state.restore()  # the last commit's outcome settles: nothing is in flight
    return synced, during, state.commit_bytes, model.counts.numel() * 4


@pytest.mark.parametrize("threads", THREADS)
def test_one_host_copy_and_a_second_only_while_a_commit_is_in_flight(threads, tmp_path):
    shards = write_rows(tmp_path, N_ROWS, files=3)
    with make_cluster(3, threads=threads) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="bytes")
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=30)
        state = coord.create_per_worker_resource(functools.partial(make_grad_counts,
                                                                   n=N_ROWS))
        ds = coord.distribute_dataset(shards, global_batch_size=60, policy="dynamic",
                                      prefetch=0)
        it = iter(ds)
        runs = 0
        while not ds.progress()["complete"]:  # a gang ends when the epoch's rows do
            out = coord.fetch(coord.schedule_on_all(held_bytes, args=(state, it)))
            runs += 1
            assert runs <= 5, ds.progress()
            for synced, during, settled, copy in out:
                assert synced == copy  # one copy of the state
                # a commit in flight: the committed copy and the commit's own, no more
                assert during and set(during) == {2 * copy}, (during, copy)
                assert settled == copy  # settled: the second copy went
        assert_every_row_once(
            coord.fetch(coord.schedule_on_all(final_grad_counts, args=(state,))), N_ROWS)
        coord.close()

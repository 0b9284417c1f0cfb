"""A training job for the durable-commit tests (tests/test_checkpoint.py): run as
``python -m tests.checkpoint_job URL DATA WORKERS``, it trains the row-count ledger (a
State whose ``counts`` gains each committed step's batch ids) on a dynamic epoch with
``checkpoint_to(URL, every=EVERY)``, on a LocalCluster of its own, until it is killed
or the epoch completes. Its functions are also the tests' own (pickled by reference).
"""

from __future__ import annotations

import sys

import daskdist as dd
from tests.processes import use_fork_server
from tests.row_ledger import final_counts, make_counts, train_rows

__all__ = ["BATCH", "EVERY", "N_ROWS", "MakeCounts", "final_counts", "train_rows"]

N_ROWS = 3000
EVERY = 4
BATCH = 60  # rows of a step, over all ranks


class MakeCounts:
    """A row-count State (tests/row_ledger.py) checkpointed to ``url`` every EVERY."""

    def __init__(self, url: str, every: int = EVERY):
        self.url, self.every = url, every

    def __call__(self, ctx):
        return make_counts(ctx, N_ROWS).checkpoint_to(self.url, every=self.every)


def main(url: str, data: str, workers: int) -> None:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=workers, threads_per_worker=2, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="job")
        coord.wait_for_workers(workers, timeout=120)
        coord.collective_group(timeout=60)
        state = coord.create_per_worker_resource(MakeCounts(url))
        ds = coord.distribute_dataset(data, global_batch_size=BATCH, policy="dynamic",
                                      shuffle=True, seed=3, prefetch=0, name="train")
        it = iter(ds)
        print("training", flush=True)
        while not ds.progress()["complete"]:
            coord.fetch(coord.schedule_on_all(train_rows, args=(state, it, 0.1)))
        print("complete", flush=True)


if __name__ == "__main__":
    use_fork_server("tests.checkpoint_job")  # its workers fork with this module imported
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

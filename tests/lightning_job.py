"""What the Lightning tests train (pickled by reference), and a job for the durable
checkpoint test: ``python -m tests.lightning_job URL DATA N WORKERS LOGDIR`` fits
:class:`RowModule` with ``DaskdistStrategy(checkpoint_to=URL, every=EVERY)`` over a
dynamic epoch named ``NAME`` on a LocalCluster of its own, until it is killed or the
epoch completes.
"""

from __future__ import annotations

import functools
import sys
import time

import lightning as L
import torch

import daskdist as dd
from daskdist.integrations.lightning import DaskdistStrategy
from tests.framework_rows import count_ids, log_event
from tests.processes import use_fork_server

NAME = "lightning-rows"  # the dataset's name: its ledger travels in the checkpoints
EVERY = 4  # commits between checkpoints
BATCH = 24  # rows of a step, over all ranks
SEED = 11


class RowModule(L.LightningModule):
    """y = 2x + 1 with a counts buffer: every step adds the ids the ranks trained on."""

    def __init__(self, n: int, logdir: str | None = None, pause: float = 0.0):
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.register_buffer("counts", torch.zeros(n, dtype=torch.float64))
        self.logdir = logdir
        self.pause = pause

    def training_step(self, batch, batch_idx):
        count_ids(self.counts, batch["id"])
        n = len(batch["id"])
        pred = self.net(batch["x"].unsqueeze(-1)).squeeze(-1)
        time.sleep(self.pause)
        return (pred - batch["y"]).pow(2).sum() / max(1, n)  # a rank may get 0 rows

    def on_train_start(self):
        log_event(self.logdir, "start", self.trainer.global_step)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        log_event(self.logdir, "step", self.trainer.global_step)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def make_module(ctx, n, logdir=None, pause=0.0):
    torch.manual_seed(100 + ctx.worker_index)  # fresh replicas differ: sync() must fix it
    return RowModule(n, logdir, pause)


def fit(module, it, commit_every=1, checkpoint_to=None, every=EVERY):
    """The SPEC's gang closure: a plain Trainer.fit over the per-worker batches."""
    strategy = DaskdistStrategy(commit_every=commit_every, checkpoint_to=checkpoint_to,
                                every=every)
    trainer = L.Trainer(strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, train_dataloaders=dd.collective.synced(it))
    return dd.collective.get_group().rank, trainer.global_step


def drive(coord, ds, module, it, commit_every=1, checkpoint_to=None, deadline=240.0):
    """The driver's loop: fit until every row of the epoch is acknowledged."""
    end = time.monotonic() + deadline
    runs = []
    while not ds.progress()["complete"]:
        assert time.monotonic() < end, ds.progress()
        runs.append(coord.fetch(coord.schedule_on_all(
            fit, args=(module, it, commit_every, checkpoint_to))))
    return runs


def main(url: str, data: str, n: int, workers: int, logdir: str) -> None:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-job")
        coord.wait_for_workers(workers, timeout=120)
        coord.collective_group(timeout=60)
        module = coord.create_per_worker_resource(
            functools.partial(make_module, n=n, logdir=logdir, pause=0.05))
        ds = coord.distribute_dataset(data, global_batch_size=BATCH, policy="dynamic",
                                      shuffle=True, seed=SEED, prefetch=0, name=NAME)
        print("training", flush=True)
        drive(coord, ds, module, iter(ds), checkpoint_to=url, deadline=600.0)
        print("complete", flush=True)


if __name__ == "__main__":
    use_fork_server("tests.lightning_job")  # its workers fork with this module imported
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

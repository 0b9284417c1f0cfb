"""Lightning's ``Trainer.fit`` on a daskdist cluster: elastic, exactly once (SPEC §4.4).

    pip install daskdist[lightning]
    python examples/lightning_fit.py --workers 2 --rows 20000

The ``LightningModule`` is the plain script's (``examples/plain/lightning_fit.py``, run
with torchrun) unchanged, and ``train`` differs in the three lines marked ``# daskdist``:
the strategy, the per-worker batches, and this import. ``main`` is the driver: a
cluster, the module as a per-worker resource, a ``"dynamic"`` dataset, and the loop
that runs ``train`` on every member until every row of the epoch is committed. Kill a
worker while it runs (``--kill``): ``fit`` runs again from the last commit.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time

import lightning as L
import torch

import daskdist as dd
from daskdist.integrations.lightning import DaskdistStrategy  # daskdist


class Regression(L.LightningModule):
    """A small MLP regressor: y from x (``features`` wide)."""

    def __init__(self, features: int = 16, hidden: int = 64, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        n = len(batch["y"])
        pred = self.net(batch["x"]).squeeze(-1)
        loss = (pred - batch["y"]).pow(2).sum() / max(1, n)  # a rank may get 0 rows
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def train(module, batches, commit_every=1, callbacks=()):
    trainer = L.Trainer(strategy=DaskdistStrategy(commit_every), max_epochs=1,  # daskdist
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module, train_dataloaders=dd.collective.synced(batches))  # daskdist
    return trainer.global_step, float(trainer.callback_metrics["train_loss"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=512, help="global batch size")
    p.add_argument("--commit-every", type=int, default=1)
    p.add_argument("--scheduler", help="a running scheduler's address (else a LocalCluster)")
    p.add_argument("--kill", action="store_true", help="SIGKILL rank 0 mid-epoch")
    args = p.parse_args(argv)

    from distributed import Client, LocalCluster

    from daskdist.cli import write_shards

    data = tempfile.mkdtemp(prefix="daskdist-lightning-")
    write_shards(data, rows=args.rows, files=4)
    cluster = None if args.scheduler else LocalCluster(
        n_workers=args.workers, threads_per_worker=1, dashboard_address=None)
    with Client(args.scheduler or cluster) as client:
        coord = dd.Coordinator(client, name="lightning-fit")
        group = coord.collective_group(backend="auto", timeout=60)
        module = coord.create_per_worker_resource(lambda ctx: Regression())
        ds = coord.distribute_dataset(f"{data}/*.parquet", global_batch_size=args.batch_size,
                                      shuffle=True, policy="dynamic", name="lightning-fit")
        it = iter(ds)
        rank0 = group.members[0]
        kill = [KillAt(client.run(os.getpid, workers=[rank0])[rank0],
                       step=max(1, args.rows // args.batch_size // 3))] if args.kill else []
        t0 = time.perf_counter()
        runs = 0
        while not ds.progress()["complete"]:  # a re-run after a loss: fit resumes
            results = coord.fetch(coord.schedule_on_all(
                train, args=(module, it, args.commit_every, kill)))
            runs += 1
        if kill and rank0 not in client.scheduler_info()["workers"]:
            print(f"killed rank 0 (pid {kill[0].pid}) at step {kill[0].step}")
        progress = ds.progress()
        summary = {"acknowledged": progress["acknowledged"], "total": progress["total"],
                   "global_step": results[0][0], "loss": results[0][1], "runs": runs,
                   "seconds": round(time.perf_counter() - t0, 2)}
        print(summary)
        coord.close()
    if cluster is not None:
        cluster.close()
    return summary


class KillAt(L.Callback):
    """SIGKILL the worker process ``pid`` (rank 0 when the group formed) after its
    ``step``-th optimizer step (``--kill``): a real preemption at a known point of the
    epoch, however fast the machine; any other process ignores it."""

    def __init__(self, pid: int, step: int):
        self.pid, self.step = pid, step

    def on_train_batch_end(self, trainer, *args) -> None:
        if os.getpid() == self.pid and trainer.global_step >= self.step:
            os.kill(self.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()

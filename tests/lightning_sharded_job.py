"""What the sharded Lightning test trains (pickled by reference): a LightningModule that
shards itself in ``configure_model`` (FSDP2 over ``self.device_mesh["data_parallel"]``,
Lightning's ModelParallel convention), whose parameter ``counts`` counts the rows it
trained on (tests/sharded_job.py's model), fitted with ``DaskdistStrategy``."""

from __future__ import annotations

import lightning as L
import torch

import daskdist as dd
from daskdist.integrations.common import kept_state
from daskdist.integrations.lightning import DaskdistStrategy
from tests.framework_rows import log_event
from tests.sharded_job import CountNet


class ShardedRows(L.LightningModule):
    """CountNet, sharded in configure_model; logs its starts and steps."""

    def __init__(self, n: int, logdir: str | None = None, pause: float = 0.0):
        super().__init__()
        self.n, self.logdir, self.pause = n, logdir, pause
        self.net: CountNet | None = None
        self.sharded_over: list[int] = []  # world sizes configure_model sharded over

    def configure_model(self):
        if self.net is not None:
            return  # idempotent, as Lightning asks: a later fit of the same group
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        self.net = CountNet(self.n)
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net.mlp, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
        self.sharded_over.append(mesh.size())

    def training_step(self, batch, batch_idx):
        import time

        ids = batch["id"]
        torch.manual_seed(self.global_step)
        x = torch.randn(len(ids), 4)
        time.sleep(self.pause)
        return self.net(ids, x, self.trainer.world_size)

    def on_train_start(self):
        log_event(self.logdir, "start", self.trainer.global_step)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        log_event(self.logdir, "step", self.trainer.global_step)

    def configure_optimizers(self):
        from tests.sharded_job import optimizer

        opt = optimizer(self.net.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=1.0)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def make_module(ctx, n, logdir=None, pause=0.0):
    return ShardedRows(n, logdir, pause)


def fit(module, it, dims=("data_parallel",)):
    strategy = DaskdistStrategy(device_mesh=dims)
    trainer = L.Trainer(strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, train_dataloaders=dd.collective.synced(it))
    return dd.collective.get_group().rank, trainer.global_step, list(module.sharded_over)


def counts(module) -> tuple[int, list[float]]:
    """The committed global_step and per-row counts (every rank alike)."""
    state = kept_state(module)
    state.sync()
    return state.global_step, state.full_state_dict()["net.counts"].tolist()  # the module's keys

"""The plain Lightning script that ``examples/lightning_fit.py`` runs on daskdist.

    python -m torch.distributed.run --nproc_per_node 2 examples/plain/lightning_fit.py

``Regression`` and ``train`` are the example's, line for line, but for the lines
marked ``# daskdist`` there (tests/test_examples_frameworks.py checks it);
``benchmarks/bench_frameworks.py`` times this script under torchrun against the
example's ``train`` on daskdist.
"""

from __future__ import annotations

import os

import lightning as L
import torch

DEVICES = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's processes on this node


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
    trainer = L.Trainer(strategy="ddp", devices=DEVICES, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module, train_dataloaders=batches)
    return trainer.global_step, float(trainer.callback_metrics["train_loss"])


def synthetic(rows: int, features: int = 16, seed: int = 0) -> list[dict]:
    """``rows`` samples of y = x . w + noise, as dicts (a DataLoader stacks them)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, generator=g)
    x = torch.randn(rows, features, generator=g)
    y = x @ w + 0.01 * torch.randn(rows, generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(rows)]


if __name__ == "__main__":
    from torch.utils.data import DataLoader

    # Lightning splits the data over the ranks (a DistributedSampler)
    loader = DataLoader(synthetic(20_000), batch_size=256, shuffle=True)
    print(train(Regression(), loader))

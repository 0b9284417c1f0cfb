"""What the asynchronous-model tests train (pickled by reference): synthetic rows with
ids, a model that counts each row it learns in a parameter of its own beside a linear
regression, and one round of a closure (pull, inner steps, push).

With ``dd.asynchronous.Average()`` the global model's ``counts`` are the sum of the
applied deltas' row counts, exactly (small integers in float32): after an epoch every
row's count must be 1, whatever was killed, joined or refused."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import daskdist as dd

FEATURES = 4
TRUE_W = np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)


def write_rows(root: Path, rows: int, files: int = 4, groups: int = 4) -> Path:
    """``rows`` rows in ``files`` Parquet files: ``rid``, ``x`` (4 floats), ``y = x @ w``."""
    rng = np.random.default_rng(0)
    per = rows // files
    for f in range(files):
        rid = np.arange(f * per, (f + 1) * per, dtype=np.int64)
        x = rng.standard_normal((per, FEATURES)).astype(np.float32)
        y = x @ TRUE_W
        xs = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES)
        pq.write_table(pa.table({"rid": rid, "x": xs, "y": y}), root / f"p{f}.parquet",
                       row_group_size=max(1, per // groups))
    return root


class Counting(torch.nn.Module):
    """A count per row id (a step's gradient is minus its batch's bincount: SGD with
    learning rate 1 adds the batch's rows) beside a linear regression; ``pad`` unused
    parameters make the model as large as a test wants (what a pull moves)."""

    def __init__(self, rows: int, pad: int = 0) -> None:
        super().__init__()
        self.counts = torch.nn.Parameter(torch.zeros(rows))
        self.lin = torch.nn.Linear(FEATURES, 1)
        self.pad = torch.nn.Parameter(torch.zeros(pad))

    def loss(self, batch: dict) -> tuple[torch.Tensor, float]:
        c = torch.bincount(batch["rid"], minlength=self.counts.numel()).float()
        mse = torch.nn.functional.mse_loss(self.lin(batch["x"]).squeeze(-1), batch["y"])
        # the regression learns at 0.03 under the counts' learning rate of 1
        return -(self.counts * c).sum() + 0.03 * mse, float(mse.detach())


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def local_round(replica, it, steps: int, pause: float = 0.0) -> dict:
    """One round: pull, up to ``steps`` inner steps, push; what it did."""
    version = replica.pull()
    losses = []
    for _ in range(steps):
        batch = next(it, None)
        if batch is None:
            break
        loss, mse = replica.model.loss(batch)
        loss.backward()
        replica.optimizer.step()
        replica.optimizer.zero_grad()
        losses.append(mse)
        time.sleep(pause)
    out = replica.push()
    where = dd.get_worker_context().address
    return {**out, "pulled": version, "losses": losses,
            "thread": (where, threading.get_ident()), "model": (where, id(replica.model))}


def mse_of(state: dict, root: Path) -> float:
    """The regression's mean squared error over every row, with the global weights."""
    table = pq.read_table(list(sorted(root.glob("*.parquet"))))
    x = np.asarray(table["x"].combine_chunks().flatten()).reshape(-1, FEATURES)
    y = np.asarray(table["y"])
    w = state["lin.weight"].numpy().reshape(-1)
    b = float(state["lin.bias"].numpy().reshape(-1)[0])
    return float(np.mean((x @ w + b - y) ** 2))

"""Train an MLP on a dask DataFrame, streamed: ETL on Dask, training on daskdist.

    pip install "daskdist[dataframe]"
    python examples/tabular_dataframe.py --partitions 40 --rows 5000 --epochs 2
    python examples/tabular_dataframe.py --scheduler tcp://head:8786 --gpus

The frame is lazy (``from_map`` of a reader, a ``query``, a ``map_partitions`` that
adds features): nothing is computed up front and nothing is written back to Parquet.
``distribute_dataset(frame, ...)`` gives each worker a loader that leases partitions,
has Dask compute each one from the frame's own graph when it is leased (at most
``daskdist.data.partitions-ahead`` ahead), and lets Dask forget it once its rows are
converted. Async closures (``coord.schedule``) each train one batch on their worker's
replica; every row of each epoch reaches exactly one completed closure, also when a
worker dies (its partitions go back to the pool and Dask recomputes them).

With ``--gpus`` only workers started with ``--resources GPU=1`` train
(``Coordinator(client, resources={"GPU": 1})``): the others run the ETL for them.

:func:`train` is what ``tests/test_collections_examples.py`` runs at a small size.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

import daskdist as dd

FEATURES = 8


def read_partition(i: int, rows: int = 5000):
    """A stand-in for reading one file of raw records: ids, a category, raw numbers
    (some labels are missing: -1)."""
    import pandas as pd

    rng = np.random.default_rng(i)
    raw = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    label = (raw @ np.linspace(-1, 1, FEATURES, dtype=np.float32) > 0).astype(np.int64)
    label[rng.random(rows) < 0.05] = -1
    frame = pd.DataFrame(raw, columns=[f"raw{k}" for k in range(FEATURES)])
    frame.insert(0, "id", np.arange(rows, dtype=np.int64) + i * rows)
    frame["city"] = rng.choice(["lyon", "oslo", "lima"], rows)
    frame["label"] = label
    return frame


def featurize(frame):
    """Per-partition features: standardized numbers, a one-hot city, float labels."""
    raw = frame[[f"raw{k}" for k in range(FEATURES)]].to_numpy(np.float32)
    out = frame[["id"]].copy()
    for k in range(FEATURES):
        out[f"f{k}"] = (raw[:, k] - raw[:, k].mean()) / (raw[:, k].std() + 1e-6)
    for city in ("lyon", "oslo", "lima"):
        out[f"is_{city}"] = (frame["city"] == city).to_numpy(np.float32)
    out["label"] = frame["label"].to_numpy(np.float32)
    return out


def make_frame(partitions: int, rows: int):
    """The lazy ETL: read, filter, featurize (nothing computed here)."""
    import dask.dataframe as ddf

    raw = ddf.from_map(read_partition, range(partitions), rows=rows)
    return raw.query("label >= 0").map_partitions(featurize)


def make_replica(ctx):
    """This worker's model and optimizer, and a lock: a Dask worker runs closures in
    several threads, and one replica takes one optimizer step at a time."""
    import torch

    width = FEATURES + 3
    model = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1)).to(ctx.device)
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3),
            "lock": threading.Lock()}


def step(replica, it):
    """One batch on this worker's replica; ``None`` when no unleased rows remain now."""
    import torch

    try:
        batch = next(it)
    except StopIteration:
        return None
    columns = [f"f{k}" for k in range(FEATURES)] + ["is_lyon", "is_oslo", "is_lima"]
    x = torch.stack([batch[c] for c in columns], dim=1)
    with replica["lock"]:
        logits = replica["model"](x).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])
        replica["opt"].zero_grad()
        loss.backward()
        replica["opt"].step()
    return loss.item(), batch["id"].tolist()


def train(coord, partitions: int = 40, rows: int = 5000, epochs: int = 2,
          global_batch_size: int = 512, closures: int = 16) -> list[dict]:
    """Train ``epochs`` epochs; per epoch its rows, ids trained and last loss."""
    frame = make_frame(partitions, rows)
    replica = coord.create_per_worker_resource(make_replica)
    ds = coord.distribute_dataset(frame, global_batch_size=global_batch_size,
                                  shuffle=True, name="tabular")
    report = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        it = iter(ds)
        ids: list[int] = []
        loss = float("nan")
        t0 = time.perf_counter()
        while not ds.progress()["complete"]:
            for out in coord.fetch([coord.schedule(step, args=(replica, it))
                                    for _ in range(closures)]):
                if out is not None:
                    loss, batch_ids = out
                    ids += batch_ids
        p = ds.progress(epoch)
        report.append({"epoch": epoch, "rows": p["acknowledged"], "ids": ids,
                       "loss": loss, "seconds": time.perf_counter() - t0})
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help="a running Dask scheduler (default: a local "
                        "cluster of --workers workers)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=40)
    parser.add_argument("--rows", type=int, default=5000, help="rows per raw partition")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--gpus", action="store_true",
                        help="train only on workers with the Dask resource GPU=1")
    args = parser.parse_args(argv)
    from distributed import Client, LocalCluster

    cluster = None
    if args.scheduler:
        client = Client(args.scheduler)
    else:
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=2)
        client = Client(cluster)
    coord = dd.Coordinator(client, resources={"GPU": 1} if args.gpus else None)
    try:
        for r in train(coord, args.partitions, args.rows, args.epochs, args.batch_size):
            print(f"epoch {r['epoch']}: {r['rows']} rows (each once: "
                  f"{len(r['ids']) == len(set(r['ids']))}), loss {r['loss']:.3f}, "
                  f"{r['seconds']:.1f} s")
    finally:
        coord.close()
        client.close()
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    main()

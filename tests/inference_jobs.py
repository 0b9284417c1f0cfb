"""What the batch-inference tests run on their workers (pickled by reference): Parquet
files and a lazy frame whose partitions log their computation, a model whose builds are
logged, and a ``predict`` that logs the rows it predicts (and may pause, or raise on a
row while a flag file exists). Every row has ``id`` and ``x = id / 2``; predict gives
``y = model * x = id``, so an output row says which input row it is."""

from __future__ import annotations

import functools
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch


def write_files(directory: str, files: int = 4, rows: int = 1000, group: int = 250) -> str:
    """``files`` Parquet files of ``rows`` rows in row groups of ``group``; their glob."""
    os.makedirs(directory, exist_ok=True)
    for i in range(files):
        ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": (ids / 2).astype(np.float32)}),
                       f"{directory}/part{i}.parquet", row_group_size=group)
    return f"{directory}/*.parquet"


def part(i: int, rows: int, log: str | None = None, pause: float = 0.0):
    """Partition ``i`` of a lazy frame (``pause`` seconds to prepare); computing it on a
    worker logs ``i`` and the worker's address."""
    import pandas as pd

    if pause:
        time.sleep(pause)
    if log is not None:
        try:
            from distributed import get_worker

            where = get_worker().address
            with open(log, "a") as f:
                f.write(f"{i} {where}\n")
        except ValueError:  # Dask's meta, on the client
            pass
    ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
    return pd.DataFrame({"id": ids, "x": (ids / 2).astype(np.float32)})


def frame(parts: int = 6, rows: int = 300, log: str | None = None, pause: float = 0.0):
    """A lazy frame of ``parts`` partitions (its meta given: Dask computes no partition
    for it, on the client or, materializing the graph, on a worker)."""
    import dask.dataframe as ddf
    import pandas as pd

    meta = pd.DataFrame({"id": np.array([], dtype=np.int64), "x": np.array([], np.float32)})
    return ddf.from_map(functools.partial(part, rows=rows, log=log, pause=pause),
                        range(parts), meta=meta)


def model(ctx, log: str | None = None):
    """The model: ``2.0`` on the worker's device; each build logs this process's pid."""
    if log is not None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
    return torch.tensor(2.0, device=ctx.device)


def broken_model(ctx):
    """A model whose weights are missing."""
    raise OSError("no weights at /nowhere/model.pt")


def predict(m, batch, log: str | None = None, bad: tuple[int, str] | None = None,
            pause: float = 0.0, gate: str | None = None) -> dict:
    """``y = m * x``; logs ``pid first last+1`` of each batch; raises on row ``bad[0]``
    while the file ``bad[1]`` exists; sleeps ``pause`` seconds a batch; waits (at most
    120 s) until the file ``gate`` exists."""
    if gate is not None:
        deadline = time.monotonic() + 120.0
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
    ids = batch["id"]
    if log is not None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {int(ids.min())} {int(ids.max()) + 1}\n")
    if bad is not None and os.path.exists(bad[1]) and bool((ids == bad[0]).any()):
        raise ZeroDivisionError(f"row {bad[0]} is bad")
    if pause:
        time.sleep(pause)
    return {"y": m * batch["x"]}


def builds(log: str) -> list[int]:
    """The pids that built the model, one per build."""
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [int(line) for line in f if line.strip()]


def predicted(log: str) -> list[tuple[int, int]]:
    """The row ranges predicted so far, one per batch (with repeats)."""
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [(int(a), int(b)) for _, a, b in (line.split() for line in f if line.strip())]


def computed(log: str) -> list[int]:
    """The partitions computed on workers so far (with repeats)."""
    return [i for i, _ in computed_where(log)]


def computed_where(log: str) -> list[tuple[int, str]]:
    """(partition, the worker that computed it), so far (with repeats)."""
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [(int(i), where) for i, where in (line.split() for line in f if line.strip())]


def exactly_once(df, n: int) -> None:
    """The output holds every row ``0 .. n-1`` once, each predicted right."""
    pdf = df.compute().sort_values("id")
    assert pdf["id"].tolist() == list(range(n)), "rows missing or repeated"
    assert np.allclose(pdf["y"].to_numpy(), pdf["id"].to_numpy())


def seen(dask_scheduler, coordinator: str) -> tuple[list, dict]:
    """What the scheduler shows of coordinator ``coordinator``'s batch-inference jobs: the
    status.json snapshot's ``inference`` rows, and the ``daskdist_infer_*`` samples by
    name and labels (run on the scheduler)."""
    from daskdist.plugins.scheduler.stats import snapshots
    from daskdist.plugins.scheduler.web.pages import MetricsCollector

    plugin = dask_scheduler.extensions["daskdist"]
    rows = snapshots(plugin)[coordinator]["inference"]
    samples = {}
    for family in MetricsCollector(plugin).collect():
        for s in family.samples:
            if s.name.startswith("daskdist_infer") and s.labels.get("coordinator") == coordinator:
                samples[(s.name, s.labels.get("job"), s.labels.get("worker"))] = s.value
    return rows, samples

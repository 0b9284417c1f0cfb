"""Embeddings of a dask DataFrame, written exactly once: batch inference on daskdist.

    python examples/batch_inference.py --partitions 40 --rows 5000 --output /tmp/emb
    python examples/batch_inference.py --kill            # SIGKILL a worker mid-job
    python examples/batch_inference.py --output /tmp/emb # again: resumes, or is done
    python examples/batch_inference.py --scheduler tcp://head:8786 --gpus --output s3://b/emb

The frame is lazy (``from_map`` of a reader, a ``map_partitions`` of features): nothing is
computed up front. ``coord.map_batches(embed, frame, output=..., model=load_encoder)``
hands the job to the scheduler plugin, which runs it on the members: each builds the
encoder once, leases the frame's partitions (Dask computes each one when leased, on the
helpers with ``--gpus``), embeds them batch by batch and commits one Parquet file per
partition (staged, then the first attempt to finish wins), then a manifest and
``_SUCCESS``. With ``--kill`` a worker is killed mid-job: its partitions go back to the
pool and the output still holds every row once. Run it again with the same ``--output``
and it resumes (or finds the job complete) without recomputing what was committed.

:func:`run` is what ``tests/test_inference.py`` runs at a small size.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time

import numpy as np

import daskdist as dd

FEATURES, DIM = 32, 16


def read_partition(i: int, rows: int = 5000):
    """A stand-in for reading one file of records: ids and raw numbers."""
    import pandas as pd

    rng = np.random.default_rng(i)
    raw = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    frame = pd.DataFrame(raw, columns=[f"raw{k}" for k in range(FEATURES)])
    frame.insert(0, "id", np.arange(rows, dtype=np.int64) + i * rows)
    return frame


def featurize(frame):
    """Per-partition features: standardized numbers."""
    raw = frame[[f"raw{k}" for k in range(FEATURES)]].to_numpy(np.float32)
    out = frame[["id"]].copy()
    z = (raw - raw.mean(axis=0)) / (raw.std(axis=0) + 1e-6)
    for k in range(FEATURES):
        out[f"f{k}"] = z[:, k]
    return out


def make_frame(partitions: int, rows: int):
    """The lazy ETL: read, featurize (nothing computed here)."""
    import dask.dataframe as ddf

    return ddf.from_map(read_partition, range(partitions), rows=rows).map_partitions(featurize)


def load_encoder(ctx):
    """The encoder, built once per worker on its device (a trained model would load its
    weights here)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, DIM)).to(ctx.device).eval()


def embed(encoder, batch) -> dict:
    """A batch's unit-norm embeddings (a [B, DIM] tensor: a fixed-size list column)."""
    import torch

    device = next(encoder.parameters()).device
    x = torch.stack([batch[f"f{k}"] for k in range(FEATURES)], dim=1).to(device)
    return {"embedding": torch.nn.functional.normalize(encoder(x), dim=1)}


def kill_a_worker(client, job, after_units: int = 3, timeout: float = 120.0) -> int | None:
    """SIGKILL one worker process of a local cluster once ``after_units`` units are
    committed; its pid (``None``: the job ended first)."""
    deadline = time.monotonic() + timeout
    while job.progress()["units"] < after_units:
        if job.done() or time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    pid = sorted(client.run(os.getpid).values())[0]
    os.kill(pid, signal.SIGKILL)
    return pid


def run(coord, output: str, partitions: int = 40, rows: int = 5000,
        batch_size: int = 1024, kill: bool = False, bar: bool = False) -> dict:
    """Embed the frame into ``output``; what happened: rows written, distinct ids,
    units, whether it resumed, the pid killed, seconds."""
    t0 = time.perf_counter()
    job = coord.map_batches(embed, make_frame(partitions, rows), output=output,
                            model=load_encoder, batch_size=batch_size, keep=["id"],
                            name="embeddings")
    killed = kill_a_worker(coord.client, job) if kill else None
    if bar:
        while not job.done():
            job.progress(bar=True)
            time.sleep(0.5)
    ids = job.result()["id"].compute()
    p = job.progress(bar=bar)
    return {"rows": len(ids), "distinct": ids.nunique(), "units": p["units"],
            "resumed_units": p["resumed_units"], "killed": killed,
            "seconds": time.perf_counter() - t0, "files": len(job.files())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help="a running Dask scheduler (default: a local "
                        "cluster of --workers workers)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=40)
    parser.add_argument("--rows", type=int, default=5000, help="rows per partition")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--output", help="where the embeddings go (a directory or an "
                        "fsspec URL; default: a new temporary directory)")
    parser.add_argument("--kill", action="store_true",
                        help="SIGKILL a worker mid-job (a local cluster's)")
    parser.add_argument("--gpus", action="store_true",
                        help="embed only on workers with a GPU; the others compute the frame")
    args = parser.parse_args(argv)
    from distributed import Client

    output = args.output or tempfile.mkdtemp(prefix="embeddings-")
    # a local cluster of --workers workers unless --scheduler names one (the client owns it)
    client = (Client(args.scheduler) if args.scheduler
              else Client(n_workers=args.workers, threads_per_worker=2))
    with client, dd.Coordinator(client, members="gpu" if args.gpus else None) as coord:
        r = run(coord, output, args.partitions, args.rows, args.batch_size, args.kill,
                bar=True)
        print(f"{r['rows']} embeddings ({r['distinct']} distinct ids) in {r['files']} files "
              f"at {output}, {r['units']} units ({r['resumed_units']} from an earlier run)"
              + (f", worker pid {r['killed']} killed mid-job" if r["killed"] else "")
              + f", {r['seconds']:.1f} s")

if __name__ == "__main__":
    main()

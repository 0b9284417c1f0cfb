"""Soak: many no-op closures and dynamic epochs; throughput and scheduler memory stay flat.

Run: ``python benchmarks/bench_soak.py [--closures 1000000] [--chunk 100000]
[--epochs 50] [--workers 2]`` (a quick run: ``--closures 100000 --chunk 20000
--epochs 5``).

The scheduler runs in a process of its own (``dask scheduler``), so its resident memory
is measured alone. Between chunks of ``--chunk`` no-op closures, a share of the
``--epochs`` dynamic epochs runs over small Parquet shards (a new iterator per epoch,
closures until the epoch is complete). Printed: closures/s of every chunk beside the
first chunk's (target: every ratio within 0.85..1.15), and the scheduler's RSS after the
first chunk and after the run (target: within 20 MB).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from distributed import Client
from figures import record

import daskdist as dd


def noop():
    return None


def take_rows(it):
    try:
        return len(next(it)["rid"])
    except StopIteration:
        return 0


def write_shards(root: Path, files: int = 4, groups: int = 4, rows: int = 250) -> int:
    rid = 0
    for f in range(files):
        n = groups * rows
        ids = np.arange(rid, rid + n, dtype=np.int64)
        pq.write_table(pa.table({"rid": ids, "x": ids.astype(np.float32)}),
                       root / f"part-{f:02d}.parquet", row_group_size=rows)
        rid += n
    return rid


def run_epoch(coord: dd.Coordinator, ds, epoch: int, total: int) -> None:
    ds.set_epoch(epoch)
    it = iter(ds)
    rows = 0
    for _ in range(1000):
        rows += sum(coord.fetch([coord.schedule(take_rows, args=(it,)) for _ in range(8)]))
        if ds.progress()["complete"]:
            break
    else:
        raise RuntimeError(f"epoch {epoch} did not complete: {ds.progress()}")
    if rows != total:
        raise RuntimeError(f"epoch {epoch}: {rows} rows delivered, {total} expected")


def start_cluster(tmp: Path, workers: int) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    sched_file = tmp / "scheduler.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    sched = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--port", "0",
         "--dashboard-address", ":0", "--scheduler-file", str(sched_file)], env=env, **quiet)
    deadline = time.monotonic() + 60
    while not sched_file.exists():
        if time.monotonic() > deadline or sched.poll() is not None:
            raise RuntimeError("the scheduler did not start")
        time.sleep(0.1)
    work = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
         str(sched_file), "--nworkers", str(workers), "--nthreads", "1",
         "--no-dashboard"], env=env, **quiet)
    return sched, work, json.loads(sched_file.read_text())["address"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--closures", type=int, default=1_000_000)
    ap.add_argument("--chunk", type=int, default=100_000)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    chunks = max(1, args.closures // args.chunk)

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "shards").mkdir()
        total = write_shards(tmp / "shards")
        sched, work, address = start_cluster(tmp, args.workers)
        proc = psutil.Process(sched.pid)
        try:
            with Client(address) as client:
                coord = dd.Coordinator(client, name="soak")
                coord.wait_for_workers(args.workers, timeout=120)
                ds = coord.distribute_dataset(str(tmp / "shards"), global_batch_size=100,
                                              policy="dynamic", name="soak")
                for _ in range(2000):  # warm up
                    coord.schedule(noop)
                coord.join()
                rates, rss = [], []
                epoch = 0
                for c in range(chunks):
                    t = time.perf_counter()
                    for _ in range(args.chunk):
                        coord.schedule(noop)
                    coord.join()
                    rates.append(args.chunk / (time.perf_counter() - t))
                    # this chunk's share of the dynamic epochs
                    while epoch < args.epochs * (c + 1) // chunks:
                        run_epoch(coord, ds, epoch, total)
                        epoch += 1
                    gc.collect()
                    coord._release_now()
                    time.sleep(0.5)  # let the scheduler finish its own bookkeeping
                    rss.append(proc.memory_info().rss / 2**20)
                    print(f"chunk {c + 1:3d}/{chunks}: {rates[-1]:8.0f} closures/s "
                          f"({rates[-1] / rates[0]:5.2f}x the first chunk) | epochs done "
                          f"{epoch:3d} | scheduler RSS {rss[-1]:7.1f} MB", flush=True)
                status = coord.status()
                coord.close()
        finally:
            work.terminate()
            sched.terminate()
            work.wait(30)
            sched.wait(30)
    lo, hi = min(rates) / rates[0], max(rates) / rates[0]
    far = max(rates, key=lambda r: abs(r / rates[0] - 1))  # the chunk farthest from the first
    record(f"throughput  per {args.chunk} closures: {min(rates):.0f}..{max(rates):.0f} "
           f"closures/s, {lo:.2f}x..{hi:.2f}x the first chunk (target within 0.85..1.15)",
           what=f"{args.closures:,} no-op closures + {args.epochs} dynamic epochs, the "
           f"chunk of {args.chunk:,} farthest from the first", ours=far, unit="closures/s",
           anchor="the first chunk", anchor_value=rates[0], target="0.85–1.15x",
           met=0.85 <= lo and hi <= 1.15)
    record(f"memory      scheduler RSS after the first chunk {rss[0]:.1f} MB, after the run "
           f"{rss[-1]:.1f} MB: {rss[-1] - rss[0]:+.1f} MB (target within 20 MB)",
           what=f"the scheduler's RSS growth from the first chunk ({rss[0]:.0f} MB) to "
           "the run's end", ours=rss[-1] - rss[0], unit="MB", anchor="the target's bound",
           anchor_value=20.0, target="≤ 20 MB", met=rss[-1] - rss[0] <= 20)
    print(f"state       {status['done']} closures done, {epoch} epochs, resources held "
          f"{status['resources']}, released {status['resources_released']}")


if __name__ == "__main__":
    main()

"""One model trained asynchronously on workers of mixed speeds (``coord.async_model``).

    python examples/async_mixed_speed.py --workers 3 --slowdown 3 --rows 30000 --epochs 2
    python examples/async_mixed_speed.py --scheduler tcp://head:8786 --workers 8

A dask-jobqueue allocation of two GPU generations, preemptible workers, a slow network:
workers rarely run at one pace. Here one worker (index 0) takes ``--slowdown`` times as
long per inner step (a ``sleep`` stands for an older accelerator). Each closure is a
round: pull the global model, ``replica.suggested_steps(H)`` inner steps (Asynchronous
Local-SGD's dynamic local updates: the slow worker takes fewer, so its rounds last as
long and its deltas are no staler), push the delta; the holder applies it with
FedAsync's ``Mixing`` (half of the way to the worker's weights with 3 workers, from
the version it pulled: a stale push does not overshoot). Nothing waits for the slow
worker: the driver keeps two rounds per worker in flight and schedules the next one as
each finishes.
Every row of every epoch is learned exactly once; the per-worker table at the end shows
who did what.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import numpy as np

import daskdist as dd
from daskdist.cli import FEATURES, async_round, write_shards


def make_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1))


def make_optimizer(params):
    import torch

    return torch.optim.SGD(params, lr=0.02)  # each replica's inner optimizer


def local_round(replica, it, steps: int, step_seconds: float, slowdown: float) -> dict:
    """One round on this worker's replica (the demo's, ``daskdist.cli.async_round``):
    worker 0 is ``slowdown`` times slower, and each worker takes the steps its speed
    suggests."""
    ctx = dd.get_worker_context()
    pace = step_seconds * (slowdown if ctx.worker_index == 0 else 1.0)
    losses, out = async_round(replica, it, replica.suggested_steps(steps), pace)
    return {**out, "steps": len(losses), "worker": ctx.address, "losses": losses}


def run_epochs(coord, am, ds, epochs: int, steps: int, step_seconds: float,
               slowdown: float, in_flight: int) -> list[dict]:
    """Rounds, ``in_flight`` at a time, until every row of each epoch is acknowledged;
    each round's outcome."""
    out: list[dict] = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        it = iter(ds)
        pending = []
        while not ds.progress()["complete"]:
            while len(pending) < in_flight:
                pending.append(coord.schedule(local_round, args=(am.replica, it, steps,
                                                                 step_seconds, slowdown)))
            done = [rv for rv in pending if rv.done()]
            if not done:
                time.sleep(0.005)
                continue
            for rv in done:
                pending.remove(rv)
                out.append(rv.fetch())
        out += coord.fetch(pending)  # the tail's rounds (they found no rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--slowdown", type=float, default=3.0, help="worker 0's step time, x")
    ap.add_argument("--rows", type=int, default=30_000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="inner steps a round (H)")
    ap.add_argument("--step-ms", type=float, default=5.0, help="a fast worker's step")
    ap.add_argument("--batch-size", type=int, default=64, help="per-worker batch size")
    ap.add_argument("--scheduler", default=None, help="a running scheduler's address")
    args = ap.parse_args()

    from distributed import Client, LocalCluster

    cluster = None
    if args.scheduler is None:
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1,
                               processes=True, dashboard_address=None,
                               silence_logs=logging.ERROR)
    with Client(args.scheduler or cluster) as client:
        coord = dd.Coordinator(client, name="async-mixed")
        coord.wait_for_workers(args.workers, timeout=120)
        data = tempfile.mkdtemp(prefix="daskdist-")
        write_shards(data, rows=args.rows, files=4)
        ds = coord.distribute_dataset(f"{data}/*.parquet", policy="dynamic", shuffle=True,
                                      global_batch_size=args.batch_size * args.workers)
        am = coord.async_model(model=make_model, optimizer=make_optimizer,
                               outer=dd.asynchronous.Mixing(),
                               max_staleness=16)
        t = time.perf_counter()
        rounds = run_epochs(coord, am, ds, args.epochs, args.steps, args.step_ms / 1e3,
                            args.slowdown, in_flight=2 * args.workers)
        seconds = time.perf_counter() - t
        losses = [x for r in rounds for x in r["losses"]]
        report = am.report()
        print(f"{args.epochs} epochs of {args.rows:,} rows in {seconds:.1f} s: version "
              f"{report['version']}, {report['applied']} deltas applied, "
              f"{report['refused']} refused; staleness median "
              f"{report['staleness']['median']:g}, p90 {report['staleness']['p90']:g}; "
              f"loss {losses[0]:.3f} -> {np.mean(losses[-20:]):.4f}")
        steps = {}
        for r in rounds:
            steps[r["worker"]] = steps.get(r["worker"], 0) + r["steps"]
        print(f"{'worker':<28}{'rounds':>8}{'rows':>9}{'steps':>8}{'steps/s':>9}{'share':>7}")
        for w in report["workers"]:
            print(f"{w['address']:<28}{w['rounds']:>8}{w['rows']:>9}"
                  f"{steps.get(w['address'], 0):>8}{w['steps_per_second']:>9.1f}"
                  f"{w['speed_share']:>7.2f}")
        coord.close()
    if cluster is not None:
        cluster.close()


if __name__ == "__main__":
    main()

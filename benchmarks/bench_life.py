"""A coordinator's life over a day of use: idle CPU with an error unread, and
worker memory over kernel restarts.

Run: ``python benchmarks/bench_life.py [--window 5] [--cycles 5] [--mb 150]``.

1. **Idle CPU with an error pending.** A LocalCluster (2 worker processes) whose
   scheduler runs in this process, beside the client. Measured over ``--window``
   seconds: this process's CPU with no coordinator at all (the anchor: Dask's own idle
   work, heartbeats and monitors), then with a coordinator whose closure failed and
   whose error nobody has read, another closure still running. Target: ours within 5%
   of a core of the anchor (before the fix: a whole core, 5.0 s of CPU in 5.0 s).
2. **Worker RSS over restarted kernels.** ``--cycles`` times a fresh ``Client`` (a
   restarted kernel), a ``Coordinator`` of the default name, a per-worker resource of
   ``--mb`` MB built on both workers, ``close()``. Printed: each worker's RSS after
   every cycle beside its RSS before the first (the anchor). Target: growth under one
   resource (before the fix: one resource a cycle, 431 -> 1031 MB).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import psutil
from distributed import Client, LocalCluster
from figures import record

import daskdist as dd
from daskdist.core.protocol import worker_plugin_name


def lookup(key):
    return {}[key]


def wait_for(gate, timeout=600.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)


def big(ctx, mb):
    return bytearray(b"x") * (mb * 2**20)


def use(res):
    return os.getpid(), len(res)


def cpu_share(window: float) -> float:
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(window)
    return (time.process_time() - cpu0) / (time.monotonic() - wall0)


def until(pred, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def idle_cpu(cluster, client, window: float) -> None:
    anchor = cpu_share(window)
    coord = dd.Coordinator(client, name="bench-idle")
    until(lambda: coord.status()["workers"] == 2, what="workers")
    with tempfile.TemporaryDirectory() as tmp:
        gate = os.path.join(tmp, "gate")
        running = coord.schedule(wait_for, args=(gate,))
        failed = coord.schedule(lookup, args=("missing",))
        failed.exception(timeout=60)
        until(lambda: coord.status()["error_pending"], what="the error")
        ours = cpu_share(window)
        open(gate, "w").close()
        running.exception(timeout=60)
    coord.close()
    record(f"idle CPU with an error pending: {100 * ours:.1f}% of a core; "
           f"Dask alone (anchor): {100 * anchor:.1f}%; ours - anchor = "
           f"{100 * (ours - anchor):+.1f} points (target < 5)",
           what="idle CPU, client + scheduler, an error unread", ours=100 * ours,
           unit="% of a core", anchor="Dask alone", anchor_value=100 * anchor,
           target="< +5 points", met=ours - anchor < 0.05)


def worker_rss(client) -> dict[str, float]:
    return {w: rss / 2**20 for w, rss in
            client.run(lambda: psutil.Process().memory_info().rss).items()}


def plugin_gone(client, name="default") -> bool:
    return all(client.run(lambda dask_worker, n=name:
                          worker_plugin_name(n) not in dask_worker.plugins).values())


def rss_cycles(cluster, client, cycles: int, mb: int) -> None:
    before = worker_rss(client)
    rows = []
    for _ in range(cycles):
        with Client(cluster) as kernel:
            coord = dd.Coordinator(kernel)
            res = coord.create_per_worker_resource(lambda ctx, mb=mb: big(ctx, mb))
            until(lambda c=coord, r=res: len({p for p, _ in c.fetch(
                [c.schedule(use, args=(r,)) for _ in range(4)])}) == 2, what="builds")
            coord.close()
        until(lambda: plugin_gone(client), what="the worker plugin to go")
        rows.append(worker_rss(client))
    worst = max(before, key=lambda w: rows[-1][w] - before[w])
    for w in sorted(before):
        trail = " -> ".join(f"{r[w]:.0f}" for r in rows)
        line = (f"worker RSS (MB), {cycles} create/close cycles with a {mb} MB resource: "
                f"{before[w]:.0f} (anchor) -> {trail}; growth {rows[-1][w] - before[w]:+.0f} "
                f"MB, {rows[-1][w] / before[w]:.2f}x (target: under +{mb} MB)")
        if w != worst:
            print(line)
            continue
        record(line, what=f"worker RSS after {cycles} create/close cycles of a {mb} MB "
               "resource (the worker that grew most)", ours=rows[-1][w], unit="MB",
               anchor="before the first", anchor_value=before[w], target=f"< +{mb} MB",
               met=rows[-1][w] - before[w] < mb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--mb", type=int, default=150)
    args, _ = parser.parse_known_args()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(2)
        idle_cpu(cluster, client, args.window)
        rss_cycles(cluster, client, args.cycles, args.mb)


if __name__ == "__main__":
    main()

"""The files a closure's path runs code in, counted by tracing it (issue 25 item 4).

The README's "How it is built" names every file a path crosses; this traces one closure
from ``schedule`` to ``fetch`` through the client, the scheduler and two workers of two
threads (``path_trace.py``) and holds the count to the issue's goal of 8.
"""

from __future__ import annotations

from collections import Counter

import path_trace
import pytest
from conftest import make_cluster
from distributed import Client

import daskdist as dd

RUNS = 5


def _noop(x=None):
    return x


def _start(client: Client) -> None:
    client.run(path_trace.start)
    client.run_on_scheduler(path_trace.start)
    path_trace.start()


def _stop(client: Client) -> set[str]:
    files = set(path_trace.stop())
    for seen in client.run(path_trace.stop).values():
        files.update(seen)
    files.update(client.run_on_scheduler(path_trace.stop))
    return files


def traced_files(client: Client, coord: dd.Coordinator, once) -> tuple[list[str], Counter]:
    """The files ``once()`` runs code in, in most of :data:`RUNS` traces; every file
    seen, with the number of traces that saw it."""
    counts: Counter = Counter()
    for _ in range(RUNS):
        _start(client)
        try:
            once()
        finally:
            counts.update(_stop(client))
    return sorted(f for f, n in counts.items() if n > RUNS // 2), counts


@pytest.mark.timeout(180)
def test_a_closure_crosses_at_most_eight_files():
    with make_cluster(n_workers=2, threads=2) as cluster, Client(cluster) as client:
        client.run(path_trace.install)
        client.run_on_scheduler(path_trace.install)
        client.sync(path_trace.install_async)
        path_trace.install()
        try:
            with dd.Coordinator(client, name="paths") as coord:
                coord.fetch([coord.schedule(_noop, args=(i,)) for i in range(20)])  # warm
                files, counts = traced_files(
                    client, coord, lambda: coord.fetch(coord.schedule(_noop, args=(1,))))
        finally:
            path_trace.uninstall()
            client.run(path_trace.uninstall)
            client.run_on_scheduler(path_trace.uninstall)
    print("closure path:", files, "seen:", dict(counts))
    assert "client/closures.py" in files and "core/queue.py" in files, counts
    assert len(files) <= 8, f"a closure runs code in {len(files)} files: {files} ({counts})"

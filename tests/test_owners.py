"""Errors belong to their owner, and an unread error costs no CPU (issue 16, point 2 and
SPEC §2.5b), on a real LocalCluster with worker processes."""

from __future__ import annotations

import os
import time

import pytest
from distributed import Client

import daskdist as dd
from tests.conftest import wait_for_workers, wait_until


def lookup(key):
    return {"a": 1}[key]


def square(x):
    return x * x


def cpu_over(window: float) -> tuple[float, float]:
    """CPU seconds this process (the client and the LocalCluster's scheduler) used over
    about ``window`` seconds of wall time, and that wall time."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(window)  # the measurement window, not a synchronisation
    return time.process_time() - cpu0, time.monotonic() - wall0


def wait_for_file(path, timeout=120.0):
    """A closure that runs until the test creates ``path``."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.path.exists(path)


def test_an_unread_error_leaves_client_and_scheduler_idle(client, tmp_path):
    """A failed closure the user has not read yet, another still running: the results
    long-poll still waits, so this process (client and LocalCluster scheduler) uses
    what Dask alone uses, not a core (5.0 s of CPU in 5.0 s before)."""
    window = 3.0
    dask_cpu, dask_wall = cpu_over(window)  # Dask's own idle work: heartbeats, monitors
    coord = dd.Coordinator(client, name="idle-error")
    try:
        wait_for_workers(client, coord, 2)
        gate = str(tmp_path / "gate")
        running = coord.schedule(wait_for_file, args=(gate,))
        failed = coord.schedule(lookup, args=("b",))
        assert isinstance(failed.exception(timeout=30), KeyError)
        wait_until(lambda: coord.status()["error_pending"], 10, "the error to be pending")
        cpu, wall = cpu_over(window)
        print(f"idle CPU with an error pending: {cpu:.3f} s in {wall:.2f} s "
              f"({100 * cpu / wall:.1f}% of a core; Dask alone: {100 * dask_cpu / dask_wall:.1f}%)")
        assert cpu - dask_cpu * wall / dask_wall < 0.05 * wall
        assert not running.done()
        open(gate, "w").close()
        with pytest.raises(KeyError):
            coord.join()  # the error is still there to be read
        assert running.fetch() is True
    finally:
        coord.close()


def test_errors_belong_to_the_owner_whose_closure_raised(cluster, client):
    """Two notebooks use the default name: B's KeyError is raised to B, never to A, and
    A's queued work is not cancelled by it."""
    with Client(cluster) as other:
        a = dd.Coordinator(client, name="shared")
        b = dd.Coordinator(other, name="shared")
        try:
            wait_for_workers(client, a, 2)
            bad = b.schedule(lookup, args=("b",))
            assert isinstance(bad.exception(timeout=30), KeyError)
            wait_until(lambda: a.status()["error_pending"], 10, "B's error to be pending")
            mine = [a.schedule(square, args=(i,)) for i in range(20)]
            a.join(timeout=60)  # B's error is not A's
            assert a.fetch(mine) == [i * i for i in range(20)]
            assert a.done()
            with pytest.raises(KeyError):
                b.join(timeout=60)
            assert b.schedule(square, args=(3,)).fetch(timeout=30) == 9
        finally:
            b.close()
            a.close()
